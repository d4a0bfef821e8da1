"""The gated MLP's activation: silu(gate) * up, from one [T, 2 * I] input."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pageserve.triton_kernels.rms_norm import rows_per_program


# `inter` is the model's: one value for the server's life, so it stays specialized; `rows`,
# the step's tokens, is not
@triton.jit(do_not_specialize=["rows"])
def _silu_and_mul_kernel(x_ptr, out_ptr, rows, inter, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    offs = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    inside = (row < rows) & (offs < inter)
    gate = tl.load(x_ptr + row * 2 * inter + offs, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * inter + inter + offs, mask=inside, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * inter + offs, y.to(out_ptr.dtype.element_ty), mask=inside)


def silu_and_mul(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Same contract as torch_ops.silu_and_mul: x [T, 2 * I] (gate then up) -> [T, I]; `block`:
    the most columns a program takes."""
    x = x.contiguous()
    tokens, double = x.shape
    inter = double // 2
    out = torch.empty((tokens, inter), dtype=x.dtype, device=x.device)
    block = min(block, triton.next_power_of_2(inter))
    rows = rows_per_program(block)
    _silu_and_mul_kernel[(triton.cdiv(tokens, rows), triton.cdiv(inter, block))](x, out, tokens, inter, BLOCK=block,
                                                                                ROWS=rows)
    return out
