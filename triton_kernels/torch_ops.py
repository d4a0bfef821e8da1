"""Pure-torch versions of every kernel. The CPU backend runs these; kernel tests compare
against them.

Paged KV cache layout, per layer: k_cache and v_cache of shape
[num_blocks, num_kv_heads, block_size, head_dim]; token slot s lives in block s // block_size
at offset s % block_size. Keeping a block's rows for one head contiguous lets the CPU path
gather whole (block, head) tiles with one index_select, already in the order a batched
matmul wants."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# decodes sorted by context length are split into at most this many padded groups
MAX_DECODE_GROUPS = 16
MIN_DECODE_GROUP = 8
# one more group costs about as much as padding this many token slots: each group is ~16
# small ops a layer (the measurement: docs/performance.md)
GROUP_COST_SLOTS = 1024


def indexable(t: torch.Tensor) -> torch.Tensor:
    """t, or a float8 tensor's bytes: torch has no float8 index_put, and a copy of bytes is the
    same copy (the KV cache's writes, swap-in, copy-on-write)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write the step's new K and V ([T, Hkv, D]) into the cache at their slots, rounded to the
    cache's dtype where it is narrower (a bfloat16 cache under float32 activations)."""
    block_size = k_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    for cache, new in ((k_cache, key), (v_cache, value)):
        indexable(cache)[blocks, :, offsets] = indexable(new.to(cache.dtype))


@dataclass(slots=True)
class AttentionGroup:
    """Requests padded to one query length Q and one context of `num_blocks` blocks."""
    q_rows: torch.Tensor  # [b * Q] rows of the flat query tensor (padding repeats a valid row)
    tiles: torch.Tensor  # [Hkv * b * num_blocks] rows of the cache viewed as [N * Hkv, bs, D]
    allowed: torch.Tensor  # [1, b, Q * G, L] True where a query row may attend
    blocked: torch.Tensor  # its negation
    out_rows: torch.Tensor  # [n] flat token rows that this group produces
    out_select: torch.Tensor | None  # [n] their positions in the padded [b * Q] output
    num_seqs: int
    q_len: int
    num_blocks: int


def _plan_group(sel: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                seq_lens: torch.Tensor, block_size: int, num_kv_heads: int,
                group_size: int, sliding_window: int = 0, key_limit: torch.Tensor | None = None) -> AttentionGroup:
    q_start = query_start_loc[:-1][sel].long()
    q_lens = query_start_loc[1:][sel].long() - q_start
    ctx = seq_lens[sel].long()
    b, dev = sel.numel(), block_tables.device
    max_q, max_l = int(q_lens.max()), int(ctx.max())
    num_blocks = -(-max_l // block_size)
    first = None  # [b, 1] each request's first block that its window can see
    if sliding_window:
        first = ((ctx - q_lens - sliding_window + 1).clamp(min=0) // block_size)[:, None]
        num_blocks = int((-(-ctx // block_size) - first[:, 0]).max())
        cols = (first + torch.arange(num_blocks, device=dev)[None, :]).clamp(max=block_tables.shape[1] - 1)
        bt = block_tables[sel][torch.arange(b, device=dev)[:, None], cols].long()
    else:
        bt = block_tables[sel, :num_blocks].long()
    heads = torch.arange(num_kv_heads, device=dev)[:, None, None]
    tiles = (bt[None] * num_kv_heads + heads).reshape(-1)  # [Hkv, b, nb] order
    qi = torch.minimum(torch.arange(max_q, device=dev)[None, :], (q_lens - 1)[:, None])  # [b, Q]
    q_rows = (q_start[:, None] + qi).reshape(-1)
    # query i of a request sits at position ctx - q_len + i and sees every position up to it
    q_pos = (ctx - q_lens)[:, None] + qi
    # the last position a query sees: its own, or its image's last where image tokens see each other
    limit = q_pos if key_limit is None else key_limit[q_rows].view(b, max_q)
    pos = torch.arange(num_blocks * block_size, device=dev)
    if first is None:
        allowed = pos[None, None, :] <= limit[:, :, None]  # [b, Q, L]
    else:  # gathered slot j of request r holds position first[r] * block_size + j
        seq_pos = (first * block_size + pos[None, :])[:, None, :]
        allowed = (seq_pos <= limit[:, :, None]) & (seq_pos > q_pos[:, :, None] - sliding_window)
    if group_size > 1:
        allowed = allowed[:, :, None, :].expand(b, max_q, group_size, pos.numel())
    allowed = allowed.reshape(1, b, max_q * group_size, pos.numel())
    if max_q == 1:
        out_rows, out_select = q_rows, None
    else:
        valid = (torch.arange(max_q, device=dev)[None, :] < q_lens[:, None]).reshape(-1)
        out_rows, out_select = q_rows[valid], valid.nonzero().squeeze(1)
    return AttentionGroup(q_rows, tiles, allowed, ~allowed, out_rows, out_select, b, max_q, num_blocks)


def decode_group_sizes(ctx_lens: list[int], block_size: int) -> list[int]:
    """Sizes of the padded groups that ascending decode context lengths are cut into: equal
    counts (so that the matmul shapes recur from step to step and oneDNN reuses them), in
    as many groups (1, 2, 4, ... up to MAX_DECODE_GROUPS, at least MIN_DECODE_GROUP requests
    each) as minimise the padded slots plus GROUP_COST_SLOTS per group."""
    padded = [-(-n // block_size) * block_size for n in ctx_lens]
    best, best_cost, n = [len(padded)], None, 1
    while n <= min(MAX_DECODE_GROUPS, max(1, len(padded) // MIN_DECODE_GROUP)):
        q, r = divmod(len(padded), n)
        sizes = [q + (i < r) for i in range(n)]
        ends = itertools.accumulate(sizes)
        cost = n * GROUP_COST_SLOTS + sum(size * padded[end - 1] for size, end in zip(sizes, ends))
        if best_cost is None or cost < best_cost:
            best, best_cost = sizes, cost
        n *= 2
    return best


def plan_paged_attention(block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                         seq_lens: torch.Tensor, block_size: int, num_heads: int,
                         num_kv_heads: int, sliding_window: int = 0,
                         key_limit: torch.Tensor | None = None) -> list[AttentionGroup]:
    """Index tensors for one step, built once and shared by every layer. Decodes (one query
    token) are sorted by context length and padded in a few groups; prefill chunks form their
    own group, so a decode is never padded to a chunk's length. sliding_window: each request
    gathers only the blocks from the first one its window can see (the plan is then that
    window's; layers with another window need their own). key_limit: [T] the last position each
    query token sees (AttentionMetadata.key_limit), None: its own."""
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    args = (block_tables, query_start_loc, seq_lens, block_size, num_kv_heads, num_heads // num_kv_heads,
            sliding_window, key_limit)
    groups = []
    decodes = (q_lens == 1).nonzero().squeeze(1)
    if decodes.numel():
        decodes = decodes[seq_lens[decodes].argsort()]
        sizes = decode_group_sizes(seq_lens[decodes].tolist(), block_size)
        groups += [_plan_group(part, *args) for part in decodes.split(sizes)]
    prefills = (q_lens > 1).nonzero().squeeze(1)
    if prefills.numel():
        groups.append(_plan_group(prefills, *args))
    return groups


class Workspace:
    """Reusable buffers for gathered K/V, so that no step allocates (and page-faults) them."""

    def __init__(self):
        self.k = self.v = None

    def get(self, numel: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None or self.k.numel() < numel or self.k.dtype != like.dtype:
            self.k = torch.empty(numel, dtype=like.dtype, device=like.device)
            self.v = torch.empty(numel, dtype=like.dtype, device=like.device)
        return self.k[:numel], self.v[:numel]


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float,
                    plan: list[AttentionGroup] | None = None,
                    workspace: Workspace | None = None, sliding_window: int = 0,
                    softcap: float = 0.0) -> torch.Tensor:
    """Varlen attention for a mixed step. q: [T, H, D], the step's query tokens, request by
    request (query_start_loc[b]:query_start_loc[b+1]); seq_lens[b]: the request's context
    length including this step's tokens, whose K/V are already in the cache. Queries are
    causal inside their chunk and see the whole cached context before it (or, with
    sliding_window, its last sliding_window positions; a given plan must be that window's).
    softcap: scores (after the scale) become softcap * tanh(score / softcap) (0: none)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    if plan is None:
        plan = plan_paged_attention(block_tables, query_start_loc, seq_lens, block_size,
                                    num_heads, num_kv_heads, sliding_window)
    workspace = workspace or Workspace()
    k_tiles = k_cache.view(-1, block_size, head_dim)
    v_tiles = v_cache.view(-1, block_size, head_dim)
    out = torch.empty_like(q)
    for g in plan:
        b, max_q, length = g.num_seqs, g.q_len, g.num_blocks * block_size
        # query heads sharing a KV head become extra query rows: K/V are never repeated
        qg = q.index_select(0, g.q_rows).view(b, max_q, num_kv_heads, group_size, head_dim)
        qg = qg.permute(2, 0, 1, 3, 4).reshape(num_kv_heads, b, max_q * group_size, head_dim)
        kbuf, vbuf = workspace.get(g.tiles.numel() * block_size * head_dim, k_cache)
        shape = (g.tiles.numel(), block_size, head_dim)
        kg = torch.index_select(k_tiles, 0, g.tiles, out=kbuf.view(shape))
        vg = torch.index_select(v_tiles, 0, g.tiles, out=vbuf.view(shape))
        # a cache narrower than q (bfloat16 under float32 activations) is widened, exactly
        kg = kg.view(num_kv_heads, b, length, head_dim).to(q.dtype)
        vg = vg.view(num_kv_heads, b, length, head_dim).to(q.dtype)
        if max_q == 1 or softcap:
            # decode: a handful of query rows per KV head, where SDPA's tiling is mostly
            # overhead; scores in the model dtype, softmax in float32 (as HF's eager path).
            # Soft-capped scores take this path whatever the step: SDPA has no cap
            scores = torch.matmul(qg, kg.transpose(-1, -2)).float().mul_(scale)
            if softcap:
                scores = scores.div_(softcap).tanh_().mul_(softcap)
            scores.masked_fill_(g.blocked, float("-inf"))
            og = torch.matmul(scores.softmax(-1).to(q.dtype), vg)
        else:
            og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.allowed, scale=scale)
        og = og.view(num_kv_heads, b, max_q, group_size, head_dim).permute(1, 2, 0, 3, 4)
        og = og.reshape(b * max_q, num_heads, head_dim)
        if g.out_select is None:
            out[g.out_rows] = og
        else:
            out[g.out_rows] = og[g.out_select]
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


def rope_cos_sin(positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's cos and sin ([T, 1, D/2], in the model dtype), looked up once and shared by
    every layer; cos_sin_cache is [max_pos, D] holding cos of the D/2 frequencies then their
    sin, in float32."""
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache[positions].to(dtype)
    return cs[:, None, :half], cs[:, None, half:]


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Neox-style RoPE in place on q [T, H, D] and k [T, Hkv, D]."""
    half = q.shape[-1] // 2
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


def fused_moe(x: torch.Tensor, w13, w2, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              linear=F.linear) -> torch.Tensor:
    """Mixture-of-experts feed-forward. x [T, H]; w13 [E, 2 * I, H] (gate rows then up rows, as
    nn.Linear weights), w2 [E, H, I], same dtype as x, or a list of E matrices each that
    `linear(x, w)` takes (quantized experts); topk_weights [T, K] float32, topk_ids [T, K] int32
    or int64 in [0, E). Returns [T, H] in x's dtype:
    out[t] = sum_k topk_weights[t, k] * w2[e] @ silu_and_mul(w13[e] @ x[t]), e = topk_ids[t, k],
    summed in float32."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out.to(x.dtype)
    # (token, k) pairs grouped by expert: each expert runs one matmul over all its rows
    flat = topk_ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=len(w13)).tolist()  # one sync: the split sizes
    tokens = order // top_k
    weights = topk_weights.reshape(-1)[order]
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        rows = tokens[start:start + n]
        h = silu_and_mul(linear(x.index_select(0, rows), w13[expert]))
        y = linear(h, w2[expert]).float().mul_(weights[start:start + n, None])
        out.index_add_(0, rows, y)
        start += n
    return out.to(x.dtype)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """The float32 [N, K] weight of a W4A16 layer: qweight int32 [N, K / 8] (column 8i + j in
    bits 4j..4j+3 of word i), scales float32 and zeros uint8 [N, K / G]; w = (q - z) * s."""
    z = zeros.to(torch.int32).repeat_interleave(group_size, dim=1)
    return (_nibbles(qweight) - z).float() * scales.repeat_interleave(group_size, dim=1)


def _nibbles(qweight: torch.Tensor) -> torch.Tensor:
    """int32 words [N, K / 8] -> their 4-bit codes [N, K] (column 8i + j in bits 4j..4j+3 of word i)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    return ((qweight[:, :, None] >> shifts) & 0xF).reshape(qweight.shape[0], -1)


def _dequantized_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ a dequantized float32 weight^T (+ bias [N]), in float32, returned in x's dtype."""
    return F.linear(x.float(), w, None if bias is None else bias.float()).to(x.dtype)


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ the dequantized weight^T (+ bias [N]), in float32, returned in x's dtype."""
    return _dequantized_linear(x, dequantize_int4(qweight, scales, zeros, group_size), bias)


def dequantize_groups(weight: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """The float32 [N, K] weight of a block-wise FP8 or grouped INT8 layer: weight
    float8_e4m3fn or int8 [N, K], scales float32 [N, K / G]; w = float(code) * s."""
    return weight.float() * scales.repeat_interleave(group_size, dim=1)


def group_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ the dequantized FP8 or INT8 weight^T (+ bias [N]), in float32, returned in x's
    dtype (the reference of fp8_group_linear and int8_group_linear)."""
    return _dequantized_linear(x, dequantize_groups(weight, scales, group_size), bias)


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # FP4's values
# bitsandbytes' NormalFloat4 values
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)
TABLES4 = {"fp4": E2M1, "nf4": NF4}  # the 4-bit kinds read through a table of values


def dequantize_table4(qweight: torch.Tensor, scales: torch.Tensor, group_size: int, table) -> torch.Tensor:
    """The float32 [N, K] weight of a 4-bit layer read through a table of 16 values (FP4's E2M1,
    NF4): qweight int32 [N, K / 8] of codes packed as dequantize_int4's, scales float32
    [N, K / G]; w = table[q] * s."""
    values = torch.tensor(table, dtype=torch.float32, device=qweight.device)[_nibbles(qweight).long()]
    return values * scales.repeat_interleave(group_size, dim=1)


def dequantize_fp4(qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """dequantize_table4 with FP4's e2m1 values (NVFP4, MXFP4)."""
    return dequantize_table4(qweight, scales, group_size, E2M1)


def fp4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ the dequantized weight^T (+ bias [N]), in float32, returned in x's dtype."""
    return _dequantized_linear(x, dequantize_fp4(qweight, scales, group_size), bias)


def nf4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp4_linear with NF4's values (bitsandbytes' 4-bit)."""
    return _dequantized_linear(x, dequantize_table4(qweight, scales, group_size, NF4), bias)


QUANT_EPS = 1e-10  # the smallest row maximum a per-token scale is taken from (all-zero rows)
QUANT_MAX = {"fp8": 448.0, "int8": 127.0}  # float8_e4m3fn's largest finite value; int8's, symmetric
STATIC_MIN = {"fp8": -448.0, "int8": -128.0}  # static scales take int8's whole range, as vLLM clamps


def quantize_per_token(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row quantization of x [M, K] for kind "fp8" (float8_e4m3fn) or "int8":
    x_scale [M, 1] float32 = max(amax |x[m]|, QUANT_EPS) / QUANT_MAX[kind], xq = x / x_scale
    clamped to +-QUANT_MAX and rounded to nearest even. Returns (xq, x_scale)."""
    qmax = QUANT_MAX[kind]
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=QUANT_EPS)
    # a tensor divisor: CUDA divides by a Python number through its reciprocal, a last bit off
    # the correctly rounded quotient that the Triton kernel (and the CPU) computes
    x_scale = amax / torch.full_like(amax, qmax)
    y = (xf / x_scale).clamp(-qmax, qmax)
    return (y.to(torch.float8_e4m3fn) if kind == "fp8" else y.round().to(torch.int8)), x_scale


def quantize_static(x: torch.Tensor, kind: str, input_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] quantized with one fixed scale (a checkpoint's static `input_scale`): xq = x /
    input_scale clamped to [STATIC_MIN[kind], QUANT_MAX[kind]] and rounded to nearest even;
    x_scale [M, 1] float32 holds input_scale. Returns (xq, x_scale), as quantize_per_token."""
    x_scale = torch.full((x.shape[0], 1), input_scale, dtype=torch.float32, device=x.device)
    y = (x.float() / x_scale).clamp(STATIC_MIN[kind], QUANT_MAX[kind])
    return (y.to(torch.float8_e4m3fn) if kind == "fp8" else y.round().to(torch.int8)), x_scale


def scaled_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, kind: str,
                  bias: torch.Tensor | None = None, input_scale: float | None = None) -> torch.Tensor:
    """W8A8: x [M, K] quantized per token (or with the static input_scale), times wq [N, K]
    (float8_e4m3fn for "fp8", int8 for "int8") with w_scale [N] float32 per output channel:
    (xq @ wq^T) * x_scale * w_scale (+ bias), in float32 (exact for int8 while partial sums
    stay under 2^24), in x's dtype."""
    xq, x_scale = quantize_per_token(x, kind) if input_scale is None else quantize_static(x, kind, input_scale)
    y = (xq.float() @ wq.float().t()) * x_scale * w_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def lora_delta(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_bt: torch.Tensor,
               slices: tuple[tuple[int, int, int], ...], rows: torch.Tensor,
               groups: list[tuple[int, int, int]]) -> None:
    """out[t, off:off+size] += (lora_a[slot] @ x[t])[col:col+R] @ lora_bt[slot, :, off:off+size] for
    every slice (col, off, size) and adapter token t = rows[i] of each group (slot, start, count):
    a gather, a shrink and an expand per slice for each group, one scatter-add (Punica's
    shrink/expand; lora_bt is B transposed, [S, R, N])."""
    rank = lora_bt.shape[1]
    xs = x.index_select(0, rows)
    delta = out.new_empty(rows.shape[0], out.shape[1])  # the slices cover every column
    for slot, start, count in groups:
        shrunk = xs[start:start + count] @ lora_a[slot].t()
        for col, off, size in slices:
            delta[start:start + count, off:off + size] = shrunk[:, col:col + rank] @ lora_bt[slot, :, off:off + size]
    out.index_add_(0, rows, delta)
