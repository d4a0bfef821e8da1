"""Which compiled variants of the Triton kernels the launches needed.

Triton compiles one variant of a kernel per specialization key: its constexpr values, the
dtype of every argument, whether each integer is 1 or divisible by 16 and each pointer
16-byte aligned (unless the argument is in `do_not_specialize`), and the launch options. On
CUDA each JITFunction keeps its variants in `device_caches`; the interpreter compiles nothing
and keeps no cache, so `VariantLog` computes, for every launch, the key that the CUDA launcher
would compute, with the same binder and the same integer and pointer rules (the NVIDIA
backend keeps Triton's base ones). The interpreter drops the launch options (num_warps,
num_stages) before its hooks run; the launchers pass constants there."""

from __future__ import annotations

import inspect
from collections import defaultdict

from triton.backends.compiler import BaseBackend
from triton.runtime.jit import KernelParam, create_function_from_signature

from pageserve.triton_kernels import (apply_token_bitmask, paged_attention, reshape_and_cache, rms_norm,
                                      rotary_embedding, silu_and_mul)

KERNEL_MODULES = (apply_token_bitmask, paged_attention, reshape_and_cache, rms_norm,
                  rotary_embedding, silu_and_mul)


def launched_kernels() -> dict[str, object]:
    """Every kernel a launcher starts (by convention named `_..._kernel`), by name."""
    return {name: obj for module in KERNEL_MODULES for name, obj in vars(module).items()
            if name.endswith("_kernel") and hasattr(obj, "pre_run_hooks")}


def _binder(kernel):
    """The function that turns a launch's arguments into its specialization, built as
    JITFunction builds it (JITFunction and the interpreter's function keep the settings apart)."""
    settings = getattr(kernel, "kwargs", None) or vars(kernel)
    dns = settings.get("do_not_specialize") or ()
    dns_align = settings.get("do_not_specialize_on_alignment") or ()
    signature = inspect.signature(kernel.fn)
    params = [KernelParam(i, p, i in dns or p.name in dns, i in dns_align or p.name in dns_align)
              for i, p in enumerate(signature.parameters.values())]
    return create_function_from_signature(signature, params, BaseBackend)


class VariantLog:
    """While entered, records the specialization key of every kernel launch, per kernel."""

    def __init__(self):
        self.keys: dict[str, set] = defaultdict(set)
        self._hooks: list[tuple[object, object]] = []

    def __enter__(self) -> "VariantLog":
        for name, kernel in launched_kernels().items():
            hook = self._hook(name, _binder(kernel))
            kernel.pre_run_hooks.append(hook)
            self._hooks.append((kernel, hook))
        return self

    def __exit__(self, *exc) -> None:
        for kernel, hook in self._hooks:
            kernel.pre_run_hooks.remove(hook)
        self._hooks.clear()

    def _hook(self, name: str, binder):
        def record(*args, **kwargs):
            _, specialization, options = binder(*args, **kwargs)
            self.keys[name].add((tuple(specialization), tuple(sorted(options.items()))))
        return record

    def snapshot(self) -> dict[str, frozenset]:
        return {name: frozenset(keys) for name, keys in self.keys.items()}

    def count(self) -> int:
        return sum(len(keys) for keys in self.keys.values())


def compiled_variants() -> dict[str, int]:
    """CUDA: how many compiled variants Triton holds per kernel (empty under the interpreter)."""
    counts = {}
    for name, kernel in launched_kernels().items():
        caches = getattr(kernel, "device_caches", {})
        counts[name] = sum(len(cache[0]) for cache in caches.values())
    return counts
