"""How a float32 model's matrices are kept on the CPU path with the C kernels, smaller than
float32 where that loses nothing: the C linear widens each weight to the same float32 value
as it reads it, so every sum is as before, to the bit, and a decode step, which reads every
matrix once, reads fewer bytes.

- `narrow_exact_matrices`: bfloat16, where every value's low 16 bits are zero (a checkpoint
  stored in bfloat16, as most are).
- `keep_gguf_blocks`: a GGUF file's own quantized blocks (Q8_0, Q4_0, Q4_1: 1.06, 0.56 and
  0.63 bytes a value), instead of the float32 copy the converter dequantized. Which file rows
  are which of our rows is found by value, not by name: every row of a quantized tensor is
  widened by the C kernels and looked up among the rows of our matrices (q/k/v and gate/up
  are fused there; the converter also reorders the rows of q and k). A matrix takes blocks
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


def matrix_owners(model) -> list[torch.nn.Module]:
    """The modules whose `weight` is a matrix a step multiplies by: every linear layer, and the
    embedding where the lm_head is tied to it (on one rank: a split embedding is all-reduced,
    and stays float32)."""
    owners = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if getattr(model, "lm_head", True) is None and type(model.embed_tokens) is torch.nn.Embedding:
        owners.append(model.embed_tokens)
    return owners


def narrow_exact_matrices(model) -> int:
    """The float32 matrices in bfloat16, if every value of every one of them is a bfloat16
    value (one stream of SmolLM2-135M's shapes: the linear layers 26.4 -> 14.8 ms). Returns the
    bytes saved (0: some value is not, and all stay float32)."""
    owners = [m for m in matrix_owners(model) if m.weight.dtype == torch.float32]
    if not owners or any((m.weight.detach().view(torch.int32) & 0xFFFF).any() for m in owners):
        return 0
    for m in owners:
        m.weight = torch.nn.Parameter(m.weight.detach().to(torch.bfloat16), requires_grad=False)
    return sum(m.weight.numel() * 2 for m in owners)


# GGUF metadata value types: fixed sizes; 8 is a string, 9 an array
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_block_tensors(path: Path):
    """(name, format, columns, [rows, bytes a row] uint8, mapped read-only) of each 2-D tensor
    of a GGUF file in a block format kept here. gguf's own reader builds every metadata field
    (a 49k-token vocabulary: 4 s); this skips them."""
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
        fmt = GGUF_BLOCKS.get(kind)
        if fmt is None or len(dims) != 2 or dims[0] % 32:
            continue
        row_bytes = dims[0] // 32 * BLOCK_FORMATS[fmt][1]
        yield name, fmt, dims[0], data[start + offset:start + offset + row_bytes * dims[1]].reshape(dims[1], row_bytes)


def _row_keys(values: np.ndarray) -> list[bytes]:
    """A 128-bit key of each float32 row (an even number of columns): two sums, mod 2 ** 64,
    of its bits as 64-bit words times odd random numbers (torch's int64 arithmetic wraps;
    blake2b of every row took seconds on a 135M model, and a key of a sample of the columns
    mixed up rows of a Q8_0 embedding). Rows that share a key but not their values would take
    the wrong blocks; the final widen-and-compare then keeps that matrix float32."""
    gen = torch.Generator().manual_seed(0x9E3779B9)
    mix = torch.randint(-2 ** 62, 2 ** 62, (3, values.shape[1] // 2), generator=gen, dtype=torch.int64) | 1
    words = torch.from_numpy(values).view(torch.int64) ^ mix[2]  # salted: zero rows of other widths differ
    pair = torch.stack([(words * mix[0]).sum(dim=1), ((words ^ (words >> 17)) * mix[1]).sum(dim=1)], dim=1)
    return [row.tobytes() for row in pair.numpy()]


def keep_gguf_blocks(model, gguf_path: Path, lib) -> int:
    """Each float32 matrix of `model` whose rows all come from quantized tensors of one format
    in `gguf_path` becomes those blocks (cpu_kernels.blocks). `lib`: the C kernels, which
    widen. Returns the bytes saved."""
    owners = [m for m in matrix_owners(model) if m.weight.dtype == torch.float32 and m.weight.shape[1] % 32 == 0]
    index: dict[bytes, list[tuple[int, int]]] = {}  # a row's values -> (owner, row) of each row holding them
    for i, m in enumerate(owners):
        for r, key in enumerate(_row_keys(m.weight.detach().numpy())):
            index.setdefault(key, []).append((i, r))
    found: dict[int, tuple[str, np.ndarray, np.ndarray]] = {}  # owner -> (format, its blocks, rows found)
    mixed: set[int] = set()
    for _, fmt, columns, mapped in gguf_block_tensors(gguf_path):
        raw = np.array(mapped)  # a copy: the file is mapped read-only
        values = lib.widen(blocks(torch.from_numpy(raw), fmt, columns)).numpy()
        hits: dict[int, tuple[list[int], list[int]]] = {}  # owner -> (its rows, the file's rows)
        for r, key in enumerate(_row_keys(values)):
            for i, row in index.get(key, ()):
                ours, theirs = hits.setdefault(i, ([], []))
                ours.append(row)
                theirs.append(r)
        for i, (ours, theirs) in hits.items():
            entry = found.get(i)
            if entry is None:
                rows = owners[i].weight.shape[0]
                entry = found[i] = (fmt, np.zeros((rows, raw.shape[1]), np.uint8), np.zeros(rows, bool))
            if entry[0] != fmt or entry[1].shape[1] != raw.shape[1]:
                mixed.add(i)
                continue
            entry[1][ours] = raw[theirs]
            entry[2][ours] = True
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
