"""The step's new K and V written into the paged cache through the slot mapping."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# one token's key/value views report other token strides; head/cache strides are fixed: specialized.
# A program writes one token's every KV head.
@triton.jit(do_not_specialize=["stride_kt", "stride_vt"])
def _reshape_and_cache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                              stride_kt, stride_kh, stride_vt, stride_vh,
                              stride_cb, stride_ch, stride_ct,
                              HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                              HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # a padded token owns no slot
        return
    head = tl.arange(0, HEADS_PAD)[:, None].to(tl.int64)
    d = tl.arange(0, HEAD_PAD)[None, :]
    inside = (head < HEADS) & (d < HEAD_DIM)
    dst = (slot // BLOCK_SIZE) * stride_cb + head * stride_ch + (slot % BLOCK_SIZE) * stride_ct + d
    k = tl.load(key_ptr + token * stride_kt + head * stride_kh + d, mask=inside)
    v = tl.load(value_ptr + token * stride_vt + head * stride_vh + d, mask=inside)
    tl.store(k_cache_ptr + dst, k, mask=inside)
    tl.store(v_cache_ptr + dst, v, mask=inside)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Same contract as torch_ops.reshape_and_cache: key and value [T, Hkv, D] (views into
    the fused QKV output are fine), caches [num_blocks, Hkv, block_size, D], slot_mapping [T];
    a negative slot is skipped."""
    tokens, heads, head_dim = key.shape
    assert value.shape == key.shape and k_cache.shape == v_cache.shape
    assert k_cache.shape[1] == heads and k_cache.shape[3] == head_dim
    assert key.dtype == value.dtype == k_cache.dtype == v_cache.dtype
    assert key.stride(2) == 1 and value.stride(2) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.shape == (tokens,)
    assert slot_mapping.dtype in (torch.int32, torch.int64) and slot_mapping.stride(0) == 1
    if tokens == 0:
        return
    _reshape_and_cache_kernel[(tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), HEADS=heads, HEADS_PAD=triton.next_power_of_2(heads),
        BLOCK_SIZE=k_cache.shape[2], HEAD_DIM=head_dim, HEAD_PAD=triton.next_power_of_2(head_dim))
