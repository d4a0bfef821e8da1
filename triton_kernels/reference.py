"""Pure-torch versions of every kernel. The CPU backend runs these; kernel tests compare
against them.

Paged KV cache layout, per layer: k_cache and v_cache of shape
[num_blocks, block_size, num_kv_heads, head_dim]; token slot s lives in block s // block_size
at offset s % block_size."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write the step's new K and V ([T, Hkv, D]) into the cache at their slots."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


@dataclass(slots=True)
class AttentionGroup:
    """Requests padded to one query length and one context length."""
    q_index: torch.Tensor  # [B, Q] rows of the flat query tensor (padding repeats a valid row)
    kv_slots: torch.Tensor  # [B, L] cache slots of each request's context (padding -> slot 0)
    mask: torch.Tensor  # [B, 1, Q, L] True where a query may attend
    out_rows: torch.Tensor  # [n] flat token rows that this group produces
    out_select: torch.Tensor  # [n] positions of those rows in the padded [B * Q] output


def _plan_group(sel: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                seq_lens: torch.Tensor, block_size: int) -> AttentionGroup:
    q_start = query_start_loc[:-1][sel]
    q_lens = query_start_loc[1:][sel] - q_start
    ctx = seq_lens[sel]
    bt = block_tables[sel].long()
    max_q, max_l = int(q_lens.max()), int(ctx.max())
    qi = torch.arange(max_q)
    valid_q = qi[None, :] < q_lens[:, None]  # [B, Q]
    q_index = q_start[:, None] + torch.minimum(qi[None, :], (q_lens - 1)[:, None])
    pos = torch.arange(max_l)
    blk = bt[:, torch.clamp(pos // block_size, max=bt.shape[1] - 1)]
    kv_slots = torch.where(pos[None, :] < ctx[:, None], blk * block_size + pos % block_size, 0)
    # query i of a request sits at position ctx - q_len + i and sees every position up to it
    q_pos = (ctx - q_lens)[:, None] + torch.minimum(qi[None, :], (q_lens - 1)[:, None])
    mask = pos[None, None, :] <= q_pos[:, :, None]
    flat_valid = valid_q.reshape(-1)
    return AttentionGroup(
        q_index=q_index,
        kv_slots=kv_slots,
        mask=mask[:, None],
        out_rows=q_index.reshape(-1)[flat_valid],
        out_select=flat_valid.nonzero().squeeze(1),
    )


def plan_paged_attention(block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                         seq_lens: torch.Tensor, block_size: int) -> list[AttentionGroup]:
    """Index tensors for one step, built once and shared by every layer. Decodes (one query
    token) and prefill chunks form separate groups, so a decode is not padded to a chunk."""
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    groups = []
    for sel in (q_lens == 1, q_lens > 1):
        if bool(sel.any()):
            groups.append(_plan_group(sel.nonzero().squeeze(1), block_tables, query_start_loc,
                                      seq_lens, block_size))
    return groups


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float,
                    plan: list[AttentionGroup] | None = None) -> torch.Tensor:
    """Varlen attention for a mixed step. q: [T, H, D], the step's query tokens, request by
    request (query_start_loc[b]:query_start_loc[b+1]); seq_lens[b]: the request's context
    length including this step's tokens, whose K/V are already in the cache. Queries are
    causal inside their chunk and see the whole cached context before it."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    if plan is None:
        plan = plan_paged_attention(block_tables, query_start_loc, seq_lens, k_cache.shape[1])
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(q)
    for g in plan:
        b, max_q = g.q_index.shape
        max_l = g.kv_slots.shape[1]
        # query heads that share a KV head become extra query rows: no K/V repeat needed
        qg = q[g.q_index.reshape(-1)].view(b, max_q, num_kv_heads, group_size, head_dim)
        qg = qg.permute(0, 2, 1, 3, 4).reshape(b, num_kv_heads, max_q * group_size, head_dim)
        kg = k_flat[g.kv_slots.reshape(-1)].view(b, max_l, num_kv_heads, head_dim).transpose(1, 2)
        vg = v_flat[g.kv_slots.reshape(-1)].view(b, max_l, num_kv_heads, head_dim).transpose(1, 2)
        mask = g.mask
        if group_size > 1:
            mask = mask[:, :, :, None, :].expand(b, 1, max_q, group_size, max_l)
            mask = mask.reshape(b, 1, max_q * group_size, max_l)
        og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale)
        og = og.view(b, num_kv_heads, max_q, group_size, head_dim).permute(0, 2, 1, 3, 4)
        out[g.out_rows] = og.reshape(b * max_q, num_heads, head_dim)[g.out_select]
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm fused with the residual add: returns (normed, new residual), where the new
    residual is x + residual (or x when there is none)."""
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), x


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> None:
    """Neox-style RoPE in place on q [T, H, D] and k [T, Hkv, D]; cos_sin_cache is
    [max_pos, D] holding cos of the D/2 frequencies then their sin, in float32."""
    half = q.shape[-1] // 2
    cs = cos_sin_cache[positions]
    cos = cs[:, None, :half].to(q.dtype)
    sin = cs[:, None, half:].to(q.dtype)
    for x in (q, k):
        x1, x2 = x[..., :half], x[..., half:]
        r1 = x1 * cos - x2 * sin
        r2 = x2 * cos + x1 * sin
        x[..., :half] = r1
        x[..., half:] = r2


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * I] holding gate then up; returns silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, every logit whose bit is 0 in the packed int32 mask
    [B, ceil(V / 32)] (bit j of word w stands for token 32 * w + j)."""
    vocab = logits.shape[-1]
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().reshape(bitmask.shape[0], -1)[:, :vocab]
    logits.masked_fill_(~allowed, float("-inf"))
