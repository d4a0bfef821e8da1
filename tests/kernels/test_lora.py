"""The multi-LoRA kernels (triton_kernels/lora.py) against a per-token float64 reference: ragged
groups (counts 0, 1, 5 and 17 over 4 slots, tokens of no adapter, groups listed out of order,
unused groups of slot -1, one of them over the base tokens), 1, 3 and 37 tokens, ranks 8 and 16,
K and N not multiples of their tiles, B in the slots' transposed layout, three slices of different sizes (fused q/k/v) and one slice
inside a wider output; default launches and small tiles (several K splits, column tiles, token
tiles); and the launchers' refusals. Rows of tokens without an adapter stay bit for bit.

Tolerances. y (float32 from either dtype: exact products summed in float32): 1e-5 of y's scale.
float32 out: 1e-5. bfloat16 out: two bfloat16 ulps (rtol 2^-6), since out + delta is rounded
once to bfloat16 (and Triton's interpreter truncates where torch rounds to nearest)."""

from __future__ import annotations

import pytest
import torch

from pageserve.loadtest.gpu_quant_check import graphed
from pageserve.triton_kernels.lora import expand_config, lora_expand, lora_shrink, shrink_config

pytestmark = pytest.mark.unit

BF16_ULPS = 2.0 ** -6  # two bfloat16 ulps, relative
K = 72  # under one K tile by default, 5 tiles of 16 with the small launch
NUM_SLOTS = 4
# (T, tokens per slot 0..3): the rest of the T tokens run on the base model
GROUPINGS = [(1, [0, 0, 1, 0]), (1, [0, 0, 0, 0]), (3, [2, 0, 1, 0]), (37, [0, 1, 5, 17])]
SMALL = dict(shrink=dict(block_m=16, block_n=16, block_k=16, split_k=3), expand=dict(block_m=16, block_n=16))


def qkv_slices(rank: int) -> tuple[tuple[tuple[int, int, int], ...], int]:
    """Fused q/k/v: 64, 16 and 16 output columns, each with its own R columns of y; (slices, N)."""
    return ((0, 0, 64), (rank, 64, 16), (2 * rank, 80, 16)), 96


def one_slice(rank: int) -> tuple[tuple[tuple[int, int, int], ...], int]:
    """One slice of 29 columns inside an output of 40: the columns around it must not change."""
    return ((0, 5, 29),), 40


