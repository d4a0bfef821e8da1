"""Paged attention for a mixed step: prefill chunks (causal inside the chunk, over the
request's cached context) and single-token decodes in one varlen launch, plus a split-KV
path for long decodes on few sequences.

One program serves one KV head and a tile of a request's query tokens: all the query heads
that share the KV head are rows of the same tile (row r is token r // G, head r % G), so
each K/V tile is read once per group. K and V are gathered token by token through the
block table, so a KV tile may span several cache blocks whatever the block size."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
PARTITION_SIZE = 512  # context tokens per program on the split-KV path


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """The request whose query tiles hold tile `pid`: request b's tiles start at
    query_start_loc[b] // BLOCK_Q + b, an upper bound on the tiles before it."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    """a @ b accumulated in float32; UPCAST for Triton's interpreter, whose bf16 dot is wrong.
    IEEE precision keeps float32 models off TF32, as torch's matmuls are by default."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision="ieee")


# each specialized integer compiles a variant per divisibility by 16: batch size, partitions and
# table width change every step, one token's q/out views report other token strides (head and
# cache strides are fixed for the server's life and stay specialized)
@triton.jit(do_not_specialize=["num_seqs", "num_parts", "stride_qt", "stride_ot", "stride_bt", "window", "softcap"])
def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, query_start_loc_ptr,
        seq_lens_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, qk_scale, num_seqs, num_parts, window, softcap,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_kh, stride_kt,
        stride_vb, stride_vh, stride_vt, stride_bt,
        G: tl.constexpr, NUM_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, PARTITION: tl.constexpr,
        DECODE: tl.constexpr, SPLIT: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
        UPCAST: tl.constexpr):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    if DECODE:  # every request has one query token: one tile each
        seq = pid
    else:
        seq = _find_seq(query_start_loc_ptr, num_seqs, pid, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if DECODE:
        q_tile = 0
    else:
        q_tile = pid - (q_start // BLOCK_Q + seq)
        if q_tile * BLOCK_Q >= q_len:
            return
    ctx = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + rows // G
    head = kv_head * G + rows % G
    row_ok = (rows // G < BLOCK_Q) & (tok < q_len)
    q_pos = ctx - q_len + tok  # query token i sees every position up to its own
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_DIM
    q_off = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head.to(tl.int64)[:, None] * stride_qh
    q = tl.load(q_ptr + q_off + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    kv_begin = 0
    kv_end = ctx - q_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)  # last query position + 1
    if SPLIT:
        kv_begin = tl.program_id(2) * PARTITION
        kv_end = tl.minimum(kv_end, kv_begin + PARTITION)
    if SLIDING:  # start at the first cache block the tile's first query can still see
        first_seen = tl.maximum(ctx - q_len + q_tile * BLOCK_Q - window + 1, 0)
        kv_begin = tl.maximum(kv_begin, first_seen // BLOCK_SIZE * BLOCK_SIZE)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head64 = kv_head.to(tl.int64)
    for start in range(kv_begin, kv_end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_end
        block = tl.load(bt_row + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        in_block = (pos % BLOCK_SIZE).to(tl.int64)
        k_off = block * stride_kb + kv_head64 * stride_kh + in_block * stride_kt
        v_off = block * stride_vb + kv_head64 * stride_vh + in_block * stride_vt
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + k_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), UPCAST) * qk_scale  # log2 domain
        if SOFTCAP:  # cap * tanh(x / cap), the cap in the log2 domain too (as qk_scale)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        seen = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        if SLIDING:  # a query at p sees the `window` positions up to p
            seen = seen & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.exp2(s - base[:, None])
        alpha = tl.exp2(m - base)
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + v_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m = m_new

    if SPLIT:
        # partial results of this partition; the reduce kernel weighs them by their maxima
        part = (seq.to(tl.int64) * NUM_HEADS + head) * num_parts + tl.program_id(2)
        tl.store(part_m_ptr + part, m, mask=row_ok)
        tl.store(part_l_ptr + part, l, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + d[None, :], acc, mask=row_ok[:, None])
    else:
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        o_off = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head.to(tl.int64)[:, None] * stride_oh
        tl.store(out_ptr + o_off + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])


# as above: the partition count and token stride vary with the step, the head stride does not
@triton.jit(do_not_specialize=["num_parts", "stride_ot"])
def _reduce_partitions_kernel(out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, query_start_loc_ptr,
                              seq_lens_ptr, num_parts, stride_ot, stride_oh,
                              NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                              HEAD_PAD: tl.constexpr, PARTS_CHUNK: tl.constexpr,
                              PARTITION: tl.constexpr):
    """Partitions combined a chunk at a time (the same online rescaling as the main loop), so
    that a long context's many partitions never sit in registers at once."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    # partitions past the request's context wrote nothing
    used = tl.minimum(tl.cdiv(tl.load(seq_lens_ptr + seq), PARTITION), num_parts)
    first = (seq * NUM_HEADS + head) * num_parts
    d = tl.arange(0, HEAD_PAD)
    m_run = float("-inf")
    l_run = 0.0
    acc_run = tl.zeros([HEAD_PAD], tl.float32)
    for start in range(0, used, PARTS_CHUNK):
        parts = start + tl.arange(0, PARTS_CHUNK)
        ok = parts < used
        m = tl.load(part_m_ptr + first + parts, mask=ok, other=float("-inf"))
        l = tl.load(part_l_ptr + first + parts, mask=ok, other=0.0)
        acc = tl.load(part_acc_ptr + (first + parts)[:, None] * HEAD_PAD + d[None, :],
                      mask=ok[:, None], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, 0))  # -inf while only partitions before a window
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # (which saw nothing) came by
        w = tl.where(ok, tl.exp2(m - base), 0.0)
        rescale = tl.exp2(m_run - base)
        l_run = l_run * rescale + tl.sum(l * w, 0)
        acc_run = acc_run * rescale + tl.sum(acc * w[:, None], 0)
        m_run = m_new
    out = acc_run / l_run
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 128


def max_split_seqs(num_kv_heads: int, device: torch.device) -> int:
    """The most requests a decode-only step may hold and still take the split-KV path."""
    return (_sm_count(device) - 1) // num_kv_heads


def split_partitions(num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int,
                     device: torch.device, partition_size: int = PARTITION_SIZE) -> int:
    """How many context partitions a decode-only step is split into, or 0 for no split: worth
    it when one program per (request, KV head) leaves most of the GPU's SMs idle."""
    if max_query_len != 1 or max_seq_len <= partition_size:
        return 0
    if num_seqs * num_kv_heads >= _sm_count(device):
        return 0
    return triton.cdiv(max_seq_len, partition_size)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, max_query_len: int, max_seq_len: int,
                    sliding_window: int = 0, softcap: float = 0.0, num_partitions: int | None = None, partition_size: int = PARTITION_SIZE,
                    block_n: int = 64, num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """Same contract as torch_ops.paged_attention: q [T, H, D] (head rows contiguous),
    caches [num_blocks, Hkv, block_size, D], block_tables [B, max_blocks] int32,
    query_start_loc [B + 1] int32, seq_lens [B] int32 (context including this step's tokens,
    already cached). max_query_len and max_seq_len are the host-side maxima of the batch.
    sliding_window: a query at position p sees only positions p - sliding_window + 1 .. p, and
    cache blocks wholly before that are not read (0: the whole context). softcap: scores
    (after the scale) become softcap * tanh(score / softcap) (Gemma 2; 0: none).
    num_partitions: None lets split_partitions decide; 0 forces the one-pass path; more
    forces the split path (decode-only steps, at least cdiv(max_seq_len, partition_size)).
    block_n (context tokens per inner step), num_warps and num_stages tune the GPU launch."""
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, num_kv_heads, block_size, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert q.dtype == k_cache.dtype == v_cache.dtype
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert block_tables.dtype == query_start_loc.dtype == seq_lens.dtype == torch.int32
    assert block_tables.stride(1) == 1 and query_start_loc.shape[0] == num_seqs + 1
    assert query_start_loc.stride(0) == 1 and seq_lens.stride(0) == 1
    assert block_tables.shape[0] == num_seqs and block_tables.shape[1] * block_size >= max_seq_len
    assert len({t.device for t in (q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)}) == 1
    assert block_n >= 16 and block_n & (block_n - 1) == 0, "block_n: a power of two, at least 16"
    assert sliding_window >= 0
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    if num_partitions is None:
        num_partitions = split_partitions(num_seqs, num_kv_heads, max_query_len, max_seq_len,
                                          q.device, partition_size)
    split = num_partitions > 0
    if split:
        assert max_query_len == 1 and num_partitions * partition_size >= max_seq_len
        assert partition_size % block_n == 0
    head_pad = triton.next_power_of_2(head_dim)
    # decodes fill the rows with heads of one token; prefill tiles take several tokens
    block_m = max(16 if max_query_len == 1 else 64, triton.next_power_of_2(group))
    block_q = 1 if max_query_len == 1 else block_m // group
    num_tiles = num_seqs if max_query_len == 1 else num_tokens // block_q + num_seqs
    parts = [torch.empty(0, device=q.device)] * 3
    if split:
        shape = (num_seqs, num_heads, num_partitions)
        parts = [torch.empty(shape, dtype=torch.float32, device=q.device),
                 torch.empty(shape, dtype=torch.float32, device=q.device),
                 torch.empty(shape + (head_pad,), dtype=torch.float32, device=q.device)]
    grid = (num_tiles, num_kv_heads, num_partitions) if split else (num_tiles, num_kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, *parts,
        scale * LOG2E, num_seqs, max(num_partitions, 1), sliding_window, softcap * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        G=group, NUM_HEADS=num_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEAD_PAD=head_pad,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n, PARTITION=partition_size,
        DECODE=max_query_len == 1, SPLIT=split, SLIDING=sliding_window > 0, SOFTCAP=softcap > 0,
        UPCAST=q.dtype != torch.float32 and triton.knobs.runtime.interpret,
        num_warps=num_warps, num_stages=num_stages)
    if split:
        _reduce_partitions_kernel[(num_seqs, num_heads)](
            out, *parts, query_start_loc, seq_lens, num_partitions, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_PAD=head_pad,
            PARTS_CHUNK=16, PARTITION=partition_size)
    return out
