"""Loading a quantized checkpoint into our model. Before any memory is allocated (the model is on
the meta device), each linear layer the checkpoint quantizes gets compact storage in place of
its dense weight, and a mixture of experts' stacked w13 / w2 one stacked storage, expert by
expert; the checkpoint's tensors of each such layer are read into one QuantTensor as they stream
past, and written into that storage's rows (q/k/v, gate/up and each expert's gate/up fused,
tensor parallel shards cut by parallel.shard as for dense weights). Once the weights no longer
move, each expert's matrix is listed in its module's `parts`, a 2-D view the kernels' matmul
takes (bind_experts). Two storages:

- blocks: the C linear's block formats (CPU with the C kernels): one uint8 matrix a layer,
  each value widened by the kernel to the float32 QuantTensor.dequantize gives (in GGUF's
  smaller Q4_0 / Q4_1 / Q8_0 blocks where those hold the same values).
- packed: codes, scales and zeros as the Triton kernels (CUDA) and the torch fallback take them:
  int4, fp4 and nf4 eight codes an int32 word along K, int8 / FP8 as they are (with a scale per row or
  per group of columns); `weight.quant` says how."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from pageserve.runtime.models.loader import ModelLoadError, safetensors_files
from pageserve.runtime.quantization import method_for
from pageserve.runtime.quantization.methods import QuantMethod, UnsupportedQuantization
from pageserve.runtime.quantization.qtensor import QuantTensor
from pageserve.triton_kernels import cpu_blocks, torch_ops

logger = logging.getLogger(__name__)


def checkpoint_names(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of a directory's safetensors: name -> (shape, dtype name), read from the
    headers only."""
    from safetensors import safe_open

    out = {}
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    out[name] = (tuple(sl.get_shape()), sl.get_dtype())
        except Exception as e:  # safetensors raises its own error types on a missing or damaged file
            raise ModelLoadError(f"cannot read weights from {file}: {e}") from None
    return out


@dataclass
class Layer:
    """One quantized matrix of ours (several checkpoint layers where fused): a linear layer's
    `weight`, or an Experts module's `w13` / `w2`, one matrix an expert (`experts` of them)."""
    module: nn.Module
    param: str  # the parameter's name in `module`; its scales and zeros are param_scale, param_zero
    kind: str
    group_size: int
    rows: int  # out features (of one expert)
    in_features: int
    experts: int = 0  # 0: a linear layer
    input_scales: list = field(default_factory=list)  # each written part's static activation scale (or None)

    def shape(self, *tail: int) -> tuple[int, ...]:
        """A stored tensor's shape: `tail` after the rows (and the experts)."""
        return ((self.experts,) if self.experts else ()) + (self.rows, *tail)

    def tensor(self, suffix: str = "") -> nn.Parameter:
        return getattr(self.module, self.param + suffix)

    def store(self, suffix: str, value: torch.Tensor) -> None:
        setattr(self.module, self.param + suffix, nn.Parameter(value, requires_grad=False))

    def stored(self) -> dict[str, nn.Parameter]:
        """The parameters that hold this matrix (codes, scales, zeros), by name in the module."""
        return {n: p for n, p in self.module.named_parameters(recurse=False)
                if n == self.param or n.startswith(self.param + "_")}

    def input_scale(self) -> float | None:
        """The static activation scale of the whole layer: the largest of its parts' (and of its
        experts'), as vLLM takes for fused layers (None: activations quantized per token, or
        not at all)."""
        if any(s is None for s in self.input_scales) and any(s is not None for s in self.input_scales):
            raise ValueError(f"the parts of {self.param} have static activation scales and dynamic ones")
        return None if not self.input_scales or self.input_scales[0] is None else max(self.input_scales)


