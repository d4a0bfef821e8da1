"""The matrix formats of the CPU kernels' C linear (cpu_kernels.h's W_*): float32, bfloat16, and
blocks of 32 values kept as uint8 rows. GGUF's blocks come as the file holds them; a quantized
checkpoint's codes (compressed-tensors, AWQ, GPTQ, FP8) are packed here, each block its own
float32 scale ahead of the codes, little-endian:

    i8  36 bytes: scale s, 32 int8 q                           value (float)q * s
    f8  36 bytes: scale s, 32 float8 e4m3fn codes q            value (float)q * s (a NaN code: NaN)
    i4  21 bytes: scale s, zero point z, 16 bytes of nibbles   value (float)(q - z) * s
    f4  24 bytes: scales s0, s1, 16 bytes of FP4 e2m1 nibbles  value e2m1(q) * s0 (values 0-15),
                                                               e2m1(q) * s1 (values 16-31)
    n4  20 bytes: scale s, 16 bytes of NormalFloat4 nibbles    value nf4(q) * s (bitsandbytes)
    k4  24 bytes: scale d, offset m, 16 bytes of nibbles       value d * q - m (a Q4_K sub-block)
    k6  40 bytes: scales s0, s1, 32 int8 q                     value q * s0 (values 0-15), q * s1
                                                               (values 16-31) (Q6_K's)
    k5  40 bytes: scale d, offset m, 32 uint8 q                value d * q - m (a Q5_K sub-block)
    x8  48 bytes: scales s0, s1, offsets m0, m1, 32 int8 q     value s0 * q - m0 (values 0-15),
                                                               s1 * q - m1 (16-31): any of the
                                                               GGUF formats' values
    k3  24 bytes: scales s0, s1, 16 bytes of nibbles           value (q - 8) * s0 (values 0-15),
                                                               (q - 8) * s1 (16-31) (Q3_K's, TQ's)
    l4  20 bytes: scale s, 16 bytes of nibbles                 value iq4nl(q) * s (IQ4_NL's and
                                                               IQ4_XS's 16 int8 values)
    h16 64 bytes: 32 half floats                               value h (a float16 checkpoint's,
                                                               a GGUF F16 matrix's)

each product rounded once (k4's and k5's d * q is exact: d * q - m rounds once). An i4, f4, n4, k4,
k3 or l4 block's byte i holds value i in its low nibble and value i + 16 in its high one, as
GGUF's Q4 blocks do."""

from __future__ import annotations

import torch

# name -> (format code, bytes a block of 32 values)
BLOCK_FORMATS = {"q8_0": (2, 34), "q4_0": (3, 18), "q4_1": (4, 20), "i8": (5, 36), "f8": (6, 36), "i4": (7, 21),
                 "f4": (8, 24), "n4": (9, 20), "k4": (10, 24), "k6": (11, 40), "k5": (12, 40),
                 "x8": (13, 48), "k3": (14, 24), "l4": (15, 20), "h16": (16, 64)}
F8_SCALE_LIMIT = 2.0 ** 120  # the C kernels multiply q / 256 by 256 s: 256 s must stay finite


