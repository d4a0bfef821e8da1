"""One quantized matrix as the loader carries it from a checkpoint to a layer: every format read
(compressed-tensors, AWQ, GPTQ, online FP8) becomes one of three kinds, row-major over the
output features, so that fusing (q/k/v, gate/up) is a concatenation of rows and tensor
parallelism a slice of rows or of whole groups of columns.

- int4: codes uint8 [N, K] (0..15), scales float32 [N, K / G], zeros uint8 [N, K / G] (0..15; 8
  where the checkpoint is symmetric); value = (code - zero) * scale.
- int8: codes int8 [N, K], scales float32 [N], or [N, K / G] (8-bit GPTQ, W8A16); value = code *
  scale.
- fp8: codes float8_e4m3fn [N, K], scales float32 [N]; value = float(code) * scale.
- fp4: codes uint8 [N, K] (FP4 e2m1 codes 0..15: sign, two exponent bits, one mantissa bit),
  scales float32 [N, K / G] (NVFP4: G = 16); value = e2m1(code) * scale.
- nf4: codes uint8 [N, K] (bitsandbytes' NormalFloat codes 0..15), scales float32 [N, K / G]
  (each block's absmax, G = 64); value = NF4[code] * scale.

Each value is one float32 product of exact operands, rounded once: what `dequantize` gives, and
what every kernel widens a weight to. int8 and fp8 matrices may carry a static activation scale
(the checkpoint's `input_scale`, one a tensor): fused matrices take the largest of theirs, as in
vLLM."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pageserve.triton_kernels import torch_ops

KINDS = ("int4", "int8", "fp8", "fp4", "nf4")
# the 4-bit kinds read through a table: FP4's e2m1 values, bitsandbytes' NormalFloat4 (its
# quant_map for nf4), each a float32
TABLES = {kind: torch.tensor(values) for kind, values in torch_ops.TABLES4.items()}
NF4 = TABLES["nf4"]


@dataclass(frozen=True, slots=True)
class QuantTensor:
    kind: str
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None  # int4 only
    group_size: int = 0  # int4, fp4, grouped int8 and block-wise fp8: columns that share a scale (and a zero)
    input_scale: float | None = None  # int8 / fp8 with static activations: x is quantized as x / input_scale

    def __post_init__(self):
        n, k = self.codes.shape
        if self.kind == "int4":
            g = self.group_size
            if g <= 0 or k % g or self.scales.shape != (n, k // g) or self.zeros is None \
                    or self.zeros.shape != self.scales.shape:
                raise ValueError(f"int4 matrix {n}x{k}: scales {tuple(self.scales.shape)} and zeros "
                                 f"{None if self.zeros is None else tuple(self.zeros.shape)} do not make "
                                 f"groups of {g}")
        elif self.kind in ("fp8", "fp4", "nf4", "int8") and self.group_size:  # a scale a group of columns of a row
            g = self.group_size
            if k % g or self.scales.shape != (n, k // g):
                raise ValueError(f"{self.kind} matrix {n}x{k}: scales {tuple(self.scales.shape)} do not make "
                                 f"groups of {g}")
        elif self.kind in TABLES:
            raise ValueError(f"{self.kind} matrix {n}x{k}: a group size is needed")
        elif self.kind in ("int8", "fp8"):
            if self.scales.shape != (n,):
                raise ValueError(f"{self.kind} matrix {n}x{k}: scales {tuple(self.scales.shape)}, want ({n},)")
        else:
            raise ValueError(f"unknown quantized kind {self.kind!r}")
        if self.input_scale is not None and (self.kind in ("int4", "fp4", "nf4") or self.group_size
                                             or not 0 < self.input_scale < float("inf")):
            raise ValueError(f"{self.kind} matrix {n}x{k}: a static activation scale {self.input_scale} (one finite "
                             "positive scale, for int8 or per-row fp8 weights only)")

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> QuantTensor:
        """Rows (dim 0), or columns in whole groups (dim 1: a row-parallel shard)."""
        if dim == 0:
            return QuantTensor(self.kind, self.codes.narrow(0, start, length), self.scales.narrow(0, start, length),
                               None if self.zeros is None else self.zeros.narrow(0, start, length), self.group_size,
                               self.input_scale)
        if not self.group_size:
            return QuantTensor(self.kind, self.codes.narrow(1, start, length), self.scales,
                               input_scale=self.input_scale)
        g = self.group_size
        if start % g or length % g:
            raise ValueError(f"columns {start}..{start + length} of a matrix quantized in groups of {g} "
                             "do not fall on group boundaries")
        zeros = None if self.zeros is None else self.zeros.narrow(1, start // g, length // g)
        return QuantTensor(self.kind, self.codes.narrow(1, start, length),
                           self.scales.narrow(1, start // g, length // g), zeros, g)

    def split(self, sizes: list[int]) -> list[QuantTensor]:
        out, at = [], 0
        for size in sizes:
            out.append(self.narrow(0, at, size))
            at += size
        return out

    def chunk(self, n: int) -> list[QuantTensor]:
        return self.split([self.shape[0] // n] * n)

    @staticmethod
    def cat(parts: list[QuantTensor]) -> QuantTensor:
        """Rows of several matrices of one kind (and group size) as one; a static activation
        scale, the largest of the parts' (each part's x / scale then stays in range)."""
        first = parts[0]
        if any(p.kind != first.kind or p.group_size != first.group_size
               or (p.input_scale is None) != (first.input_scale is None) for p in parts):
            raise ValueError("fused matrices quantized differently: " + ", ".join(
                f"{p.kind}/{p.group_size}{'' if p.input_scale is None else '/static'}" for p in parts))
        zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts])
        static = None if first.input_scale is None else max(p.input_scale for p in parts)
        return QuantTensor(first.kind, torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                           zeros, first.group_size, static)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.cat:  # parallel.shard re-joins split parts (Phi-3's fused q/k/v)
            return cls.cat(list(args[0]))
        return NotImplemented

    def dequantize(self) -> torch.Tensor:
        """The float32 values [N, K] (the reference every kernel matches)."""
        if self.kind == "int4":
            g = self.group_size
            centred = self.codes.to(torch.float32) - self.zeros.to(torch.float32).repeat_interleave(g, dim=1)
            return centred * self.scales.repeat_interleave(g, dim=1)
        table = TABLES.get(self.kind)
        values = self.codes.to(torch.float32) if table is None else table.to(self.codes.device)[self.codes.long()]
        if self.group_size:
            return values * self.scales.repeat_interleave(self.group_size, dim=1)
        return values * self.scales[:, None]

    def nbytes(self) -> int:
        """Bytes of the stored form (4-bit codes two to a byte)."""
        codes = self.codes.numel() // 2 if self.kind in ("int4", "fp4", "nf4") else self.codes.numel()
        return codes + 4 * self.scales.numel() + (0 if self.zeros is None else self.zeros.numel())


def quantize_fp8(weight: torch.Tensor) -> QuantTensor:
    """A float matrix in FP8 E4M3 with one scale per output row (amax / 448), as vLLM's online
    `--quantization fp8` does."""
    w, top = weight.detach().to(torch.float32), torch.finfo(torch.float8_e4m3fn).max
    scales = (w.abs().amax(dim=1) / top).clamp(min=1e-12)
    return QuantTensor("fp8", (w / scales[:, None]).clamp(-top, top).to(torch.float8_e4m3fn), scales)


def unpack_bytes(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words holding four 8-bit values each (value j at bits 8j..8j+7) -> uint8 values,
    the four of each word consecutive along `dim` (as unpack_nibbles)."""
    shifts = torch.arange(0, 32, 8, dtype=torch.int32, device=words.device)
    if dim == 1:
        return ((words[:, :, None] >> shifts) & 0xFF).to(torch.uint8).reshape(words.shape[0], -1)
    return ((words[:, None, :] >> shifts[:, None]) & 0xFF).to(torch.uint8).reshape(-1, words.shape[1])


def unpack_nibbles(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words holding eight 4-bit values each (value j at bits 4j..4j+3) -> uint8 values,
    the eight of each word consecutive along `dim` (0: [R, C] -> [8R, C]; 1: [R, C] -> [R, 8C])."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    if dim == 1:
        return ((words[:, :, None] >> shifts) & 0xF).to(torch.uint8).reshape(words.shape[0], -1)
    return ((words[:, None, :] >> shifts[:, None]) & 0xF).to(torch.uint8).reshape(-1, words.shape[1])
