"""RMSNorm fused with the residual add: one read of x (and the residual), one write of each
output, the sum of squares in float32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# `hidden` is the model's: one value for the server's life, so it stays specialized
@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, hidden, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    inside = offs < hidden
    # float32 arithmetic, one rounding at each store (as torch_ops's bf16 ops round once)
    x = tl.load(x_ptr + row * hidden + offs, mask=inside, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + row * hidden + offs, mask=inside, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    x = x.to(dtype)
    tl.store(res_out_ptr + row * hidden + offs, x, mask=inside)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / hidden + eps)
    w = tl.load(w_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + offs, (w * (h * rstd).to(dtype).to(tl.float32)).to(dtype), mask=inside)

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as torch_ops.rms_norm: (normed, x + residual) for x [T, hidden]."""
    x = x.contiguous()
    tokens, hidden = x.shape
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x)
    res = residual.contiguous() if residual is not None else x
    _rms_norm_kernel[(tokens,)](x, res, weight, out, new_residual, hidden, eps,
                                HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden))
    return out, new_residual