def half_blocks(weight: torch.Tensor) -> torch.Tensor | None:
    """A float32 matrix as h16 blocks, where every value is a float16 value (bit for bit: -0.0,
    subnormals and infinities too) and its columns are whole blocks; else None."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % 32:
        return None
    w = weight.detach()
    for part in (w[:1], w):  # (a float32 checkpoint's matrix fails on its first row, before a whole copy)
        half = part.to(torch.float16)
        if not torch.equal(half.float().view(torch.int32), part.view(torch.int32)):
            return None
    return blocks(half.view(torch.uint8), "h16", w.shape[1])


def blocks(raw: torch.Tensor, block_format: str, in_features: int) -> torch.Tensor:
    """`raw` ([rows, bytes a row] uint8, as a GGUF file holds a quantized matrix) marked as a
    matrix of `in_features` columns in `block_format`: a weight the C linear takes."""
    if block_format not in BLOCK_FORMATS or in_features % 32 or raw.dtype != torch.uint8 or raw.dim() != 2 \
            or raw.shape[1] != in_features // 32 * BLOCK_FORMATS[block_format][1]:
        raise ValueError(f"{tuple(raw.shape)} {raw.dtype} is not {in_features} columns of {block_format} blocks")
    p = torch.nn.Parameter(raw, requires_grad=False)
    p.block_format, p.in_features = block_format, in_features
    return p


def in_features(weight: torch.Tensor) -> int:
    """Columns of a matrix in any format (a block format's rows are bytes)."""
    return getattr(weight, "in_features", None) or weight.shape[1]


def weight_format(weight: torch.Tensor) -> tuple[int, int]:
    """(format code, columns) of a CPU matrix: float32, bfloat16, or uint8 blocks (`blocks`)."""
    if not weight.is_cpu or weight.dim() != 2:
        raise TypeError(f"cpu kernels take 2-D CPU matrices, got {tuple(weight.shape)} on {weight.device}")
    if weight.dtype == torch.float32:
        return 0, weight.shape[1]
    if weight.dtype == torch.bfloat16:
        return 1, weight.shape[1]
    block_format = getattr(weight, "block_format", None)
    if weight.dtype == torch.uint8 and block_format in BLOCK_FORMATS:
        return BLOCK_FORMATS[block_format][0], weight.in_features
    raise TypeError(f"cpu kernels take float32, bfloat16 or block-format matrices, got {weight.dtype}")


def int8_blocks(codes: torch.Tensor, scales: torch.Tensor, group_size: int = 0) -> torch.Tensor:
    """int8 codes [N, K] with one scale a row ([N]), or one a group of `group_size` columns
    ([N, K / group_size], group_size a multiple of 32), as `i8` blocks."""
    n, k = _codes_shape(codes, torch.int8, "int8_blocks")
    s = _scale_bytes(_block_scales(scales, n, k, group_size, "int8_blocks"), n, k // 32)
    return blocks(torch.cat([s, codes.view(torch.uint8).reshape(n, k // 32, 32)], 2).view(n, -1), "i8", k)


def _block_scales(scales: torch.Tensor, n: int, k: int, group_size: int, name: str) -> torch.Tensor:
    """One float32 scale a block of 32: a row's ([N]), or its group's ([N, K / group_size])."""
    if not group_size:
        return _row_scales(scales, n, name)
    if group_size % 32 or k % group_size or scales.shape != (n, k // group_size) or not scales.dtype.is_floating_point:
        raise ValueError(f"{name}: scales {tuple(scales.shape)} do not make groups of {group_size} "
                         f"(a multiple of 32) of a {n}x{k} matrix")
    return scales.to(torch.float32).repeat_interleave(group_size // 32, 1)


def fp8_blocks(codes: torch.Tensor, scales: torch.Tensor, group_size: int = 0) -> torch.Tensor:
    """float8_e4m3fn codes [N, K] with one scale a row ([N]), or one a group of `group_size`
    columns ([N, K / group_size], group_size a multiple of 32), each below 2**120 in size, as
    `f8` blocks."""
    n, k = _codes_shape(codes, torch.float8_e4m3fn, "fp8_blocks")
    scales = _block_scales(scales, n, k, group_size, "fp8_blocks")
    if not bool((scales.abs() < F8_SCALE_LIMIT).all()):
        raise ValueError(f"fp8_blocks: scales must be finite and below 2**120 in size, got max "
                         f"{scales.abs().max().item()}")
    s = _scale_bytes(scales, n, k // 32)
    return blocks(torch.cat([s, codes.view(torch.uint8).reshape(n, k // 32, 32)], 2).view(n, -1), "f8", k)


def int4_blocks(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """4-bit codes [N, K] (any integer dtype, values 0-15) in groups of `group_size` columns, each
    with its scale and zero point (scales, zeros: [N, K / group_size], zeros 0-15), as `i4`
    blocks: each block of 32 takes its group's scale and zero point (group_size a multiple of 32
    that divides K; K itself for one group a row)."""
    if codes.dim() != 2 or codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise ValueError(f"int4_blocks: codes must be an integer [N, K] tensor, got {tuple(codes.shape)} "
                         f"{codes.dtype}")
    n, k = codes.shape
    if k % 32:
        raise ValueError(f"int4_blocks: K = {k} columns is not a multiple of 32 (a block's values)")
    if group_size <= 0 or group_size % 32 or k % group_size:
        raise ValueError(f"int4_blocks: a group of {group_size} columns must be a multiple of 32 that divides "
                         f"K = {k}")
    groups = k // group_size
    if scales.shape != (n, groups) or not scales.dtype.is_floating_point:
        raise ValueError(f"int4_blocks: scales must be floating [{n}, {groups}], got {tuple(scales.shape)} "
                         f"{scales.dtype}")
    if zeros.shape != (n, groups) or zeros.dtype.is_floating_point or zeros.dtype == torch.bool:
        raise ValueError(f"int4_blocks: zeros must be integer [{n}, {groups}], got {tuple(zeros.shape)} "
                         f"{zeros.dtype}")
    for name, t in (("codes", codes), ("zeros", zeros)):
        if t.numel() and (int(t.min()) < 0 or int(t.max()) > 15):
            raise ValueError(f"int4_blocks: {name} must lie in 0..15, got {int(t.min())}..{int(t.max())}")
    per_group = group_size // 32
    nb = k // 32
    s = _scale_bytes(scales.to(torch.float32).repeat_interleave(per_group, 1), n, nb)
    z = zeros.to(torch.uint8).repeat_interleave(per_group, 1).reshape(n, nb, 1)
    q = codes.to(torch.uint8).reshape(n, nb, 32)
    nibbles = q[:, :, :16] | (q[:, :, 16:] << 4)
    return blocks(torch.cat([s, z, nibbles], 2).view(n, -1), "i4", k)


def fp4_blocks(codes: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """FP4 e2m1 codes [N, K] (uint8, 0-15) in groups of `group_size` columns (16, or a multiple
    of 32 dividing K), each group with its float32 scale ([N, K / group_size]), as `f4` blocks:
    each half block of 16 values takes its group's scale."""
    n, k = _codes_shape(codes, torch.uint8, "fp4_blocks")
    if group_size <= 0 or group_size % 16 or k % group_size or (group_size > 16 and group_size % 32):
        raise ValueError(f"fp4_blocks: a group of {group_size} columns must be 16 or a multiple of 32 dividing K = {k}")
    if scales.shape != (n, k // group_size) or not scales.dtype.is_floating_point:
        raise ValueError(f"fp4_blocks: scales must be floating [{n}, {k // group_size}], got {tuple(scales.shape)} "
                         f"{scales.dtype}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"fp4_blocks: codes must lie in 0..15, got up to {int(codes.max())}")
    nb = k // 32
    halves = scales.to(torch.float32).repeat_interleave(group_size // 16, 1)  # [n, 2 nb]: one a half block
    s = halves.contiguous().view(torch.uint8).reshape(n, nb, 8)
    q = codes.reshape(n, nb, 32)
    return blocks(torch.cat([s, q[:, :, :16] | (q[:, :, 16:] << 4)], 2).view(n, -1), "f4", k)


def nf4_blocks(codes: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """NormalFloat4 codes [N, K] (uint8, 0-15) in groups of `group_size` columns (a multiple of
    32 dividing K; bitsandbytes' 64), each group with its float32 scale ([N, K / group_size]),
    as `n4` blocks: each block of 32 takes its group's scale."""
    n, k = _codes_shape(codes, torch.uint8, "nf4_blocks")
    if codes.numel() and int(codes.max()) > 15 or group_size <= 0:
        raise ValueError(f"nf4_blocks: codes must lie in 0..15 (up to {int(codes.max()) if codes.numel() else 0}) "
                         f"in groups of a positive size ({group_size})")
    s = _scale_bytes(_block_scales(scales, n, k, group_size, "nf4_blocks"), n, k // 32)
    q = codes.reshape(n, k // 32, 32)
    return blocks(torch.cat([s, q[:, :, :16] | (q[:, :, 16:] << 4)], 2).view(n, -1), "n4", k)


def _codes_shape(codes: torch.Tensor, dtype: torch.dtype, name: str) -> tuple[int, int]:
    if codes.dim() != 2 or codes.dtype != dtype:
        raise ValueError(f"{name}: codes must be {dtype} [N, K], got {tuple(codes.shape)} {codes.dtype}")
    if codes.shape[1] % 32:
        raise ValueError(f"{name}: K = {codes.shape[1]} columns is not a multiple of 32 (a block's values)")
    return codes.shape[0], codes.shape[1]


def _row_scales(scales: torch.Tensor, n: int, name: str) -> torch.Tensor:
    """One float32 scale a row (a bfloat16 or float16 checkpoint's scales convert exactly)."""
    if scales.shape not in ((n,), (n, 1)) or not scales.dtype.is_floating_point:
        raise ValueError(f"{name}: scales must be floating [{n}], got {tuple(scales.shape)} {scales.dtype}")
    return scales.to(torch.float32).reshape(n, 1)


def _scale_bytes(scales: torch.Tensor, n: int, nb: int) -> torch.Tensor:
    """float32 scales [n, nb] (one a block) as the blocks' first four bytes [n, nb, 4] (the CPU
    kernels read their machine's order, little-endian on every one they build for)."""
    return scales.expand(n, nb).contiguous().view(torch.uint8).reshape(n, nb, 4)


def _as_half(values: torch.Tensor) -> torch.Tensor | None:
    """float32 values as float16 where every one of them is a float16 value (else None)."""
    half = values.to(torch.float16)
    return half if torch.equal(half.to(torch.float32).view(torch.int32), values.view(torch.int32)) else None


def smallest_blocks(weight: torch.Tensor) -> torch.Tensor:
    """An i4 or i8 matrix in GGUF's smaller blocks where they hold the same values exactly: i4 ->
    Q4_0 (18 bytes: every zero point 8, every scale a float16 value), else Q4_1 (20 bytes:
    d * q + m with m = -z * s a float16 value too, which fma rounds once to (q - z) * s); i8 ->
    Q8_0 (34 bytes). A bfloat16 checkpoint's scales of usual size are all float16 values. Other
    matrices come back as they are."""
    fmt, k = getattr(weight, "block_format", None), in_features(weight)
    if fmt not in ("i4", "i8"):
        return weight
    n, nb = weight.shape[0], k // 32
    raw = weight.detach().view(n, nb, BLOCK_FORMATS[fmt][1])
    d = _as_half(raw[:, :, :4].contiguous().view(torch.float32))  # [n, nb, 1]
    if d is None:
        return weight
    if fmt == "i8":
        return blocks(torch.cat([d.view(torch.uint8), raw[:, :, 4:]], 2).view(n, -1), "q8_0", k)
    zeros, nibbles = raw[:, :, 4:5], raw[:, :, 5:]
    if bool((zeros == 8).all()):
        return blocks(torch.cat([d.view(torch.uint8), nibbles], 2).view(n, -1), "q4_0", k)
    m = _as_half(-zeros.to(torch.float32) * d.to(torch.float32))
    if m is None:
        return weight
    return blocks(torch.cat([d.view(torch.uint8), m.view(torch.uint8), nibbles], 2).view(n, -1), "q4_1", k)
