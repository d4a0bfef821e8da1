"""RMSNorm fused with the residual add: one read of x (and the residual), one write of each
output, the sum of squares in float32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def rows_per_program(block: int) -> int:
    """Rows a program of a row-wise kernel takes: one where a row fills a block of 4096
    values, more (up to 16) where rows are short, so that a small model's step is not
    thousands of programs of a few dozen values (the interpreter runs each one in Python)."""
    return max(1, min(16, 4096 // block))


# `hidden` is the model's: one value for the server's life, so it stays specialized; `rows`,
# the step's tokens, is not
@triton.jit(do_not_specialize=["rows"])
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, rows, hidden, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    offs = tl.arange(0, BLOCK)[None, :]
    inside = (row < rows) & (offs < hidden)
    at = row * hidden + offs
    # float32 arithmetic, one rounding at each store (as torch_ops's bf16 ops round once)
    x = tl.load(x_ptr + at, mask=inside, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + at, mask=inside, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    x = x.to(dtype)
    tl.store(res_out_ptr + at, x, mask=inside)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / hidden + eps)
    w = tl.load(w_ptr + offs, mask=offs < hidden, other=0.0).to(tl.float32)
    tl.store(out_ptr + at, (w * (h * rstd[:, None]).to(dtype).to(tl.float32)).to(dtype), mask=inside)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as torch_ops.rms_norm: (normed, x + residual) for x [T, hidden]."""
    x = x.contiguous()
    tokens, hidden = x.shape
    out = torch.empty_like(x)
    new_residual = torch.empty_like(x)
    res = residual.contiguous() if residual is not None else x
    block = triton.next_power_of_2(hidden)
    rows = rows_per_program(block)
    _rms_norm_kernel[(triton.cdiv(tokens, rows),)](x, res, weight, out, new_residual, tokens, hidden, eps,
                                                    HAS_RESIDUAL=residual is not None, BLOCK=block, ROWS=rows)
    return out, new_residual
