"""How a float32 model's matrices are kept on the CPU path with the C kernels, smaller than
float32 where that loses nothing: the C linear widens each weight to the same float32 value
as it reads it, so every sum is as before, to the bit, and a decode step, which reads every
matrix once, reads fewer bytes.

- `narrow_exact_matrices`: bfloat16, where every value's low 16 bits are zero (a checkpoint
  stored in bfloat16, as most are); else h16 blocks (32 half floats) for each matrix whose
  values are float16 values (a checkpoint stored in float16).
- `GGUFBlocks`: a GGUF file's own F16 matrices as h16 blocks (2 bytes a value), and its
  quantized blocks (Q8_0, Q4_0, Q4_1: 1.06, 0.56 and 0.63
  bytes a value; Q4_K, Q5_K and Q6_K, repacked 32 values a block: 0.75, 1.25 and 1.25; every
  other quantized type but Q8_1, Q8_K, MXFP4, NVFP4 and Q1_0 repacked too: Q3_K and the TQ
  types in 0.75 bytes a value, IQ4_NL and IQ4_XS in 0.625, the rest in 1.25 or Q2_K's 1.5:
  gguf_repack.py), loaded from the file, never dequantized to memory: the
  C kernels widen each to the float32 value gguf's dequantizer gives. A matrix whose parts mix
  formats (a fused q/k/v) keeps them all in x8; one with a float part (F16 beside another
  format, BF16, F32) stays float32. A mixture of experts' experts keep theirs, one matrix an expert."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from pageserve.runtime.models.gguf_repack import IQ4NL
from pageserve.triton_kernels.cpu_blocks import half_blocks
from pageserve.triton_kernels.cpu_kernels import BLOCK_FORMATS, blocks

# GGML tensor types kept as blocks -> our name of the format (cpu_kernels.BLOCK_FORMATS)
GGUF_BLOCKS = {8: "q8_0", 2: "q4_0", 3: "q4_1", 1: "h16"}


def repack_q4_k(raw: np.ndarray) -> np.ndarray:
    """Q4_K rows (superblocks of 256 values, 144 bytes: f16 d and dmin, 12 bytes of 6-bit
    scales and mins, 128 bytes of nibbles, sub-blocks 2j and 2j + 1 in the low and high nibbles
    of bytes 32j..32j+31) as k4 blocks, one a sub-block of 32: d * sc and dmin * m in float32
    (exact products), as gguf's dequantizer computes them, and the nibbles re-laid."""
    from gguf.quants import Q4_K

    rows = raw.shape[0]
    b = raw.reshape(-1, 144)
    d, dmin = b[:, 0:2].view(np.float16).astype(np.float32), b[:, 2:4].view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(b[:, 4:16])
    scale, offset = d * sc.astype(np.float32), dmin * m.astype(np.float32)  # [superblocks, 8]
    qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(-1, 8, 32)
    nibbles = q[:, :, :16] | (q[:, :, 16:] << 4)
    halves = [scale.reshape(-1, 8, 1).view(np.uint8), offset.reshape(-1, 8, 1).view(np.uint8)]
    out = np.concatenate([*halves, nibbles], axis=2)
    return np.ascontiguousarray(out).reshape(rows, -1)