class BlockStorage:
    """The C linear's blocks of 32 values (cpu_blocks.py): int4 -> i4, int8 -> i8, fp8 -> f8,
    fp4 -> f4, nf4 -> n4."""
    name = "blocks"
    quantizes_activations = False  # the C linear multiplies float32 activations
    FORMATS = {"int4": "i4", "int8": "i8", "fp8": "f8", "fp4": "f4", "nf4": "n4"}

    def allocate(self, layer: Layer) -> None:
        k, g = layer.in_features, layer.group_size
        if k % 32 or g % 32 and not (layer.kind == "fp4" and g == 16):  # an f4 block holds two groups of 16
            raise UnsupportedQuantization(f"the CPU kernels take quantized rows and groups in multiples of 32 values; "
                                          f"a layer has {k} columns in groups of {g}")
        width = k // 32 * cpu_blocks.BLOCK_FORMATS[self.FORMATS[layer.kind]][1]
        layer.store("", torch.empty(layer.shape(width), dtype=torch.uint8))

    def write(self, layer: Layer, index: tuple, qt: QuantTensor) -> None:
        if qt.kind == "int4":
            raw = cpu_blocks.int4_blocks(qt.codes, qt.scales, qt.zeros, qt.group_size)
        elif qt.kind == "int8":
            raw = cpu_blocks.int8_blocks(qt.codes, qt.scales, qt.group_size)
        elif qt.kind == "fp4":
            raw = cpu_blocks.fp4_blocks(qt.codes, qt.scales, qt.group_size)
        elif qt.kind == "nf4":
            raw = cpu_blocks.nf4_blocks(qt.codes, qt.scales, qt.group_size)
        else:
            raw = cpu_blocks.fp8_blocks(qt.codes, qt.scales, qt.group_size)
        layer.tensor()[index].copy_(raw)

    def finish(self, layer: Layer) -> None:
        fmt, k, w = self.FORMATS[layer.kind], layer.in_features, layer.tensor().data
        if not layer.experts:
            setattr(layer.module, layer.param, cpu_blocks.smallest_blocks(cpu_blocks.blocks(w, fmt, k)))
            return
        # every expert's rows as one matrix: one block format for all of them
        small = cpu_blocks.smallest_blocks(cpu_blocks.blocks(w.view(-1, w.shape[-1]), fmt, k))
        layer.store("", small.data.view(layer.experts, layer.rows, -1))
        layer.tensor().block_format = small.block_format

    def expert(self, layer: Layer, e: int) -> torch.Tensor:
        """Expert e's matrix as the C linear takes it: a view of the stacked blocks."""
        stacked = layer.tensor()
        return cpu_blocks.blocks(stacked.data[e], stacked.block_format, layer.in_features)


@dataclass(frozen=True)
class PackedQuant:
    """How a packed weight is multiplied (attached to it as `weight.quant`)."""
    kind: str
    scales: torch.Tensor  # float32 [N, K / G] (int4, block-wise fp8) or [N]
    zeros: torch.Tensor | None  # uint8 [N, K / G] (int4)
    group_size: int
    in_features: int
    input_scale: float | None = None  # static activations: x quantized as x / input_scale (CUDA's W8A8)

    def dequantize(self, weight: torch.Tensor) -> torch.Tensor:
        """The float32 values [N, K] of `weight` (the torch path's matmul: CPU without the C
        kernels)."""
        if self.kind == "int4":
            return torch_ops.dequantize_int4(weight, self.scales, self.zeros, self.group_size)
        if self.kind in torch_ops.TABLES4:
            return torch_ops.dequantize_table4(weight, self.scales, self.group_size, torch_ops.TABLES4[self.kind])
        if self.group_size:
            return torch_ops.dequantize_groups(weight, self.scales, self.group_size)
        return weight.to(torch.float32) * self.scales[:, None]


