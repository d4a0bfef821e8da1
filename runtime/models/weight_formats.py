"""How a float32 model's matrices are kept on the CPU path with the C kernels, smaller than
float32 where that loses nothing: the C linear widens each weight to the same float32 value
as it reads it, so every sum is as before, to the bit, and a decode step, which reads every
matrix once, reads fewer bytes.

- `narrow_exact_matrices`: bfloat16, where every value's low 16 bits are zero (a checkpoint
  stored in bfloat16, as most are).
- `keep_gguf_blocks`: a GGUF file's own quantized blocks (Q8_0, Q4_0, Q4_1: 1.06, 0.56 and
  0.63 bytes a value; Q4_K, Q5_K and Q6_K, repacked 32 values a block: 0.75, 1.25 and 1.25),
  instead of the float32 copy the converter dequantized. Which file rows are which of our rows
  is found by value, not by name: every row of a quantized tensor is widened by the C kernels
  and looked up among the rows of our matrices (q/k/v and gate/up are fused there; the
  converter also reorders the rows of q and k). A matrix takes blocks
  only when every one of its rows was found in one format and widening them gives back the
  float32 matrix exactly; any other stays as it was."""

from __future__ import annotations

import logging
import struct
from pathlib import Path

import numpy as np
import torch

from pageserve.triton_kernels.cpu_kernels import BLOCK_FORMATS, blocks

logger = logging.getLogger(__name__)

