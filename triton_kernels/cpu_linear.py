"""A float32 linear layer for the CPU path, in C (cpu_linear.c), and the choice between it and
torch's matmul by the number of rows in a step.

The C file is compiled once per machine with the system's C compiler (`cc -O3 -march=native
-fopenmp`) into a cache folder the caller names, and called through ctypes (which releases
the GIL). Where there is no compiler, or the build fails, `load` returns None and the engine
keeps torch's matmul: the kernel is a speed-up, never a requirement."""

from __future__ import annotations

import bisect
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_linear.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]


class CpuLinear:
    """The compiled kernel. `__call__(x, weight, bias)` is F.linear for float32, contiguous
    rows, on the CPU."""

    def __init__(self, path: Path):
        torch.get_num_threads()  # torch (and its libgomp) first: the kernel shares that runtime
        lib = ctypes.CDLL(str(path))
        fn = lib.pageserve_linear_f32
        p, n = ctypes.c_void_p, ctypes.c_long
        fn.argtypes = [p, n, n, n, p, n, n, p, p, n]
        fn.restype = None
        self._fn = fn
        self.path = path

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu":
            raise TypeError(f"cpu_linear takes float32 CPU tensors, got {x.dtype} x {weight.dtype} on {x.device}")
        if x.shape[-1] != weight.shape[1] or weight.stride(1) != 1 or (bias is not None and not bias.is_contiguous()):
            raise ValueError(f"cpu_linear: x {tuple(x.shape)} against weight {tuple(weight.shape)} "
                             f"with strides {weight.stride()}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        rows, k = x2.shape
        out = torch.empty(rows, weight.shape[0], dtype=torch.float32)
        self._fn(x2.data_ptr(), rows, k, x2.stride(0), weight.data_ptr(), weight.shape[0],
                 weight.stride(0), None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0))
        return out.reshape(*lead, weight.shape[0])


def _build_key() -> str:
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(" ".join(FLAGS).encode())
    h.update(platform.machine().encode())
    try:  # -march=native: a different CPU model needs its own build
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
        h.update(flags.encode())
    except (OSError, StopIteration):
        pass
    return h.hexdigest()[:16]


def load(cache_dir: Path) -> CpuLinear | None:
    """The kernel, built into `cache_dir` on first use; None where it cannot be built."""
    if os.environ.get("PAGESERVE_NO_CPU_KERNELS") == "1":
        return None
    path = cache_dir / f"cpu_linear-{_build_key()}.so"
    if not path.is_file():
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            logger.info("no C compiler: the CPU path keeps torch's matmul")
            return None
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".so")  # built aside, then renamed: no torn file
        os.close(fd)
        try:
            subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", tmp], check=True, capture_output=True,
                           text=True, timeout=120)
            os.replace(tmp, path)
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            logger.warning("building the CPU linear kernel failed; keeping torch's matmul: %s",
                           detail.strip().splitlines()[-1] if detail.strip() else e)
            Path(tmp).unlink(missing_ok=True)
            return None
    try:
        return CpuLinear(path)
    except OSError as e:
        logger.warning("loading the CPU linear kernel failed; keeping torch's matmul: %s", e)
        return None


# rows of a step at which the two paths are timed; a step takes the choice of the next bucket up
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class LinearPlan:
    """Which matmul a float32 linear layer runs, by the number of rows in the step. Measured
    once at start-up on the model's own weights (`measure`); until then, and for steps above
    the largest bucket, torch's matmul."""

    def __init__(self, kernel: CpuLinear | None):
        self.kernel = kernel
        self.use_kernel = [False] * len(ROW_BUCKETS)
        self.timings: dict[int, tuple[float, float]] = {}  # rows -> (torch s, kernel s)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.shape[0]
        if rows <= ROW_BUCKETS[-1] and self.use_kernel[bisect.bisect_left(ROW_BUCKETS, rows)] \
                and x.dtype == torch.float32 and weight.dtype == torch.float32:
            return self.kernel(x, weight, bias)
        return F.linear(x, weight, bias)

    def measure(self, weights: list[torch.Tensor], reps: int = 3) -> None:
        """Time both paths over `weights` (a decoder layer's and the lm_head, say) at each row
        bucket, alternating, best of `reps`: the faster one runs steps of that size."""
        if self.kernel is None or not weights or any(w.dtype != torch.float32 for w in weights):
            return
        for i, rows in enumerate(ROW_BUCKETS):
            xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
            best = [float("inf"), float("inf")]
            for _ in range(reps):
                for j, fn in enumerate((F.linear, self.kernel)):
                    t = time.perf_counter()
                    for w in weights:
                        fn(xs[w.shape[1]], w)
                    best[j] = min(best[j], time.perf_counter() - t)
            self.timings[rows] = (best[0], best[1])
            self.use_kernel[i] = best[1] < best[0]
        logger.info("CPU linear, rows: torch / kernel ms, chosen: %s", ", ".join(
            f"{r}: {t * 1e3:.2f}/{k * 1e3:.2f} {'kernel' if use else 'torch'}"
            for (r, (t, k)), use in zip(self.timings.items(), self.use_kernel)))
