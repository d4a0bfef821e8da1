"""Multi-LoRA shrink and expand (Punica's design, as in vLLM's LoRA kernels): the step's tokens
grouped by adapter slot, every group multiplied by its own slot's A and B in one launch.

shrink: y[t] = A[slot(t)] @ x[t] for all slices' ranks at once (A [S, L, K], L = slices * R),
into a float32 y [T, L]. expand: out[t, off:off+size] += y[t, col:col+R] @ B[slot(t), off:off+size]^T
for every slice (col, off, size), in place, all slices in one launch.

A program takes up to BLOCK_M tokens of one group, gathered through sorted_tokens, and a tile of
columns. The grid covers the worst case, all T tokens in one group, for each of the G groups, so
it follows from T and the shapes alone (capturable in a CUDA graph): programs past their group's
count, and groups of slot -1, return at once. Few tokens read all of a slot's A for little work,
so shrink splits K over the grid; the splits add their float32 partial sums into y atomically
(the last bits of y may then vary from run to run). Tiles and splits follow the token count's
bucket, not the count itself: one compiled variant a bucket."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pageserve.triton_kernels.paged_attention import _dot  # float32 accumulation, IEEE precision

Slices = tuple[tuple[int, int, int], ...]


# the input's token stride can change with the step (a single token's view may report another);
# the adapters' sizes and strides are the model's and stay specialized
@triton.jit(do_not_specialize=["stride_xt"])
def _lora_shrink_kernel(
        x_ptr, a_ptr, y_ptr, sorted_tokens_ptr, group_slots_ptr, group_starts_ptr, group_counts_ptr,
        l_dim, k_dim, k_per_split, stride_xt, stride_as, stride_al, stride_yt,
        SPLIT: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """y[token, n] (+)= sum over this split's k of x[token, k] * a[slot, n, k] for the group
    program_id(2), its token tile and column tile program_id(0), its K split program_id(1)."""
    group = tl.program_id(2)
    slot = tl.load(group_slots_ptr + group)
    count = tl.load(group_counts_ptr + group)
    n_tiles = tl.cdiv(l_dim, BLOCK_N)
    m_tile = tl.program_id(0) // n_tiles
    if (slot < 0) | (m_tile * BLOCK_M >= count):
        return
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < count
    start = tl.load(group_starts_ptr + group)
    tokens = tl.load(sorted_tokens_ptr + start + rows, mask=row_ok, other=0).to(tl.int64)
    offs_n = (tl.program_id(0) % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < l_dim
    k_start = tl.program_id(1) * k_per_split
    offs_k = k_start + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :]
    # A's tile transposed, [BLOCK_K, BLOCK_N]: a row of A runs down each column, contiguous
    a_ptrs = a_ptr + slot.to(tl.int64) * stride_as + offs_n.to(tl.int64)[None, :] * stride_al + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, k_per_split, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            a = tl.load(a_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < k_dim - k
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            a = tl.load(a_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc += _dot(x, a, UPCAST)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    y_ptrs = y_ptr + tokens[:, None] * stride_yt + offs_n[None, :]
    mask = row_ok[:, None] & n_ok[None, :]
    if SPLIT:
        tl.atomic_add(y_ptrs, acc, mask=mask, sem="relaxed")
    else:
        tl.store(y_ptrs, acc, mask=mask)


# as above for the output's token stride; the slices are the layer's, compiled in
@triton.jit(do_not_specialize=["stride_ot"])
def _lora_expand_kernel(
        y_ptr, b_ptr, out_ptr, sorted_tokens_ptr, group_slots_ptr, group_starts_ptr, group_counts_ptr,
        rank, stride_yt, stride_bs, stride_bn, stride_br, stride_ot,
        COLS: tl.constexpr, OFFS: tl.constexpr, SIZES: tl.constexpr, FIRST_TILES: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """out[token, off + n] += sum over r of y[token, col + r] * b[slot, off + n, r] for the group
    program_id(2), its token tile program_id(1) and column tile program_id(0), numbered across
    the slices: slice j owns tiles FIRST_TILES[j] up to FIRST_TILES[j + 1]."""
    group = tl.program_id(2)
    slot = tl.load(group_slots_ptr + group)
    count = tl.load(group_counts_ptr + group)
    m_tile = tl.program_id(1)
    if (slot < 0) | (m_tile * BLOCK_M >= count):
        return
    tile = tl.program_id(0)
    col = tile * 0 + COLS[0]
    off = tile * 0 + OFFS[0]
    size = tile * 0 + SIZES[0]
    first = tile * 0
    for j in tl.static_range(1, len(COLS)):
        inside = tile >= FIRST_TILES[j]
        col = tl.where(inside, COLS[j], col)
        off = tl.where(inside, OFFS[j], off)
        size = tl.where(inside, SIZES[j], size)
        first = tl.where(inside, FIRST_TILES[j], first)
    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < count
    start = tl.load(group_starts_ptr + group)
    tokens = tl.load(sorted_tokens_ptr + start + rows, mask=row_ok, other=0).to(tl.int64)
    offs_n = (tile - first) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < size
    offs_r = tl.arange(0, BLOCK_R)
    y_ptrs = y_ptr + tokens[:, None] * stride_yt + (col + offs_r)[None, :]
    # B's tile transposed, [BLOCK_R, BLOCK_N] (the slots keep B as [S, R, N]: rows along N)
    b_ptrs = b_ptr + slot.to(tl.int64) * stride_bs + (off + offs_n).to(tl.int64)[None, :] * stride_bn \
        + offs_r[:, None] * stride_br
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for r in range(0, rank, BLOCK_R):
        r_ok = offs_r < rank - r
        y = tl.load(y_ptrs, mask=row_ok[:, None] & r_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[None, :] & r_ok[:, None], other=0.0)
        acc += _dot(y, b.to(tl.float32), False)
        y_ptrs += BLOCK_R
        b_ptrs += BLOCK_R * stride_br
    out_ptrs = out_ptr + tokens[:, None] * stride_ot + (off + offs_n)[None, :]
    mask = row_ok[:, None] & n_ok[None, :]
    acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def shrink_config(t: int, k: int, l_dim: int, dtype: torch.dtype) -> dict:
    """Tiles and K splits by token-count bucket, so that a bucket compiles one variant: few
    tokens split K the most, to spread a slot's A over the SMs. One column tile for L up to 64
    (x is read once per column tile)."""
    if t <= 16:
        config = dict(block_m=16, block_k=256, split_k=16, num_warps=4, num_stages=3)
    elif t <= 256:
        config = dict(block_m=32, block_k=128, split_k=16, num_warps=4, num_stages=3)
    elif t <= 2048:
        config = dict(block_m=64, block_k=64, split_k=8, num_warps=4, num_stages=4)
    else:
        config = dict(block_m=64, block_k=64, split_k=2, num_warps=4, num_stages=4)
    if dtype == torch.float32:  # tiles of twice the bytes
        config["block_k"] //= 2
    config["block_n"] = min(max(triton.next_power_of_2(l_dim), 16), 64)
    config["split_k"] = min(config["split_k"], triton.cdiv(k, config["block_k"]))
    return config


def expand_config(t: int, rank: int) -> dict:
    """Tiles by the token count; the whole rank in one step up to 64."""
    block_r = min(max(triton.next_power_of_2(rank), 16), 64)
    if t <= 16:
        return dict(block_m=16, block_n=128, block_r=block_r, num_warps=4)
    if t <= 256:
        return dict(block_m=32, block_n=128, block_r=block_r, num_warps=4)
    return dict(block_m=64, block_n=128, block_r=block_r, num_warps=8)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_groups(name: str, num_tokens: int, device: torch.device, sorted_tokens, group_slots, group_starts,
                  group_counts) -> None:
    _check(sorted_tokens.dtype == torch.int32 and tuple(sorted_tokens.shape) == (num_tokens,)
           and sorted_tokens.is_contiguous(),
           f"{name}: sorted_tokens must be contiguous int32 [{num_tokens}], got {sorted_tokens.dtype} "
           f"{tuple(sorted_tokens.shape)}")
    groups = tuple(group_slots.shape)
    for label, t in (("group_slots", group_slots), ("group_starts", group_starts), ("group_counts", group_counts)):
        _check(t.dtype == torch.int32 and t.dim() == 1 and t.is_contiguous() and tuple(t.shape) == groups,
               f"{name}: {label} must be contiguous int32 [G], the same G as group_slots {groups}, got "
               f"{t.dtype} {tuple(t.shape)}")
    devices = {t.device for t in (sorted_tokens, group_slots, group_starts, group_counts)} | {device}
    _check(len(devices) == 1, f"{name}: all tensors must be on one device, got {sorted(map(str, devices))}")


def _tile(config: dict, key: str, name: str) -> int:
    v = config[key]
    _check(isinstance(v, int) and v >= 16 and v & (v - 1) == 0, f"{name}: {key} must be a power of two >= 16, got {v}")
    return v


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, sorted_tokens: torch.Tensor, group_slots: torch.Tensor,
                group_starts: torch.Tensor, group_counts: torch.Tensor, *, block_m: int | None = None,
                block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
                num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """x [T, K] float16/bfloat16/float32 with unit column stride; lora_a [S, L, K] in x's dtype,
    contiguous; sorted_tokens [T] int32, the tokens grouped: group g is sorted_tokens[start :
    start + count] with (start, count) = (group_starts[g], group_counts[g]) and runs under slot
    group_slots[g], or under none if that is -1 (all int32 [G]). Groups must not share tokens and
    slots must be < S: device data, not checked. Returns y [T, L] float32, y[t] = lora_a[slot] @ x[t]
    for the tokens of a group with a slot, 0 for the others. The keywords tune the launch; unset
    ones come from shrink_config. Raises ValueError on inputs that do not fit."""
    _check(x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16, torch.float32),
           f"lora_shrink: x must be 2-D float16/bfloat16/float32, got {x.dtype} {tuple(x.shape)}")
    _check(x.stride(1) == 1 or x.shape[1] <= 1, "lora_shrink: x's columns must be contiguous (stride 1)")
    _check(lora_a.dim() == 3 and lora_a.dtype == x.dtype,
           f"lora_shrink: lora_a must be 3-D [S, L, K] in x's dtype {x.dtype}, got {lora_a.dtype} "
           f"{tuple(lora_a.shape)}")
    t, k = x.shape
    l_dim = lora_a.shape[1]
    _check(lora_a.shape[2] == k, f"lora_shrink: lora_a {tuple(lora_a.shape)} must have K = {k} (x's columns) last")
    _check(lora_a.is_contiguous(), "lora_shrink: lora_a must be contiguous")
    _check_groups("lora_shrink", t, x.device, sorted_tokens, group_slots, group_starts, group_counts)
    _check(lora_a.device == x.device, f"lora_shrink: lora_a is on {lora_a.device}, x on {x.device}")
    y = torch.zeros((t, l_dim), dtype=torch.float32, device=x.device)
    num_groups = group_slots.shape[0]
    if t == 0 or l_dim == 0 or num_groups == 0:
        return y
    config = shrink_config(t, k, l_dim, x.dtype)
    config.update({key: v for key, v in dict(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split_k,
                                             num_warps=num_warps, num_stages=num_stages).items() if v is not None})
    bm, bn, bk = (_tile(config, key, "lora_shrink") for key in ("block_m", "block_n", "block_k"))
    _check(isinstance(config["split_k"], int) and config["split_k"] >= 1,
           f"lora_shrink: split_k must be a positive int, got {config['split_k']}")
    k_blocks = triton.cdiv(k, bk)
    k_per_split = triton.cdiv(k_blocks, min(config["split_k"], k_blocks)) * bk
    split = triton.cdiv(k, k_per_split)  # no split left with nothing to do
    grid = (triton.cdiv(t, bm) * triton.cdiv(l_dim, bn), split, num_groups)
    _lora_shrink_kernel[grid](
        x, lora_a, y, sorted_tokens, group_slots, group_starts, group_counts,
        l_dim, k, k_per_split, x.stride(0), lora_a.stride(0), lora_a.stride(1), y.stride(0),
        SPLIT=split > 1, EVEN_K=k_per_split * split == k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        UPCAST=x.dtype != torch.float32 and triton.knobs.runtime.interpret,
        num_warps=config["num_warps"], num_stages=config["num_stages"])
    return y


def _check_slices(slices, rank: int, l_dim: int, n: int) -> Slices:
    _check(isinstance(slices, (tuple, list)) and len(slices) > 0
           and all(isinstance(s, (tuple, list)) and len(s) == 3 and all(isinstance(v, int) for v in s) for s in slices),
           f"lora_expand: slices must be a non-empty tuple of (col, off, size) ints, got {slices!r}")
    slices = tuple(tuple(s) for s in slices)
    for col, off, size in slices:
        _check(0 <= col and col + rank <= l_dim, f"lora_expand: slice {(col, off, size)}: columns col..col + R = "
                                                 f"{col}..{col + rank} must lie in y's {l_dim} columns")
        _check(size > 0 and 0 <= off and off + size <= n, f"lora_expand: slice {(col, off, size)}: output "
                                                          f"columns {off}..{off + size} must lie in out's {n}")
    spans = sorted((off, off + size) for _, off, size in slices)
    _check(all(a[1] <= b[0] for a, b in zip(spans, spans[1:])),
           f"lora_expand: the slices' output columns must not overlap, got {slices}")
    return slices


def lora_expand(out: torch.Tensor, y: torch.Tensor, lora_b: torch.Tensor, slices: Slices,
                sorted_tokens: torch.Tensor, group_slots: torch.Tensor, group_starts: torch.Tensor,
                group_counts: torch.Tensor, *, block_m: int | None = None, block_n: int | None = None,
                num_warps: int | None = None) -> None:
    """out [T, N] float16/bfloat16/float32 with unit column stride, updated in place: for each
    slice (col, off, size) of slices (python ints), out[t, off:off+size] += y[t, col:col+R] @
    lora_b[slot, off:off+size, :]^T, accumulated in float32 and rounded once to out's dtype.
    y [T, L] float32 with unit column stride (lora_shrink's); lora_b [S, N, R] in out's dtype,
    any strides (the slots' B, [S, R, N], transposed: runtime/lora/slots.py); the groups as for
    lora_shrink. Rows of tokens without a slot are not touched.
    The keywords tune the launch; unset ones come from expand_config. Raises ValueError on
    inputs that do not fit."""
    _check(out.dim() == 2 and out.dtype in (torch.float16, torch.bfloat16, torch.float32),
           f"lora_expand: out must be 2-D float16/bfloat16/float32, got {out.dtype} {tuple(out.shape)}")
    _check(out.stride(1) == 1 or out.shape[1] <= 1, "lora_expand: out's columns must be contiguous (stride 1)")
    t, n = out.shape
    _check(y.dim() == 2 and y.dtype == torch.float32 and y.shape[0] == t,
           f"lora_expand: y must be float32 [{t}, L], got {y.dtype} {tuple(y.shape)}")
    _check(y.stride(1) == 1 or y.shape[1] <= 1, "lora_expand: y's columns must be contiguous (stride 1)")
    _check(lora_b.dim() == 3 and lora_b.dtype == out.dtype and lora_b.shape[1] == n,
           f"lora_expand: lora_b must be 3-D [S, {n}, R] in out's dtype {out.dtype}, got {lora_b.dtype} "
           f"{tuple(lora_b.shape)}")
    rank = lora_b.shape[2]
    slices = _check_slices(slices, rank, y.shape[1], n)
    _check_groups("lora_expand", t, out.device, sorted_tokens, group_slots, group_starts, group_counts)
    _check(y.device == lora_b.device == out.device,
           f"lora_expand: out, y and lora_b must be on one device, got {out.device}, {y.device}, {lora_b.device}")
    num_groups = group_slots.shape[0]
    if t == 0 or rank == 0 or num_groups == 0:
        return
    config = expand_config(t, rank)
    config.update({key: v for key, v in dict(block_m=block_m, block_n=block_n, num_warps=num_warps).items()
                   if v is not None})
    bm, bn, br = (_tile(config, key, "lora_expand") for key in ("block_m", "block_n", "block_r"))
    tiles = [triton.cdiv(size, bn) for _, _, size in slices]
    first = tuple(sum(tiles[:j]) for j in range(len(slices)))
    grid = (sum(tiles), triton.cdiv(t, bm), num_groups)
    _lora_expand_kernel[grid](
        y, lora_b, out, sorted_tokens, group_slots, group_starts, group_counts,
        rank, y.stride(0), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), out.stride(0),
        COLS=tuple(s[0] for s in slices), OFFS=tuple(s[1] for s in slices), SIZES=tuple(s[2] for s in slices),
        FIRST_TILES=first, BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=br, num_warps=config["num_warps"])