# GGML tensor types kept as blocks -> our name of the format (cpu_kernels.BLOCK_FORMATS)
GGUF_BLOCKS = {8: "q8_0", 2: "q4_0", 3: "q4_1"}


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
    value: half the bytes a step reads (docs/performance.md). Returns the
    bytes saved (0: some value is not, and all stay float32)."""
    owners = [m for m in matrix_owners(model) if m.weight.dtype == torch.float32]
    if not owners or any((m.weight.detach().view(torch.int32) & 0xFFFF).any() for m in owners):
        return 0
    for m in owners:
        m.weight = torch.nn.Parameter(m.weight.detach().to(torch.bfloat16), requires_grad=False)
    return sum(m.weight.numel() * 2 for m in owners)


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


# GGUF metadata value types: fixed sizes; 8 is a string, 9 an array
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_block_tensors(path: Path):
    """(name, format, columns, [rows, bytes a row] uint8, mapped read-only, or repacked for the
    K-quants) of each 2-D tensor of a GGUF file in a block format kept here. gguf's own reader
    builds every metadata field (a 49k-token vocabulary: 4 s); this skips them."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(data)
    u32 = lambda at: struct.unpack_from("<I", buf, at)[0]  # noqa: E731
    u64 = lambda at: struct.unpack_from("<Q", buf, at)[0]  # noqa: E731
    if bytes(buf[:4]) != b"GGUF" or u32(4) < 2:
        raise ValueError(f"{path}: not a GGUF file of version 2 or later")
    n_tensors, n_kv, at, alignment = u64(8), u64(16), 24, 32

    def skip(kind: int, at: int) -> int:
        if kind == 8:
            return at + 8 + u64(at)
        if kind == 9:
            item, count, at = u32(at), u64(at + 4), at + 12
            if item in _SIZES:
                return at + count * _SIZES[item]
            for _ in range(count):
                at = skip(item, at)
            return at
        return at + _SIZES[kind]

    for _ in range(n_kv):
        key = bytes(buf[at + 8:at + 8 + u64(at)]).decode()
        at += 8 + u64(at)
        kind, at = u32(at), at + 4
        if key == "general.alignment":
            alignment = u32(at)
        at = skip(kind, at)
    infos = []
    for _ in range(n_tensors):
        name = bytes(buf[at + 8:at + 8 + u64(at)]).decode()
        at += 8 + u64(at)
        n_dims, at = u32(at), at + 4
        dims = [u64(at + 8 * i) for i in range(n_dims)]
        at += 8 * n_dims
        infos.append((name, dims, u32(at), u64(at + 4)))
        at += 12
    start = -(-at // alignment) * alignment
    for name, dims, kind, offset in infos:
        if kind in GGUF_KQUANTS and len(dims) == 2 and dims[0] % 256 == 0:
            fmt, superblock, repack = GGUF_KQUANTS[kind]
            row_bytes = dims[0] // 256 * superblock
            yield name, fmt, dims[0], repack(data[start + offset:start + offset + row_bytes * dims[1]]
                                             .reshape(dims[1], row_bytes))
            continue
        fmt = GGUF_BLOCKS.get(kind)
        if fmt is None or len(dims) != 2 or dims[0] % 32:
            continue
        row_bytes = dims[0] // 32 * BLOCK_FORMATS[fmt][1]
        yield name, fmt, dims[0], data[start + offset:start + offset + row_bytes * dims[1]].reshape(dims[1], row_bytes)


# a row's key: two int64 words, compared (and sorted) as one 16-byte value
_KEY = np.dtype([("a", "<i8"), ("b", "<i8")])


def _row_keys(values: np.ndarray) -> np.ndarray:
    """A 128-bit key of each float32 row (an even number of columns), as an array of `_KEY`: two
    sums, mod 2 ** 64, of its bits as 64-bit words times odd random numbers (torch's int64
    arithmetic wraps; blake2b of every row took seconds on a 135M model, and a key of a sample
    of the columns mixed up rows of a Q8_0 embedding). Rows that share a key but not their
    values would take the wrong blocks; the final widen-and-compare then keeps that matrix
    float32."""
    gen = torch.Generator().manual_seed(0x9E3779B9)
    mix = torch.randint(-2 ** 62, 2 ** 62, (3, values.shape[1] // 2), generator=gen, dtype=torch.int64) | 1
    words = torch.from_numpy(values).view(torch.int64) ^ mix[2]  # salted: zero rows of other widths differ
    pair = torch.stack([(words * mix[0]).sum(dim=1), ((words ^ (words >> 17)) * mix[1]).sum(dim=1)], dim=1)
    return np.ascontiguousarray(pair.numpy()).view(_KEY).ravel()


def keep_gguf_blocks(model, gguf_path: Path, lib) -> int:
    """Each float32 matrix of `model` whose rows all come from quantized tensors of one format
    in `gguf_path` becomes those blocks (cpu_kernels.blocks). `lib`: the C kernels, which
    widen. Returns the bytes saved."""
    owners = [m for m in matrix_owners(model) if m.weight.dtype == torch.float32 and m.weight.shape[1] % 32 == 0]
    if not owners:
        return 0
    # every row of ours, sorted by the first word of its key: a file row's matches are one range
    # of it (most often one row; several where rows are equal), kept where the second word
    # agrees too. Arrays, not a dict of 200k rows (2 s)
    keys = np.concatenate([_row_keys(m.weight.detach().numpy()) for m in owners])
    owner_of = np.concatenate([np.full(m.weight.shape[0], i) for i, m in enumerate(owners)])
    row_of = np.concatenate([np.arange(m.weight.shape[0]) for m in owners])
    order = np.argsort(keys["a"], kind="stable")
    first, second = keys["a"][order], keys["b"][order]
    found: dict[int, tuple[str, np.ndarray, np.ndarray]] = {}  # owner -> (format, its blocks, rows found)
    mixed: set[int] = set()
    for _, fmt, columns, mapped in gguf_block_tensors(gguf_path):
        raw = mapped if mapped.flags.writeable else np.array(mapped)  # the file is mapped read-only
        file_keys = _row_keys(lib.widen(blocks(torch.from_numpy(raw), fmt, columns)).numpy())
        lo = np.searchsorted(first, file_keys["a"], "left")
        counts = np.searchsorted(first, file_keys["a"], "right") - lo
        theirs = np.repeat(np.arange(len(file_keys)), counts)  # the file's row of each match
        # the place in `first` of each match: its file row's lo, plus its place in that range
        at = np.repeat(lo, counts) + np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        same = second[at] == file_keys["b"][theirs]
        theirs, at = theirs[same], at[same]
        if not len(at):
            continue
        matched = order[at]
        owner, ours = owner_of[matched], row_of[matched]
        for i in np.unique(owner).tolist():
            hit = owner == i
            entry = found.get(i)
            if entry is None:
                rows = owners[i].weight.shape[0]
                entry = found[i] = (fmt, np.zeros((rows, raw.shape[1]), np.uint8), np.zeros(rows, bool))
            if entry[0] != fmt or entry[1].shape[1] != raw.shape[1]:
                mixed.add(i)
                continue
            entry[1][ours[hit]] = raw[theirs[hit]]
            entry[2][ours[hit]] = True
    saved = 0
    for i, (fmt, packed, rows_found) in found.items():
        m = owners[i]
        if i in mixed or not rows_found.all():
            continue
        weight = blocks(torch.from_numpy(packed), fmt, m.weight.shape[1])
        if not torch.equal(lib.widen(weight).view(torch.int32), m.weight.detach().view(torch.int32)):  # -0.0 too
            logger.warning("the GGUF blocks of a %s matrix do not widen to its values: it stays float32",
                           tuple(m.weight.shape))
            continue
        saved += m.weight.numel() * 4 - packed.nbytes
        m.weight = weight
    return saved