def make_groups(num_tokens: int, counts: list[int], device, seed: int):
    """(slot of each token or None, sorted_tokens, group_slots, group_starts, group_counts). The
    groups are laid out in sorted_tokens by slot, then the base tokens; listed shuffled, with two
    unused groups of slot -1: an empty one and one over the base tokens."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_tokens, generator=g).tolist()
    token_slot: list[int | None] = [None] * num_tokens
    groups, pos = [], 0
    for slot, count in enumerate(counts):
        for token in perm[pos:pos + count]:
            token_slot[token] = slot
        groups.append((slot, pos, count))
        pos += count
    groups += [(-1, pos, num_tokens - pos), (-1, 0, 0)]
    groups = [groups[i] for i in torch.randperm(len(groups), generator=g).tolist()]
    table = torch.tensor(groups, dtype=torch.int32).t().contiguous()
    sorted_tokens = torch.tensor(perm, dtype=torch.int32)
    return token_slot, sorted_tokens.to(device), *(row.contiguous().to(device) for row in table)


def reference_shrink(x, lora_a, token_slot) -> torch.Tensor:
    y = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float64)
    for t, slot in enumerate(token_slot):
        if slot is not None:
            y[t] = lora_a[slot].double().cpu() @ x[t].double().cpu()
    return y


def reference_expand(out, y, lora_b, slices, token_slot) -> torch.Tensor:
    """out + each slice's y @ B^T in float64 (not rounded: the test's tolerance covers that)."""
    want = out.double().cpu()
    rank = lora_b.shape[2]
    for t, slot in enumerate(token_slot):
        if slot is not None:
            for col, off, size in slices:
                b = lora_b[slot, off:off + size].double().cpu()
                want[t, off:off + size] += b @ y[t, col:col + rank].double().cpu()
    return want


def assert_near(out, want, rtol, atol=None):
    """|out - want| <= rtol * |want| + atol * max |want| elementwise (atol: rtol unless given)."""
    out, want = out.double().cpu(), want.double().cpu()
    scale = max(want.abs().max().item(), 1e-30)
    torch.testing.assert_close(out, want, rtol=rtol, atol=(rtol if atol is None else atol) * scale)


def lora_case(num_tokens, counts, rank, layout, dtype, device, seed=0):
    slices, n = layout(rank)
    g = torch.Generator().manual_seed(seed + num_tokens + rank)
    x = torch.randn(num_tokens, K, generator=g).to(device, dtype)
    lora_a = (torch.randn(NUM_SLOTS, len(slices) * rank, K, generator=g) * K ** -0.5).to(device, dtype)
    # B as the slots keep it, [S, R, N], seen as [S, N, R]
    lora_b = (torch.randn(NUM_SLOTS, rank, n, generator=g) * rank ** -0.5).to(device, dtype).transpose(1, 2)
    out = torch.randn(num_tokens, n, generator=g).to(device, dtype)
    groups = make_groups(num_tokens, counts, device, seed + num_tokens)
    return x, lora_a, lora_b, slices, out, groups


@pytest.mark.parametrize("launch", ["default", "small"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", [qkv_slices, one_slice], ids=["qkv", "one"])
@pytest.mark.parametrize("rank", [8, 16])
@pytest.mark.parametrize("num_tokens, counts", GROUPINGS)
def test_lora(device, num_tokens, counts, rank, layout, dtype, launch):
    x, lora_a, lora_b, slices, out, (token_slot, *groups) = lora_case(num_tokens, counts, rank, layout, dtype, device)
    tune = SMALL if launch == "small" else dict(shrink={}, expand={})
    base = [t for t, slot in enumerate(token_slot) if slot is None]

    y = lora_shrink(x, lora_a, *groups, **tune["shrink"])
    want_y = reference_shrink(x, lora_a, token_slot)
    assert y.dtype == torch.float32 and y.shape == want_y.shape
    assert_near(y, want_y, 1e-5)
    assert not y[base].any()

    # expand on the reference's y: its error is its own
    y_in = want_y.float().to(device)
    updated = out.clone()
    lora_expand(updated, y_in, lora_b, slices, *groups, **tune["expand"])
    want = reference_expand(out, y_in, lora_b, slices, token_slot)
    assert_near(updated, want, 1e-5 if dtype == torch.float32 else BF16_ULPS, 1e-5)
    assert torch.equal(updated[base], out[base])
    covered = torch.zeros(out.shape[1], dtype=torch.bool)
    for _, off, size in slices:
        covered[off:off + size] = True
    assert torch.equal(updated[:, ~covered.to(device)], out[:, ~covered.to(device)])
    if len(base) < num_tokens:
        assert not torch.equal(updated, out)  # the adapter tokens did change


def test_lora_wide_rows(device):
    """x and out as column slices of wider rows (row strides 100 and 120), y of stride L + 3."""
    x, lora_a, lora_b, slices, out, (token_slot, *groups) = lora_case(37, [0, 1, 5, 17], 16, qkv_slices,
                                                                       torch.float32, device)
    wide_x = torch.zeros(37, 100, device=device)
    wide_x[:, 10:10 + K] = x
    y = lora_shrink(wide_x[:, 10:10 + K], lora_a, *groups)
    assert_near(y, reference_shrink(x, lora_a, token_slot), 1e-5)
    wide_out = torch.zeros(37, 120, device=device)
    wide_out[:, 7:7 + out.shape[1]] = out
    wide_y = torch.zeros(37, y.shape[1] + 3, device=device)
    wide_y[:, :y.shape[1]] = y
    lora_expand(wide_out[:, 7:7 + out.shape[1]], wide_y[:, :y.shape[1]], lora_b, slices, *groups)
    assert_near(wide_out[:, 7:7 + out.shape[1]], reference_expand(out, y, lora_b, slices, token_slot), 1e-5)
    assert not wide_out[:, :7].any() and not wide_out[:, 7 + out.shape[1]:].any()


def test_lora_refusals(device):
    x, lora_a, lora_b, slices, out, (_, *groups) = lora_case(3, [2, 0, 1, 0], 8, qkv_slices, torch.bfloat16, device)
    sorted_tokens, group_slots, group_starts, group_counts = groups
    shrink_bad = [
        (dict(x=x.int()), "x must be 2-D float"),
        (dict(x=x.t().contiguous().t()), "x's columns must be contiguous"),
        (dict(lora_a=lora_a.float()), "lora_a must be 3-D"),
        (dict(lora_a=lora_a[:, :, :64]), "must have K = 72"),
        (dict(lora_a=lora_a.transpose(1, 2).contiguous().transpose(1, 2)), "lora_a must be contiguous"),
        (dict(sorted_tokens=sorted_tokens.long()), r"sorted_tokens must be contiguous int32 \[3\]"),
        (dict(sorted_tokens=sorted_tokens[:2]), r"sorted_tokens must be contiguous int32 \[3\]"),
        (dict(group_counts=group_counts[:-1]), "group_counts must be contiguous int32"),
        (dict(group_starts=group_starts.long()), "group_starts must be contiguous int32"),
        (dict(block_k=24), "block_k must be a power of two"),
        (dict(split_k=0), "split_k must be a positive int"),
    ]
    base = dict(x=x, lora_a=lora_a, sorted_tokens=sorted_tokens, group_slots=group_slots,
                group_starts=group_starts, group_counts=group_counts)
    for change, message in shrink_bad:
        a = {**base, **change}
        with pytest.raises(ValueError, match=message):
            lora_shrink(**a)
    y = lora_shrink(x, lora_a, *groups)
    expand_bad = [
        (dict(out=out.int()), "out must be 2-D float"),
        (dict(out=out.t().contiguous().t()), "out's columns must be contiguous"),
        (dict(y=y.to(torch.bfloat16)), r"y must be float32 \[3, L\]"),
        (dict(y=y[:2]), r"y must be float32 \[3, L\]"),
        (dict(lora_b=lora_b.float()), "lora_b must be 3-D"),
        (dict(lora_b=lora_b[:, :90]), r"lora_b must be 3-D \[S, 96, R\]"),
        (dict(slices=()), "slices must be a non-empty tuple"),
        (dict(slices=((0, 0, 64), (8, 64))), "slices must be a non-empty tuple"),
        (dict(slices=((20, 0, 64),)), r"columns col..col \+ R = 20..28 must lie in y's 24"),
        (dict(slices=((0, 90, 16),)), "output columns 90..106 must lie in out's 96"),
        (dict(slices=((0, 0, 64), (8, 60, 16))), "must not overlap"),
        (dict(sorted_tokens=sorted_tokens[:1]), r"sorted_tokens must be contiguous int32 \[3\]"),
        (dict(group_slots=group_slots.long()), "group_slots must be contiguous int32"),
        (dict(block_n=8), "block_n must be a power of two"),
    ]
    base = dict(out=out, y=y, lora_b=lora_b, slices=slices, sorted_tokens=sorted_tokens, group_slots=group_slots,
                group_starts=group_starts, group_counts=group_counts)
    for change, message in expand_bad:
        a = {**base, **change}
        with pytest.raises(ValueError, match=message):
            lora_expand(**a)


def test_lora_nothing_to_do(device):
    """No tokens, or no groups: y is zeros and out is not touched."""
    x, lora_a, lora_b, slices, out, (_, *groups) = lora_case(3, [2, 0, 1, 0], 8, qkv_slices, torch.float32, device)
    y = lora_shrink(x[:0], lora_a, groups[0][:0], *groups[1:])
    assert y.shape == (0, 24)
    none = torch.zeros(0, dtype=torch.int32, device=device)
    y = lora_shrink(x, lora_a, groups[0], none, none, none)
    assert y.shape == (3, 24) and not y.any()
    before = out.clone()
    lora_expand(out, y, lora_b, slices, groups[0], none, none, none)
    assert torch.equal(out, before)


def test_lora_configs_follow_buckets():
    """One launch setting for every token count of a bucket (one compiled variant), K split for
    decode."""
    for low, high in ((1, 16), (17, 256), (257, 2048), (2049, 8192)):
        assert shrink_config(low, 4096, 48, torch.bfloat16) == shrink_config(high, 4096, 48, torch.bfloat16)
        assert expand_config(low, 16) == expand_config(high, 16)
    assert shrink_config(1, 4096, 48, torch.bfloat16)["split_k"] > 1
    assert shrink_config(1, 72, 48, torch.bfloat16)["split_k"] == 1  # K under one tile


def test_lora_cuda_graph(device):
    """A captured shrink + expand replays right for another grouping of the same T and G: the
    launches read nothing of the groups on the host."""
    if device != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    x, lora_a, lora_b, slices, out, (_, *groups) = lora_case(37, [0, 1, 5, 17], 16, qkv_slices,
                                                             torch.bfloat16, device)
    static = [t.clone() for t in groups]
    target = torch.empty_like(out)

    def step():
        target.copy_(out)
        lora_expand(target, lora_shrink(x, lora_a, *static), lora_b, slices, *static)

    replay = graphed(step)  # compiled outside the capture, then captured
    token_slot, *other = make_groups(37, [3, 0, 30, 1], device, seed=5)
    for dst, src in zip(static, other):
        dst.copy_(src)
    replay()
    torch.cuda.synchronize()
    y = reference_shrink(x, lora_a, token_slot).float()
    assert_near(target, reference_expand(out, y, lora_b, slices, token_slot), BF16_ULPS, 1e-5)
