"""The gated MLP's activation: silu(gate) * up, from one [T, 2 * I] input."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# `inter` is the model's: one value for the server's life, so it stays specialized
@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < inter
    gate = tl.load(x_ptr + row * 2 * inter + offs, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * inter + inter + offs, mask=inside, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * inter + offs, y.to(out_ptr.dtype.element_ty), mask=inside)


def silu_and_mul(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Same contract as torch_ops.silu_and_mul: x [T, 2 * I] (gate then up) -> [T, I]."""
    x = x.contiguous()
    tokens, double = x.shape
    inter = double // 2
    out = torch.empty((tokens, inter), dtype=x.dtype, device=x.device)
    _silu_and_mul_kernel[(tokens, triton.cdiv(inter, block))](x, out, inter, BLOCK=block)
    return out
