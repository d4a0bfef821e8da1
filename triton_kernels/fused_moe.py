"""Mixture-of-experts feed-forward: the (token, k) pairs grouped by expert, then two grouped
matmuls (the design of vLLM's fused_moe).

`moe_align` sorts the T * K pairs by expert and pads each expert's segment to a multiple of
BLOCK_M, so that every block of BLOCK_M sorted rows belongs to one expert. One program of
the grouped matmul computes a BLOCK_M x BLOCK_N tile of one block: it gathers its rows of
the input (x rows by token = pair // K on the first pass, intermediate rows by pair on the
second) and multiplies them by that expert's weight. The first pass (w13) computes the gate
and up tiles of the same columns together and writes silu(gate) * up, [T * K, I]; the
second (w2) scales its rows by the routing weight and writes [T * K, H] in float32, summed
over K afterwards. Nothing is read back to the host: the launch covers the most blocks the
padding can give, and blocks past the padded count return at once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pageserve.triton_kernels.paged_attention import _dot  # float32 accumulation, IEEE precision


# the pair count and the launch's block bound change every step, as does the input's token
# stride (a single token's view may report another); the weights' and outputs' strides are
# the model's and stay specialized
@triton.jit(do_not_specialize=["num_pairs", "stride_at"])
def _grouped_matmul_kernel(
        a_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, topk_weights_ptr,
        num_pairs, n_dim, k_dim, gate_offset, stride_at, stride_we, stride_wn, stride_ot,
        ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr, UPCAST: tl.constexpr):
    """out[pair, n] = a[pair // ROW_DIV] . w[expert, n] for the pairs of block program_id(0)
    and the columns of tile program_id(1). GATED: also the columns n + gate_offset (the up
    rows), and out = silu(gate) * up. MUL_WEIGHT: out scaled by topk_weights[pair]."""
    block = tl.program_id(0)
    # consecutive programs take successive blocks of the same columns: one expert's weight
    # tile is read by its neighbours while it is still in L2
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    pairs = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs  # padding rows hold num_pairs
    a_rows = (pairs // ROW_DIV).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_dim
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_at + offs_k[None, :]
    w_base = w_ptr + expert * stride_we
    w_ptrs = w_base + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if GATED:
        up_ptrs = w_ptrs + gate_offset * stride_wn
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, k_dim, BLOCK_K):
        if EVEN_K:
            a_mask = row_ok[:, None]
            w_mask = n_ok[None, :]
        else:
            a_mask = row_ok[:, None] & (offs_k[None, :] < k_dim - k)
            w_mask = n_ok[None, :] & (offs_k[:, None] < k_dim - k)
        a = tl.load(a_ptrs, mask=a_mask, other=0.0)
        acc += _dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0), UPCAST)
        if GATED:
            acc_up += _dot(a, tl.load(up_ptrs, mask=w_mask, other=0.0), UPCAST)
            up_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def max_padded(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most rows moe_align can produce: each expert that gets a pair pads by < block_m."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


def moe_align(topk_ids: torch.Tensor, num_experts: int,
              block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The T * K (token, k) pairs (pair = token * K + k) sorted by expert, each expert's
    segment padded to a multiple of block_m with the id T * K. Returns sorted_ids
    [max_padded] int32 (past the padded count: T * K too), block_expert [max_padded // block_m]
    int32 (the expert of each block; past the padded count: meaningless) and num_padded [1]
    int32, the padded count. All on the device, with no sync: the sizes come from the host's
    T, K and E."""
    flat = topk_ids.reshape(-1).long()
    num_pairs, dev = flat.numel(), flat.device
    size = max_padded(num_pairs, num_experts, block_m)
    # scatter_add_ rather than bincount, which reads its maximum back to the host on CUDA
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = flat.argsort(stable=True)
    expert = flat[order]
    # a pair's rank inside its expert: its sorted position less the pairs of earlier experts
    rank = torch.arange(num_pairs, device=dev) - (counts.cumsum(0) - counts)[expert]
    dest = (padded_end - padded)[expert] + rank
    sorted_ids = torch.full((size,), num_pairs, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, size - block_m + 1, block_m, device=dev)
    block_expert = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    return sorted_ids, block_expert, padded_end[-1:].to(torch.int32)


def default_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> dict:
    """Tiles by the rows an expert gets on average: few rows (decode) are bound by reading the
    weights, and narrow column tiles spread that over more programs."""
    rows = num_pairs / num_experts
    if rows <= 16:
        config = dict(block_m=16, block_n=32, block_k=128, num_warps=4, num_stages=4)
    elif rows <= 64:
        config = dict(block_m=32, block_n=128, block_k=64, num_warps=4, num_stages=4)
    else:
        config = dict(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)
    if dtype == torch.float32:  # tiles of twice the bytes
        config["block_k"] //= 2
    return config


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, block_m: int | None = None, block_n: int | None = None,
              block_k: int | None = None, num_warps: int | None = None,
              num_stages: int | None = None) -> torch.Tensor:
    """Same contract as torch_ops.fused_moe: x [T, H] (rows with unit column stride: a
    column slice is fine), w13 [E, 2 * I, H], w2 [E, H, I] (rows contiguous), topk_weights
    [T, K] float32, topk_ids [T, K] int32 or int64; returns [T, H] in x's dtype. block_m,
    block_n, block_k (powers of two, at least 16), num_warps and num_stages tune the GPU
    launch; unset ones come from default_config."""
    num_tokens, hidden = x.shape
    num_experts, double, inter = w13.shape[0], w13.shape[1], w2.shape[2]
    top_k = topk_ids.shape[1] if topk_ids.dim() == 2 else 0
    assert w13.shape == (num_experts, 2 * inter, hidden) and w2.shape == (num_experts, hidden, inter)
    assert double == 2 * inter
    assert x.dtype == w13.dtype == w2.dtype and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    assert topk_ids.shape == topk_weights.shape == (num_tokens, top_k) and top_k >= 1
    assert topk_weights.dtype == torch.float32 and topk_ids.dtype in (torch.int32, torch.int64)
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
    assert len({t.device for t in (x, w13, w2, topk_weights, topk_ids)}) == 1
    num_pairs = num_tokens * top_k
    assert num_pairs < 2 ** 31
    config = default_config(num_pairs, num_experts, x.dtype)
    config.update({k: v for k, v in dict(block_m=block_m, block_n=block_n, block_k=block_k,
                                         num_warps=num_warps, num_stages=num_stages).items()
                   if v is not None})
    for key in ("block_m", "block_n", "block_k"):
        assert config[key] >= 16 and config[key] & (config[key] - 1) == 0, f"{key}: a power of two >= 16"
    if num_tokens == 0:
        return torch.empty((0, hidden), dtype=x.dtype, device=x.device)
    bm, bn, bk = config["block_m"], config["block_n"], config["block_k"]
    sorted_ids, block_expert, num_padded = moe_align(topk_ids, num_experts, bm)
    weights = topk_weights.reshape(-1)
    launch = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                  UPCAST=x.dtype != torch.float32 and triton.knobs.runtime.interpret,
                  num_warps=config["num_warps"], num_stages=config["num_stages"])
    blocks = block_expert.shape[0]
    # the intermediate in the model dtype, as the torch path's silu_and_mul leaves it
    inter_out = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    _grouped_matmul_kernel[(blocks, triton.cdiv(inter, bn))](
        x, w13, inter_out, sorted_ids, block_expert, num_padded, weights,
        num_pairs, inter, hidden, inter, x.stride(0), w13.stride(0), w13.stride(1), inter_out.stride(0),
        ROW_DIV=top_k, GATED=True, MUL_WEIGHT=False, EVEN_K=hidden % bk == 0, **launch)
    # float32 rows summed over K by torch rather than atomic adds into [T, H]: the same sum
    # in the same order every run, and no zero-filled buffer or second cast to the model dtype
    pair_out = torch.empty((num_pairs, hidden), dtype=torch.float32, device=x.device)
    _grouped_matmul_kernel[(blocks, triton.cdiv(hidden, bn))](
        inter_out, w2, pair_out, sorted_ids, block_expert, num_padded, weights,
        num_pairs, hidden, inter, 0, inter_out.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0),
        ROW_DIV=1, GATED=False, MUL_WEIGHT=True, EVEN_K=inter % bk == 0, **launch)
    return pair_out.view(num_tokens, top_k, hidden).sum(1).to(x.dtype)
