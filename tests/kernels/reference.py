"""Plain reference versions of every kernel: a loop or a textbook formula each, slow and
obviously right. The Triton kernels (tests/kernels) and the tuned torch path
(pageserve.triton_kernels.torch_ops, tests/test_torch_ops.py) are both checked against these."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, sliding_window=0,
                    softcap=0.0):
    """One request at a time, in float32: K and V gathered slot by slot through the block
    table, causal over each request's whole context (or, with sliding_window, over the
    window's last positions; softcap: scores capped as cap * tanh(s / cap)). Cache layout [blocks, Hkv, block size, D]."""
    bs = k_cache.shape[2]
    group = q.shape[1] // k_cache.shape[1]
    qsl, lens, tables = query_start_loc.tolist(), seq_lens.tolist(), block_tables.tolist()
    out = torch.empty_like(q)
    for b, ctx in enumerate(lens):
        start, end = qsl[b], qsl[b + 1]
        blocks = torch.tensor([tables[b][p // bs] for p in range(ctx)])
        offsets = torch.tensor([p % bs for p in range(ctx)])
        k = k_cache[blocks, :, offsets].float().repeat_interleave(group, 1)  # [ctx, H, D]
        v = v_cache[blocks, :, offsets].float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(ctx - (end - start), ctx)[:, None]
        scores = scores.masked_fill(torch.arange(ctx)[None, :] > q_pos, -math.inf)
        if sliding_window:
            scores = scores.masked_fill(torch.arange(ctx)[None, :] <= q_pos - sliding_window, -math.inf)
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Token by token; a negative slot (padding) is written nowhere."""
    bs = k_cache.shape[2]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // bs, :, slot % bs] = key[t]
            v_cache[slot // bs, :, slot % bs] = value[t]


def rms_norm(x, weight, eps, residual=None):
    """(weight * x / rms(x), x), with x the sum with the residual; the normalization in float32,
    rounded once to x's dtype before the weight."""
    if residual is not None:
        x = x + residual
    h = x.float()
    return weight * (h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype), x


def rope_cos_sin(positions, cos_sin_cache, dtype):
    """cos and sin of each position's D/2 frequencies, [T, 1, D/2], from a [max_pos, D] table
    (cos then sin)."""
    half = cos_sin_cache.shape[-1] // 2
    rows = cos_sin_cache[positions].to(dtype)
    return rows[:, None, :half], rows[:, None, half:]


def rotary_embedding(q, k, cos, sin) -> None:
    """Neox-style rotation by the rotate-half formula, in place."""
    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], -1)
    full_cos, full_sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    for x in (q, k):
        x.copy_(x * full_cos + rotate_half(x) * full_sin)


def silu_and_mul(x):
    half = x.shape[-1] // 2
    return F.silu(x[:, :half]) * x[:, half:]


def apply_token_bitmask(logits, bitmask) -> None:
    """Token by token: bit j of word w allows token 32 * w + j; the others get -inf."""
    words = bitmask.tolist()
    for row in range(logits.shape[0]):
        for token in range(logits.shape[1]):
            if not (words[row][token // 32] >> (token % 32)) & 1:
                logits[row, token] = float("-inf")


def poison_out_of_window(k_cache, v_cache, block_tables, query_start_loc, seq_lens, window) -> int:
    """NaN into every cache block that lies wholly before the window of each request's first
    query in the step (a kernel that read one would return NaN); returns how many."""
    bs = k_cache.shape[2]
    qsl, lens, tables = query_start_loc.tolist(), seq_lens.tolist(), block_tables.tolist()
    poisoned = 0
    for b, ctx in enumerate(lens):
        first_seen = max(ctx - (qsl[b + 1] - qsl[b]) - window + 1, 0)
        for i in range(first_seen // bs):
            k_cache[tables[b][i]] = float("nan")
            v_cache[tables[b][i]] = float("nan")
            poisoned += 1
    return poisoned
