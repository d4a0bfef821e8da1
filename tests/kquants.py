"""Round-to-nearest GGUF K-quant writers for tests (gguf's own quantize has no K-quants): float
rows of a multiple of 256 values as Q4_K, Q5_K and Q6_K superblocks, laid out as gguf's dequantizer
reads them (checked there: it gives back the rows within the formats' error)."""

from __future__ import annotations

import zlib

import numpy as np


def _half(values: np.ndarray) -> np.ndarray:
    """Positive scales as half floats (at least the smallest subnormal), back in float32."""
    return np.maximum(values.astype(np.float16), np.float16(6e-8)).astype(np.float32)


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).reshape(-1, 1).view(np.uint8)


def quantize_q4_k(rows: np.ndarray, top: int = 15) -> np.ndarray:
    """Q4_K: each 32 values q * d * sc - dmin * m with 6-bit sc and m, f16 d and dmin a
    superblock (top: the largest code, 31 for Q5_K's)."""
    n, k = rows.shape
    w = rows.astype(np.float32).reshape(-1, 8, 32)
    low = np.minimum(w.min(axis=2), 0)
    step = (w.max(axis=2) - low) / top
    d, dmin = step.max(axis=1) / 63, -low.min(axis=1) / 63
    d, dmin = _half(d), _half(dmin)
    sc = np.clip(np.round(step / d[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.round(-low / dmin[:, None]), 0, 63).astype(np.uint8)
    shifted = (w + (dmin[:, None] * m)[:, :, None]) / (d[:, None] * sc)[:, :, None]
    q = np.clip(np.round(shifted), 0, top).astype(np.uint8)
    scales = np.empty((len(w), 12), np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    low4 = q & 0x0F
    qs = (low4[:, 0::2] | (low4[:, 1::2] << 4)).reshape(-1, 128)  # sub-blocks 2j and 2j + 1 share bytes
    if top == 15:
        return np.concatenate([_f16(d), _f16(dmin), scales, qs], axis=1).reshape(n, k // 256 * 144)
    bits = (q >> 4).astype(np.uint8)  # Q5_K: value 32i + j's fifth bit at bit i of byte j
    qh = sum(bits[:, i, :] << i for i in range(8)).astype(np.uint8)
    return np.concatenate([_f16(d), _f16(dmin), scales, qh, qs], axis=1).reshape(n, k // 256 * 176)


def quantize_q5_k(rows: np.ndarray) -> np.ndarray:
    """Q5_K: Q4_K's scheme with 5-bit codes, the fifth bits in 32 bytes of their own."""
    return quantize_q4_k(rows, top=31)


def quantize_q6_k(rows: np.ndarray) -> np.ndarray:
    """Q6_K: each 16 values q * d * sc, q in -32..31, int8 sc, f16 d a superblock."""
    n, k = rows.shape
    w = rows.astype(np.float32).reshape(-1, 16, 16)
    amax = np.abs(w).max(axis=2)
    d = _half(amax.max(axis=1) / (127 * 31))
    sc = np.clip(np.round(amax / (d[:, None] * 31)), 1, 127).astype(np.int8)
    q = np.clip(np.round(w / (d[:, None] * sc)[:, :, None]), -32, 31).astype(np.int16).reshape(-1, 256) + 32
    v = q.reshape(-1, 2, 128)  # halves of 128: low nibbles of values i and 64 + i share byte i
    ql = (v[:, :, :64] & 0x0F) | ((v[:, :, 64:] & 0x0F) << 4)
    hi = (v >> 4).reshape(-1, 2, 4, 32)  # 2-bit high parts: value 32k + j at bits 2k of byte j
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    out = [ql.reshape(-1, 128).astype(np.uint8), qh.reshape(-1, 64).astype(np.uint8), sc.view(np.uint8), _f16(d)]
    return np.concatenate(out, axis=1).reshape(n, k // 256 * 210)


# GGML type -> the bytes of each block that hold a half-float scale (d; Q5_1's m, Q2_K's dmin)
SCALE_HALVES = {6: (0,), 7: (0, 2), 10: (80, 82), 11: (108,), 16: (0,), 17: (0,), 18: (0,), 19: (0,), 20: (0,),
                21: (0,), 22: (0,), 23: (0,), 29: (), 34: (52,), 35: (64,)}


def random_blocks(qtype: int, rows: int, columns: int, rng: np.random.Generator,
                  scale: float | None = None) -> np.ndarray:
    """Blocks of random bytes (any codes, any sub-block scales) of a type of SCALE_HALVES, rows
    of `columns` values, with finite half-float scales: `scale`, or random ones with zero,
    negative zero and subnormals among them. IQ1_M's d lies in the top nibbles of its four
    scale words."""
    import gguf

    values, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    raw = rng.integers(0, 256, (rows * columns // values, size), dtype=np.uint8)
    specials = np.array([0.0, -0.0, 6e-8, -3e-5], np.float16)
    halves = np.full(len(raw), scale or 0, np.float16)
    for k, at in enumerate(SCALE_HALVES[qtype] or (None,)):
        if scale is None:  # each field its own; the specials alike in blocks 0-3, in other pairs in 4-7
            halves = rng.standard_normal(len(raw)).astype(np.float16)
            halves[:8] = np.concatenate([specials, np.roll(specials, k)])[:len(halves[:8])]
        if at is not None:
            raw[:, at:at + 2] = halves.view(np.uint8).reshape(-1, 2)
    if qtype == 29:
        words = raw[:, 48:56].copy().view(np.uint16) & np.uint16(0x0FFF)
        for i, shift in enumerate((0, 4, 8, 12)):  # word i: d's bits 4i to 4i + 3
            words[:, i] |= ((halves.view(np.uint16) >> shift) & 0xF) << 12
        raw[:, 48:56] = words.view(np.uint8)
    return raw.reshape(rows, -1)


def quantize_random(rows: np.ndarray, qtype: int) -> np.ndarray:
    """Random blocks of the type whose values spread as `rows`' do (not `rows`' values: a
    stand-in writer for the types gguf cannot quantize, for a random-weight model)."""
    import gguf

    seed = zlib.crc32(rows.tobytes())  # each tensor its own codes
    unit = random_blocks(qtype, *rows.shape, np.random.default_rng(seed), scale=1.0)
    spread = gguf.quants.dequantize(unit, gguf.GGMLQuantizationType(qtype)).std()
    return random_blocks(qtype, *rows.shape, np.random.default_rng(seed), scale=float(rows.std() / spread))
