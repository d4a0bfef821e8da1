"""rms_norm (with and without the residual), silu_and_mul and apply_token_bitmask against
the plain references (tests/kernels/reference.py), in float32 and bfloat16, on ragged sizes."""

from __future__ import annotations

import pytest
import torch

from pageserve.triton_kernels.apply_token_bitmask import apply_token_bitmask
from pageserve.triton_kernels.rms_norm import rms_norm
from pageserve.triton_kernels.silu_and_mul import silu_and_mul
from tests.kernels import reference

pytestmark = pytest.mark.unit

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", DTYPES)
# rows a program (rms_norm.rows_per_program): 16 up to hidden 256, 2 at 2,000, 1 past 4,096
@pytest.mark.parametrize("tokens, hidden", [(1, 64), (7, 96), (37, 128), (5, 200), (5, 2000), (3, 4100)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(device, dtype, tokens, hidden, with_residual):
    g = torch.Generator().manual_seed(tokens * hidden)
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device, dtype)
    res = torch.randn(tokens, hidden, generator=g).to(device, dtype) if with_residual else None
    out, new_res = rms_norm(x, w, 1e-6, res)
    want, want_res = reference.rms_norm(x, w, 1e-6, res)
    torch.testing.assert_close(out, want, **TOL[dtype])
    torch.testing.assert_close(new_res, want_res, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, inter, block", [(1, 64, 64), (9, 100, 64), (37, 256, 64), (7, 1536, 1024)])
def test_silu_and_mul(device, dtype, tokens, inter, block):
    """Blocks of 64 columns (16 rows a program) and of 1,024 (4 rows, a ragged second block)."""
    x = torch.randn(tokens, 2 * inter, generator=torch.Generator().manual_seed(inter)).to(device, dtype)
    torch.testing.assert_close(silu_and_mul(x, block=block), reference.silu_and_mul(x), **TOL[dtype])


@pytest.mark.parametrize("rows, vocab", [(1, 31), (3, 1000), (5, 4099)])
def test_apply_token_bitmask(device, rows, vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=g).to(device)
    words = -(-vocab // 32) + 2  # wider than needed, as a padded vocabulary gives
    mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    mask[0] = 0
    mask[0, 0] = 1 << 3  # row 0: token 3 only
    want = logits.clone()
    reference.apply_token_bitmask(want, mask.to(device))
    apply_token_bitmask(logits, mask.to(device), block=256)
    assert torch.equal(logits, want)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [3]
