"""The GGUF types the C linear has no block format of its own for (Q5_0, Q5_1, Q2_K, Q3_K, the
IQ and TQ types), repacked into formats it has (cpu_blocks.py), which widen to the very float32
values gguf's dequantizer gives:

- every one of these types gives each value as a scale (a half float times a small integer,
  exact in float32) times a small integer code, or for Q5_1 and Q2_K that product, exact, plus
  an offset: one rounding either way;
- so k3 (a float32 scale for each 16 values, codes -8..7 in nibbles: 0.75 bytes a value) holds
  Q3_K and the TQ types, l4 (a scale for each 32, nibbles indexing IQ4_NL's 16 values: 0.625)
  IQ4_NL and IQ4_XS, k6 (a scale for each 16, int8 codes: 1.25) the other types without an
  offset, k5 (a scale and an offset for each 32, a byte a code: 1.25) Q5_1, and x8 (a scale and
  an offset for each 16: 1.5) Q2_K;
- the scale of each 16 values is read from the block here; the codes are gguf's values divided
  by it (exact: the value is the exact product), or for IQ4 and the types with offsets read
  from their bits; IQ1's codes are 8 (grid + delta), the scale divided by 8;
- each tensor is checked value for value (bits) against gguf's dequantizer as it is repacked,
  so a block this reading gets wrong is an error, never a wrong weight.

These files take 0.2-0.75 bytes a value; float32 takes 4."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from pageserve.triton_kernels.cpu_blocks import BLOCK_FORMATS

QK = 256  # values in a K-quant or IQ superblock


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """[blocks, 1] float32 of the half float at byte `at` of each block."""
    return b[:, at:at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(b: np.ndarray) -> np.ndarray:
    """Bytes as their low then high nibbles, byte by byte: [blocks, 2 * bytes]."""
    return np.stack([b & 0x0F, b >> 4], axis=-1).reshape(len(b), -1)


def _per16(s: np.ndarray, values: int) -> np.ndarray:
    """A scale for each of `s`'s groups as one for each 16 values."""
    return np.repeat(s, values // 16 // s.shape[1], axis=1)


def _q5_0(b):
    return _per16(_f16(b, 0), 32), None, None


def _q5_1(b):
    d, m = _f16(b, 0), _f16(b, 2)
    high = (b[:, 4:8].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
    low = np.concatenate([b[:, 8:24] & 0x0F, b[:, 8:24] >> 4], axis=1)
    return _per16(d, 32), _per16(-m, 32), (low | (high.astype(np.uint8) << 4)).astype(np.int8)


def _q2_k(b):
    sc, qs, d, dmin = b[:, :16], b[:, 16:80], _f16(b, 80), _f16(b, 82)
    q = (qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    return d * (sc & 0x0F).astype(np.float32), dmin * (sc >> 4).astype(np.float32), q.reshape(-1, QK).astype(np.int8)


def _q3_k(b):
    low = _nibbles(b[:, 96:104]).reshape(-1, 8, 2).transpose(0, 2, 1).reshape(-1, 16)  # scales 0-7 low, 8-15 high
    high = (b[:, 104:108, None] >> np.array([0, 2, 4, 6], np.uint8)).transpose(0, 2, 1).reshape(-1, 16) & 3
    sc = ((low | (high << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)
    return _f16(b, 108) * sc, None, None


IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
_IQ4_AT = np.zeros(256, np.uint8)  # an int8 value's byte -> its place in IQ4NL
_IQ4_AT[IQ4NL.view(np.uint8)] = np.arange(16)


def _iq4_codes(qs: np.ndarray) -> np.ndarray:
    """IQ4 codes (16 bytes a 32 values: value j in byte j's low nibble, j + 16 in its high one)
    as their int8 values [blocks, values]."""
    q = qs.reshape(len(qs), -1, 1, 16) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return IQ4NL[(q & 0x0F).reshape(len(qs), -1)]


def _iq4_nl(b):
    return _per16(_f16(b, 0), 32), None, _iq4_codes(b[:, 2:])


def _iq4_xs(b):
    high = (b[:, 2:4].copy().view(np.uint16) >> np.arange(0, 16, 2, dtype=np.uint16)).astype(np.uint8) & 3
    sc = ((_nibbles(b[:, 4:8]) | (high << 4)).astype(np.int8) - np.int8(32)).astype(np.float32)
    return _per16(_f16(b, 0) * sc, QK), None, _iq4_codes(b[:, 8:])


def _iq2_xxs(b):
    top = (b[:, 2:66].copy().view(np.uint32).reshape(-1, 8, 2)[..., 1] >> 28).astype(np.float32)
    return _per16(_f16(b, 0) * (np.float32(0.5) + top) * np.float32(0.25), QK), None, None


def _iq2_xs_s(scales_at: int):
    def parts(b):
        return _f16(b, 0) * (np.float32(0.5) + _nibbles(b[:, scales_at:scales_at + 8])) * np.float32(0.25), None, None
    return parts


def _iq3_xxs(b):
    top = (b[:, 66:98].copy().view(np.uint32) >> 28).astype(np.float32)
    return _per16(_f16(b, 0) * (np.float32(0.5) + top) * np.float32(0.5), QK), None, None


def _iq3_s(b):
    return _per16(_f16(b, 0) * (1 + 2 * _nibbles(b[:, 106:110])), QK), None, None


def _iq1_s(b):  # value dl * (grid + delta), delta +-1/8: codes 8 (grid + delta), scale dl / 8
    qh = b[:, 34:50].copy().view(np.uint16)
    return _per16(_f16(b, 0) * (2 * ((qh >> 12) & 7) + 1) * np.float32(0.125), QK), None, None


def _iq1_m(b):  # the half-float d in the top nibbles of its four scale words
    words = b[:, 48:56].copy().view(np.uint16)
    d = ((words & np.uint16(0xF000)) >> np.array([12, 8, 4, 0], np.uint16)).sum(axis=1, dtype=np.uint16)
    d = d.view(np.float16).astype(np.float32)[:, None]
    sc = ((words[:, :, None] >> np.array([0, 3, 6, 9], np.uint16)) & 7).reshape(-1, 16)
    return d * (2 * sc + 1) * np.float32(0.125), None, None


def _tq(d_at: int):
    def parts(b):
        return _per16(_f16(b, d_at), QK), None, None
    return parts


# GGML type -> (values a block, bytes a block, the format it is repacked in, the block's parts: (scale a
# 16 values [blocks, values / 16], offset a 16 values or None (zero), int8 codes [blocks, values] or None
# (gguf's values / scale)))
REPACKED = {6: (32, 22, "k6", _q5_0), 7: (32, 24, "k5", _q5_1), 10: (QK, 84, "x8", _q2_k),
            11: (QK, 110, "k3", _q3_k), 16: (QK, 66, "k6", _iq2_xxs), 17: (QK, 74, "k6", _iq2_xs_s(66)),
            18: (QK, 98, "k6", _iq3_xxs), 19: (QK, 50, "k6", _iq1_s), 20: (32, 18, "l4", _iq4_nl),
            21: (QK, 110, "k6", _iq3_s), 22: (QK, 82, "k6", _iq2_xs_s(74)), 23: (QK, 136, "l4", _iq4_xs),
            29: (QK, 56, "k6", _iq1_m), 34: (QK, 54, "k3", _tq(52)), 35: (QK, 66, "k3", _tq(64))}
CHUNK = 1 << 20  # values a thread converts at a time (their float32 values and codes: about 18 MB)


def repack(raw: np.ndarray, qtype: int) -> np.ndarray:
    """Rows of a GGUF tensor of a type of REPACKED ([rows, bytes a row] uint8) as rows of blocks
    of its format there; ValueError where a value would not widen to gguf's (a damaged block: a
    scale that is not finite)."""
    import gguf

    values, size, fmt, parts = REPACKED[qtype]
    rows = raw.shape[0]
    columns = raw.shape[1] // size * values
    out = np.empty((rows, columns // 32, BLOCK_FORMATS[fmt][1]), np.uint8)
    if out.size == 0:
        return out.reshape(rows, -1)
    step = max(1, CHUNK // columns)

    def convert(r: int) -> None:
        b = np.ascontiguousarray(raw[r:r + step]).reshape(-1, size)
        out[r:r + step] = _blocks(b, qtype, fmt, parts).reshape(-1, columns // 32, BLOCK_FORMATS[fmt][1])
    gguf.quants.dequantize(np.ascontiguousarray(raw[:1, :size]), gguf.GGMLQuantizationType(qtype))  # builds an IQ grid
    starts = range(0, rows, step)
    # numpy lets go of the GIL; as many threads as this process computes with (a rank's share of the cores)
    with ThreadPoolExecutor(max(1, min(torch.get_num_threads(), len(starts)))) as pool:
        list(pool.map(convert, starts))
    return out.reshape(rows, -1)


def _blocks(b: np.ndarray, qtype: int, fmt: str, parts) -> np.ndarray:
    """Blocks of one GGUF type as blocks of `fmt` [blocks * values / 32, bytes]."""
    import gguf
    from gguf.quants import dequantize

    name = gguf.GGMLQuantizationType(qtype).name
    # one row: gguf dequantizes a row group of 16 at a time (here 16 blocks: slow)
    want = dequantize(b.reshape(1, -1), gguf.GGMLQuantizationType(qtype)).reshape(len(b), -1, 16)
    s, m, q = parts(b)
    if not (np.isfinite(s).all() and (m is None or np.isfinite(m).all())):
        raise ValueError(f"{name} blocks with a scale or offset that is not finite")
    s = s.astype(np.float32)[:, :, None]
    with np.errstate(all="ignore"):
        if q is None:  # want = s * q, exact; a zero scale: q is any code of the value's sign
            q = np.rint(want / s) + np.float32(0)  # (+0.0 for -0.0: the int8 code 0 widens to +0.0 * s)
            if not s.all():
                q = np.where(s != 0, q, np.where(np.signbit(want) == np.signbit(s), np.float32(1), np.float32(-1)))
            if not (np.abs(q) <= 127).all():  # (NaN too)
                raise ValueError(f"{name} blocks whose codes {fmt} cannot hold")
            got = s * q
        else:
            q = q.reshape(want.shape)
            got = s * q.astype(np.float32)
            if m is not None:
                got = got - m.astype(np.float32)[:, :, None]
    if not np.array_equal(got.view(np.uint32), want.view(np.uint32)):
        raise ValueError(f"{name} blocks that {fmt} would not widen to gguf's values")
    groups = len(b) * want.shape[1] // 2  # blocks of 32 values
    s = s.reshape(groups, 2)
    m = np.zeros_like(s) if m is None else m.astype(np.float32).reshape(groups, 2)
    q = q.astype(np.int8).reshape(groups, 32)
    if fmt == "k6":  # s0, s1, int8 q
        head, codes = s, q.view(np.uint8)
    elif fmt == "k3":  # s0, s1, nibbles of q + 8
        if not ((q >= -8) & (q <= 7)).all():
            raise ValueError(f"{name} blocks whose codes {fmt} cannot hold")
        head, codes = s, _nibble_bytes((q + 8).view(np.uint8))
    elif fmt == "l4":  # s, nibbles of q's place in IQ4NL: one scale a 32 values
        assert (s[:, 0] == s[:, 1]).all()
        at = _IQ4_AT[q.view(np.uint8)]
        assert (IQ4NL[at] == q).all()
        head, codes = s[:, :1], _nibble_bytes(at)
    elif fmt == "k5":  # d, m, uint8 q: one scale and offset a 32 values
        assert (s[:, 0] == s[:, 1]).all() and (m[:, 0] == m[:, 1]).all() and (q >= 0).all()
        head, codes = np.stack([s[:, 0], m[:, 0]], axis=1), q.view(np.uint8)
    else:  # x8: s0, s1, m0, m1, int8 q
        head, codes = np.concatenate([s, m], axis=1), q.view(np.uint8)
    return np.concatenate([np.ascontiguousarray(head).view(np.uint8), codes], axis=1)


def _nibble_bytes(q: np.ndarray) -> np.ndarray:
    """[blocks, 32] codes below 16 as [blocks, 16] bytes: value j low, value j + 16 high."""
    return q[:, :16] | (q[:, 16:] << 4)
