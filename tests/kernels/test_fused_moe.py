"""fused_moe, the torch path (torch_ops) and the Triton kernels, against a plain loop over
tokens and their experts in float64: ragged token counts, an expert with no token, every
token on one expert, no tokens, int32 and int64 ids, a column slice as input; and moe_align's
grouping on its own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pageserve.triton_kernels import torch_ops
from pageserve.triton_kernels import fused_moe as fused_moe_module
from pageserve.triton_kernels.fused_moe import fused_moe, max_padded, moe_align
from pageserve.triton_kernels.variants import _binder

pytestmark = pytest.mark.unit

HIDDEN, INTER = 64, 96  # 96: not a power of two, so column tiles are masked
SMALL_TILES = dict(block_m=16, block_n=32, block_k=32)  # several column tiles and k steps
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def reference(x, w13, w2, topk_weights, topk_ids):
    """Token by token, expert by expert, in float64."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    x, w13, w2 = x.cpu().double(), w13.cpu().double(), w2.cpu().double()
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            h = w13[e] @ x[t]
            out[t] += float(topk_weights[t, k]) * (w2[e] @ (F.silu(h[:inter]) * h[inter:]))
    return out


def make_case(tokens, experts, top_k, dtype, device, routing="random", ids_dtype=torch.int64, seed=0):
    g = torch.Generator().manual_seed(seed * 1000 + tokens * 10 + experts + top_k)
    x = torch.randn(tokens, HIDDEN, generator=g)
    w13 = torch.randn(experts, 2 * INTER, HIDDEN, generator=g) * HIDDEN ** -0.5
    w2 = torch.randn(experts, HIDDEN, INTER, generator=g) * INTER ** -0.5
    logits = torch.randn(tokens, experts, generator=g)
    if routing == "skip_last":  # the last expert gets no token
        logits[:, -1] = float("-inf")
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    if routing == "one_expert":  # every token sends every pick to expert 1
        ids = torch.full_like(ids, 1)
    return (x.to(device, dtype), w13.to(device, dtype), w2.to(device, dtype),
            weights.to(device), ids.to(device, ids_dtype))


def check(out, case, dtype):
    want = reference(*case)
    assert out.dtype == dtype and out.shape == case[0].shape
    torch.testing.assert_close(out.cpu().double(), want, **{k: 2 * v for k, v in TOL[dtype].items()})
    return want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, experts, top_k, routing, ids_dtype, tiles", [
    (1, 4, 1, "random", torch.int64, SMALL_TILES),
    (5, 8, 2, "skip_last", torch.int32, SMALL_TILES),
    (33, 4, 2, "one_expert", torch.int64, {}),  # default tiles: block_m 32
    (33, 8, 2, "random", torch.int32, {}),  # default tiles: block_m 16, block_k over H
])
def test_fused_moe(device, dtype, tokens, experts, top_k, routing, ids_dtype, tiles):
    case = make_case(tokens, experts, top_k, dtype, device, routing, ids_dtype)
    ours = fused_moe(*case, **tiles)
    check(ours, case, dtype)
    torch_out = torch_ops.fused_moe(*case)
    check(torch_out, case, dtype)
    torch.testing.assert_close(ours.float(), torch_out.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_more_shapes(device, dtype):
    """The torch path alone is cheap: more token counts and experts."""
    for tokens, experts, top_k in [(2, 3, 3), (17, 8, 2), (64, 16, 4)]:
        for routing in ("random", "skip_last", "one_expert"):
            case = make_case(tokens, experts, top_k, dtype, device, routing, seed=1)
            check(torch_ops.fused_moe(*case), case, dtype)


def test_column_slice_and_unmasked_k(device):
    """x a column slice of a wider tensor (token stride 3 * H), and block_k dividing H and I
    (the unmasked inner loop) with the default tiles."""
    x, w13, w2, weights, ids = make_case(7, 4, 2, torch.float32, device, seed=2)
    wide = torch.randn(7, 3 * HIDDEN, device=device)
    wide[:, HIDDEN:2 * HIDDEN] = x
    view = wide[:, HIDDEN:2 * HIDDEN]
    assert not view.is_contiguous()
    case = (view, w13, w2, weights, ids)
    check(fused_moe(*case), case, torch.float32)
    check(torch_ops.fused_moe(*case), case, torch.float32)


def test_no_tokens(device):
    x, w13, w2, weights, ids = make_case(3, 4, 2, torch.bfloat16, device)
    empty = (x[:0], w13, w2, weights[:0], ids[:0])
    for out in (fused_moe(*empty), torch_ops.fused_moe(*empty)):
        assert out.shape == (0, HIDDEN) and out.dtype == torch.bfloat16


def test_bad_inputs_are_refused(device):
    x, w13, w2, weights, ids = make_case(3, 4, 2, torch.float32, device)
    with pytest.raises(AssertionError):
        fused_moe(x.t().contiguous().t(), w13, w2, weights, ids)  # columns not unit-strided
    with pytest.raises(AssertionError):
        fused_moe(x, w13, w2, weights.double(), ids)
    with pytest.raises(AssertionError):
        fused_moe(x, w13, w2[:, :, :-1], weights, ids)


@pytest.mark.parametrize("block_m", [16, 32])
def test_moe_align(device, block_m):
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [3, 3], [1, 0]], device=device)  # expert 2: none
    num_pairs = ids.numel()
    sorted_ids, block_expert, num_padded = moe_align(ids, 5, block_m)
    assert sorted_ids.shape == (max_padded(num_pairs, 5, block_m),)
    assert block_expert.shape == (sorted_ids.shape[0] // block_m,)
    counts = torch.bincount(ids.flatten().cpu(), minlength=5).tolist()
    used = [e for e, n in enumerate(counts) if n]
    assert int(num_padded) == len(used) * block_m
    flat = ids.flatten().cpu().tolist()
    for b, e in enumerate(used):
        rows = sorted_ids[b * block_m:(b + 1) * block_m].cpu().tolist()
        assert int(block_expert[b]) == e
        real = [p for p in rows if p < num_pairs]
        assert real == sorted(p for p in range(num_pairs) if flat[p] == e)  # stable: pair order
        assert rows[len(real):] == [num_pairs] * (block_m - len(real))
    assert (sorted_ids[int(num_padded):] == num_pairs).all()


def test_token_count_compiles_no_new_variant(device):
    """At fixed tiles the step's token count changes no specialization key: one variant for
    the w13 pass and one for the w2 pass (the key Triton's CUDA launcher computes, as in
    test_specialization.py)."""
    kernel = fused_moe_module._grouped_matmul_kernel
    binder, keys = _binder(kernel), set()

    def record(*args, **kwargs):
        _, specialization, options = binder(*args, **kwargs)
        keys.add((tuple(specialization), tuple(sorted(options.items()))))

    kernel.pre_run_hooks.append(record)
    try:
        for tokens in (1, 2, 16, 17):
            fused_moe(*make_case(tokens, 4, 2, torch.float32, device), **SMALL_TILES)
    finally:
        kernel.pre_run_hooks.remove(record)
    assert len(keys) == 2