def repack_q5_k(raw: np.ndarray) -> np.ndarray:
    """Q5_K rows (superblocks of 256 values, 176 bytes: f16 d and dmin, 12 bytes of 6-bit scales
    and mins, 32 bytes of high bits (value 32i + j's at bit i of byte j), 128 bytes of low
    nibbles laid out as Q4_K's) as k5 blocks, one a sub-block of 32: d * sc and dmin * m in
    float32 (exact products) and each 5-bit code in a byte."""
    from gguf.quants import Q4_K

    rows = raw.shape[0]
    b = raw.reshape(-1, 176)
    d, dmin = b[:, 0:2].view(np.float16).astype(np.float32), b[:, 2:4].view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(b[:, 4:16])
    scale, offset = d * sc.astype(np.float32), dmin * m.astype(np.float32)  # [superblocks, 8]
    low = (b[:, 48:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 0x01
    q = low.reshape(-1, 8, 32) | (high << 4)
    halves = [scale.reshape(-1, 8, 1).view(np.uint8), offset.reshape(-1, 8, 1).view(np.uint8)]
    return np.ascontiguousarray(np.concatenate([*halves, q], axis=2)).reshape(rows, -1)


def repack_q6_k(raw: np.ndarray) -> np.ndarray:
    """Q6_K rows (superblocks of 256 values, 210 bytes: 128 of low nibbles, 64 of high 2-bit
    pairs, 16 int8 scales, f16 d) as k6 blocks, one a 32 values: its two 16-value groups' d *
    scale in float32 (exact) and the 6-bit codes minus 32 as int8, laid out as gguf's
    dequantizer reads them."""
    rows = raw.shape[0]
    b = raw.reshape(-1, 210)
    scales = b[:, 192:208].view(np.int8).astype(np.float32)
    d = b[:, 208:210].view(np.float16).astype(np.float32)
    ql = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(-1, 8, 32)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & 0x03).reshape(-1, 8, 32)
    q = ((ql | (qh << 4)).astype(np.int8) - np.int8(32)).reshape(-1, 8, 32)
    pairs = (d * scales).reshape(-1, 8, 2)  # [superblocks, 8 blocks of 32, a scale for each 16]
    out = np.concatenate([pairs.view(np.uint8), q.view(np.uint8)], axis=2)
    return np.ascontiguousarray(out).reshape(rows, -1)


# GGML K-quant types kept, repacked 32 values a block -> (our format, bytes of a 256-value
# superblock in the file, the repacking)
GGUF_KQUANTS = {12: ("k4", 144, repack_q4_k), 13: ("k5", 176, repack_q5_k), 14: ("k6", 210, repack_q6_k)}


def as_x8(raw: np.ndarray, fmt: str) -> np.ndarray:
    """Rows of GGUF blocks kept here (q8_0, q4_0, q4_1, k4, k5, k6, k3, l4) as x8 blocks (48 bytes: a
    float32 scale and offset for each 16 values, then 32 int8 codes; value s * q - m), widened
    to the same float32 values: the products that carry an offset are exact, so s * q - m rounds
    once as each format's own dequantizer does, and s * q - 0 is s * q, -0.0 included."""
    rows = raw.shape[0]
    b = raw.reshape(rows, -1, BLOCK_FORMATS[fmt][1])
    n = b.shape[1]
    f16 = lambda at: b[:, :, at:at + 2].copy().view(np.float16).astype(np.float32)[..., 0]  # noqa: E731
    f32 = lambda at: b[:, :, at:at + 4].copy().view(np.float32)[..., 0]  # noqa: E731

    def nibbles(at: int) -> np.ndarray:  # byte i: value i low, value i + 16 high
        return np.concatenate([b[:, :, at:at + 16] & 0x0F, b[:, :, at:at + 16] >> 4], axis=2)
    zero = np.zeros((rows, n), np.float32)
    if fmt == "q8_0":
        s0 = s1 = f16(0)
        m0 = m1 = zero
        q = b[:, :, 2:34].view(np.int8)
    elif fmt == "q4_0":
        s0 = s1 = f16(0)
        m0 = m1 = zero
        q = nibbles(2).astype(np.int8) - np.int8(8)
    elif fmt == "q4_1":  # d * q + m: m as an offset to subtract
        s0 = s1 = f16(0)
        m0 = m1 = -f16(2)
        q = nibbles(4).astype(np.int8)
    elif fmt in ("k4", "k5"):
        s0 = s1 = f32(0)
        m0 = m1 = f32(4)
        q = (nibbles(8) if fmt == "k4" else b[:, :, 8:40]).astype(np.int8)
    elif fmt == "k6":
        s0, s1 = f32(0), f32(4)
        m0 = m1 = zero
        q = b[:, :, 8:40].view(np.int8)
    elif fmt == "k3":
        s0, s1 = f32(0), f32(4)
        m0 = m1 = zero
        q = nibbles(8).astype(np.int8) - np.int8(8)
    elif fmt == "l4":
        s0 = s1 = f32(0)
        m0 = m1 = zero
        q = IQ4NL[nibbles(4)]
    else:
        raise ValueError(f"no x8 form of {fmt} blocks")
    head = np.stack([s0, s1, m0, m1], axis=2).astype(np.float32).view(np.uint8)  # [rows, blocks, 16]
    return np.ascontiguousarray(np.concatenate([head, q.view(np.uint8)], axis=2)).reshape(rows, -1)


def matrix_owners(model) -> list[torch.nn.Module]:
    """The modules whose `weight` is a matrix a step multiplies by: every linear layer, and the
    embedding where the lm_head is tied to it (on one rank: a split embedding is all-reduced,
    and stays float32)."""
    towers = getattr(model, "towers", ())  # a vision encoder multiplies with torch, in float32
    owners = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and not n.startswith(towers)]
    if getattr(model, "lm_head", True) is None and type(model.embed_tokens) is torch.nn.Embedding:
        owners.append(model.embed_tokens)
    return owners


def narrow_exact_matrices(model) -> int:
    """The float32 matrices in bfloat16, if every value of every one of them is a bfloat16
    value; else each whose values are all float16 values in h16 blocks (a float16 checkpoint's):
    half the bytes a step reads (docs/performance.md). Returns the bytes saved (0: all stay
    float32)."""
    owners = [m for m in matrix_owners(model) if m.weight.dtype == torch.float32]
    if not owners:
        return 0
    if not any((m.weight.detach().view(torch.int32) & 0xFFFF).any() for m in owners):
        for m in owners:
            m.weight = torch.nn.Parameter(m.weight.detach().to(torch.bfloat16), requires_grad=False)
        return sum(m.weight.numel() * 2 for m in owners)
    saved = 0
    for m in owners:
        if (half := half_blocks(m.weight)) is not None:
            m.weight = half
            saved += half.numel()
    return saved


