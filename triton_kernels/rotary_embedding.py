"""Neox-style rotary embedding applied in place to q and k, straight in the fused QKV output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# one token's q/k/cos/sin views report other token strides; head counts and strides are fixed.
# A program rotates one token's every head, q's then k's, as one block.
@triton.jit(do_not_specialize=["stride_qt", "stride_kt", "stride_ct", "stride_st"])
def _rotary_embedding_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr,
                             stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
                             Q_HEADS: tl.constexpr, HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                             HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.arange(0, HEADS_PAD)[:, None].to(tl.int64)
    d = tl.arange(0, HALF_PAD)[None, :]
    inside = (head < HEADS) & (d < HALF)
    base = tl.where(head < Q_HEADS, q_ptr + token * stride_qt + head * stride_qh,
                    k_ptr + token * stride_kt + (head - Q_HEADS) * stride_kh)
    dtype = q_ptr.dtype.element_ty
    # float32 arithmetic from the model-dtype cos/sin, one rounding at the store
    cos = tl.load(cos_ptr + token * stride_ct + d, mask=d < HALF).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_st + d, mask=d < HALF).to(tl.float32)
    x1 = tl.load(base + d, mask=inside).to(tl.float32)
    x2 = tl.load(base + HALF + d, mask=inside).to(tl.float32)
    tl.store(base + d, (x1 * cos - x2 * sin).to(dtype), mask=inside)
    tl.store(base + HALF + d, (x2 * cos + x1 * sin).to(dtype), mask=inside)


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Same contract as torch_ops.rotary_embedding: q [T, H, D] and k [T, Hkv, D] rotated in
    place (head rows contiguous, token stride free); cos and sin [T, 1, D/2] or [T, D/2]."""
    tokens, num_q_heads, head_dim = q.shape
    half = head_dim // 2
    cos, sin = cos.reshape(tokens, half), sin.reshape(tokens, half)
    assert k.shape[0] == tokens and k.shape[2] == head_dim and q.dtype == k.dtype
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.stride(1) == 1 and sin.stride(1) == 1
    if tokens == 0:
        return
    heads = num_q_heads + k.shape[1]
    _rotary_embedding_kernel[(tokens,)](
        q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        Q_HEADS=num_q_heads, HEADS=heads, HEADS_PAD=triton.next_power_of_2(heads), HALF=half,
        HALF_PAD=triton.next_power_of_2(half))