class PackedStorage:
    """Codes, scales and zeros as separate tensors of the layer. quantizes_activations: whether
    the kernels that multiply them quantize 8-bit layers' activations (the Triton backend's W8A8)
    or dequantize the weight (torch's path)."""
    name = "packed"

    def __init__(self, quantizes_activations: bool = False):
        self.quantizes_activations = quantizes_activations

    def allocate(self, layer: Layer) -> None:
        k, g = layer.in_features, layer.group_size
        if layer.kind in ("int4", "fp4", "nf4"):
            if k % 8:
                raise UnsupportedQuantization(f"4-bit rows of {k} values: a multiple of 8 is needed")
            layer.store("", torch.empty(layer.shape(k // 8), dtype=torch.int32))
            layer.store("_scale", torch.empty(layer.shape(k // g)))
            if layer.kind == "int4":
                layer.store("_zero", torch.empty(layer.shape(k // g), dtype=torch.uint8))
        else:
            dtype = torch.int8 if layer.kind == "int8" else torch.float8_e4m3fn
            layer.store("", torch.empty(layer.shape(k), dtype=dtype))
            layer.store("_scale", torch.empty(layer.shape(k // g) if g else layer.shape()))

    def write(self, layer: Layer, index: tuple, qt: QuantTensor) -> None:
        if qt.kind in ("int4", "fp4", "nf4"):
            c = qt.codes.to(torch.int32).view(qt.shape[0], -1, 8)
            words = sum(c[:, :, j] << (4 * j) for j in range(8))  # wraps into the sign bit as int32 does
            layer.tensor()[index].copy_(words)
            if qt.kind == "int4":
                layer.tensor("_zero")[index].copy_(qt.zeros)
        else:
            layer.tensor()[index].copy_(qt.codes)
        layer.tensor("_scale")[index].copy_(qt.scales)

    def finish(self, layer: Layer) -> None:
        if not layer.experts:
            zeros = getattr(layer.module, layer.param + "_zero", None)
            layer.tensor().quant = self._quant(layer, layer.tensor("_scale"), zeros)

    def expert(self, layer: Layer, e: int) -> torch.Tensor:
        """Expert e's matrix: a view of the stacked codes that carries its scales' views."""
        w, zeros = layer.tensor().data[e], getattr(layer.module, layer.param + "_zero", None)
        w.quant = self._quant(layer, layer.tensor("_scale").data[e], None if zeros is None else zeros.data[e])
        return w

    @staticmethod
    def _quant(layer: Layer, scales: torch.Tensor, zeros: torch.Tensor | None) -> PackedQuant:
        return PackedQuant(layer.kind, scales, zeros, layer.group_size, layer.in_features, layer.input_scale())


class QuantizedLoad:
    """The quantized layers of one checkpoint for one model, from the checkpoint's names."""

    def __init__(self, method: QuantMethod, model: nn.Module, names: dict[str, tuple], storage):
        self.method, self.storage = method, storage
        self.prefixes: dict[str, set[str]] = {}  # checkpoint layer -> its tensors' suffixes
        self.layers: dict[str, Layer] = {}  # our parameter -> its layer
        optional = method.online  # made at load time: only the decoder layers' matrices and experts
        for prefix, suffixes in method.layers(names).items():
            if not model.checkpoint_held(prefix + ".weight"):  # another pipeline stage's layer
                continue
            target = model.checkpoint_target(prefix + ".weight") or ""
            module_name, _, param = target.rpartition(".")
            module = model.get_submodule(module_name) if module_name else None
            experts = param in ("w13", "w2") and type(module).__name__ == "Experts"
            linear = isinstance(module, nn.Linear) and param == "weight" and module_name.split(".")[-1] not in (
                "lm_head", "gate")
            if optional and not (linear and method.TARGETS.fullmatch(target) or experts):
                continue
            if not (linear or experts):
                what = "router" if module_name.endswith("gate") else type(module).__name__ if module else "tensor"
                raise UnsupportedQuantization(f"{method.name}: the quantized weights of {prefix} (a {what} of ours) "
                                              "are not supported; only the decoder layers' linear layers and experts "
                                              "may be quantized")
            kind, group = method.layout({s: names[f"{prefix}.{s}"] for s in suffixes})
            layer = self.layers.get(target)
            if layer is not None and (layer.kind, layer.group_size) != (kind, group):
                raise UnsupportedQuantization(f"{method.name}: the parts of {target} are quantized differently")
            if layer is None:
                shape = getattr(module, param).shape
                self.layers[target] = Layer(module, param, kind, group, shape[-2], shape[-1],
                                            shape[0] if experts else 0)
            self.prefixes[prefix] = suffixes

    def prepare(self) -> None:
        """Each quantized layer's storage in place of its dense weight (on the meta device)."""
        for layer in self.layers.values():
            self.storage.allocate(layer)
            layer.module.quant_load = self

    def stream(self, weights):
        """The checkpoint's (name, tensor) pairs with each quantized layer's tensors read into one
        (prefix.weight, QuantTensor), yielded once the last of them has passed."""
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            prefix, suffix = self.method.split(name)
            wanted = self.prefixes.get(prefix)
            if wanted is None or suffix not in wanted:
                yield name, tensor
                continue
            parts = pending.setdefault(prefix, {})
            parts[suffix] = tensor
            if len(parts) == len(wanted):
                del pending[prefix]
                yield f"{prefix}.weight", self.method.read(prefix, parts)
        if pending:
            raise ValueError(f"quantized layer {next(iter(pending))} is missing some of its tensors")

    def write(self, target: str, index: tuple, qt: QuantTensor) -> dict[str, int]:
        """`index` of our parameter `target` (rows; an expert, and its rows); returns the elements
        written in each of the layer's parameters, by name."""
        layer = self.layers[target]
        rows = index[-1] if index and isinstance(index[-1], slice) else slice(0, layer.rows)
        want = (rows.stop - rows.start, layer.in_features)
        if tuple(qt.shape) != want or (qt.kind, qt.group_size) != (layer.kind, layer.group_size):
            raise ValueError(f"quantized weight for {target} is {qt.kind} {tuple(qt.shape)} in groups of "
                             f"{qt.group_size}, expected {layer.kind} {want} in groups of {layer.group_size}")
        self.storage.write(layer, index, qt)
        layer.input_scales.append(qt.input_scale)
        return {name: p[index].numel() for name, p in layer.stored().items()}

    def bind_experts(self) -> None:
        """Each quantized Experts module's `parts`: every expert's matrix, a view of the stacked
        storage as the kernels' matmul takes it. Made once the weights no longer move (the CPU
        moves them into huge pages after finish)."""
        for layer in self.layers.values():
            if layer.experts:
                layer.module.parts[layer.param] = [self.storage.expert(layer, e) for e in range(layer.experts)]

    def finish(self) -> tuple[int, int]:
        """Marks each layer's storage for the kernels and logs what was saved; returns (bytes of
        the quantized layers, bytes the same layers take in 16 bits)."""
        stored = dense = 0
        for layer in self.layers.values():
            layer.module.__dict__.pop("quant_load", None)  # (an Experts module holds two layers)
            self.storage.finish(layer)
            stored += sum(p.numel() * p.element_size() for p in layer.stored().values())
            dense += 2 * math.prod(layer.shape(layer.in_features))
        if self.layers:
            logger.info("quantized weights: %s, %d layers stored as %s: %.1f MB (%.1f MB in 16 bits, %.1f MB saved)",
                        self.method.describe(), len(self.layers), self.storage.name, stored / 1e6, dense / 1e6,
                        (dense - stored) / 1e6)
        if any(layer.input_scale() is not None for layer in self.layers.values()) \
                and not self.storage.quantizes_activations:
            logger.info("the checkpoint's static activation scales are not used: these kernels multiply "
                        "unquantized activations (weight-only)")
        return stored, dense


def quantized_load(hf_config: dict, forced: str | None, model: nn.Module, path: Path, storage,
                   names: dict[str, tuple] | None = None) -> QuantizedLoad | None:
    """The checkpoint's quantized layers, their storage in place on the (meta) model; None for
    an unquantized checkpoint without --quantization. `names`: the checkpoint's tensors where
    they are not `path`'s safetensors (a GGUF file's)."""
    method = method_for(hf_config, forced)
    if method is None:
        return None
    quant = QuantizedLoad(method, model, checkpoint_names(path) if names is None else names, storage)
    quant.prepare()
    return quant