def round_to_bfloat16(model) -> int:
    """Every weight's value rounded to bfloat16, for C kernels that multiply in bfloat16: the
    float32 matrices stored in bfloat16, the other float32 parameters (norms, biases, a table
    not tied to the lm_head) rounded in place; GGUF blocks are rounded as they are widened.
    Returns the bytes saved."""
    saved = 0
    for m in matrix_owners(model):
        if m.weight.dtype == torch.float32:
            m.weight = torch.nn.Parameter(m.weight.detach().to(torch.bfloat16), requires_grad=False)
            saved += m.weight.numel() * 2
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype == torch.float32:
                p.copy_(p.to(torch.bfloat16))
    return saved


@dataclass
class GGUFBlocks:
    """The matrices of a model (still on the meta device) that keep a GGUF file's blocks: each
    linear layer, the embedding, and each block of experts' w13 and w2 (a matrix an expert),
    whose checkpoint tensors are all in block formats kept here and fill every row (q/k/v,
    gate/up and each expert's gate/up fused): in that format, or where the parts' formats differ
    (Q4_K_M's Q4_K q and k beside a Q6_K v) in x8, which holds them all. Those parameters become
    uint8 storage of that format's rows in place, which the file's blocks are loaded into
    (gguf_file.py); `finish` marks them for the C kernels once loaded."""
    names: dict[str, str] = field(default_factory=dict)  # checkpoint tensor -> the format it loads in
    # (module, parameter, format, columns)
    matrices: list[tuple[torch.nn.Module, str, str, int]] = field(default_factory=list)

    @classmethod
    def plan(cls, model, formats: dict[str, tuple[str, int, int]], names) -> GGUFBlocks:
        """`formats`: checkpoint name -> (block format, rows, columns) of each tensor that can
        keep its blocks; `names`: every checkpoint tensor's name. Under tensor parallelism a
        rank's part must be whole blocks (a row-parallel layer's columns split on a block's
        edge)."""
        from pageserve.runtime.models import parallel
        from pageserve.runtime.models.layers import Experts

        owners = matrix_owners(model)
        embedding = getattr(model, "embed_tokens", None)
        if type(embedding) is torch.nn.Embedding and embedding not in owners:  # untied: its rows widened as read
            owners.append(embedding)
        targets = {f"{n}.weight": (m, "weight") for n, m in model.named_modules() if any(m is o for o in owners)}
        targets.update({f"{n}.{p}": (m, p) for n, m in model.named_modules() if isinstance(m, Experts)
                        for p in ("w13", "w2")})
        parts: dict[str, list[str]] = {}
        for name in names:
            if model.checkpoint_held(name) and (target := model.checkpoint_target(name)) in targets:
                parts.setdefault(target, []).append(name)
        out = cls()
        for target, group in parts.items():
            module, param = targets[target]
            weight = getattr(module, param)
            kinds = {formats[name][0] if name in formats else None for name in group}
            *rows, k = weight.shape  # (experts,) rows, columns
            if None in kinds or weight.dtype != torch.float32 or k % 32 or len(kinds) > 1 and "h16" in kinds:
                continue  # float32 (x8 holds no half floats)
            try:  # this rank's part of each, in blocks of 32 columns (a meta tensor: only shapes)
                shards = [parallel.shard(model.rename(name.removeprefix("model.")),
                                         torch.empty(formats[name][1], formats[name][2] // 32, device="meta"),
                                         model.cfg).shape for name in group]
            except ValueError:  # columns that do not split into whole blocks
                continue
            if sum(s[0] for s in shards) != math.prod(rows) or any(s[1] != k // 32 for s in shards):
                continue
            fmt = kinds.pop() if len(kinds) == 1 else "x8"
            setattr(module, param, torch.nn.Parameter(torch.empty(*rows, k // 32 * BLOCK_FORMATS[fmt][1],
                                                                  dtype=torch.uint8, device=weight.device),
                                                      requires_grad=False))
            out.names.update(dict.fromkeys(group, fmt))
            out.matrices.append((module, param, fmt, k))
        return out

    def finish(self) -> int:
        """Marks the loaded blocks as the C linear's weights (experts: each one's matrix, in
        the stacked storage, as the experts' `parts`); returns the bytes saved against float32."""
        saved = 0
        for module, param, fmt, k in self.matrices:
            w = getattr(module, param).data
            if w.dim() == 3:
                module.parts[param] = [blocks(w[e], fmt, k) for e in range(len(w))]
            else:
                setattr(module, param, blocks(w, fmt, k))
            saved += w.shape[:-1].numel() * k * 4 - w.numel()
        return saved
