"""Grammar masks on the GPU: logits whose bit is 0 in the packed int32 mask become -inf."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# vocab and both row strides are the model's whatever the batch: fixed, so left specialized
@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, mask_ptr, vocab, logits_stride, mask_stride,
                                BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab
    words = tl.load(mask_ptr + row.to(tl.int64) * mask_stride + offs // 32, mask=inside, other=0)
    allowed = ((words >> (offs % 32)) & 1) != 0
    tl.store(logits_ptr + row.to(tl.int64) * logits_stride + offs, float("-inf"), mask=inside & ~allowed)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, block: int = 1024) -> None:
    """In place on logits [B, V] (rows contiguous); bitmask [B, ceil(V / 32)] int32, bit j of
    word w standing for token 32 * w + j. Same contract as torch_ops.apply_token_bitmask."""
    rows, vocab = logits.shape
    assert bitmask.dtype == torch.int32 and bitmask.shape[0] == rows and bitmask.shape[1] * 32 >= vocab
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1
    _apply_token_bitmask_kernel[(rows, triton.cdiv(vocab, block))](
        logits, bitmask, vocab, logits.stride(0), bitmask.stride(0), BLOCK=block)
