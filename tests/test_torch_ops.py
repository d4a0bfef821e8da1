"""The tuned torch path (triton_kernels/torch_ops.py, what the CPU runs) against the plain
references in tests/kernels/reference.py."""

import random

import pytest
import torch
import torch.nn.functional as F

from pageserve.triton_kernels import torch_ops
from tests.kernels import reference

pytestmark = pytest.mark.unit


def make_batch(rng, n_req, block_size, num_blocks, kv_heads, group, head_dim, dtype):
    q_lens = [rng.choice([1, 1, rng.randrange(1, 38)]) for _ in range(n_req)]
    ctx = [ql + rng.randrange(0, 264) for ql in q_lens]
    ids = list(range(num_blocks))
    rng.shuffle(ids)  # non-contiguous block tables
    tables, used = [], 0
    for c in ctx:
        n = -(-c // block_size)
        tables.append(ids[used:used + n])
        used += n
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    k_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim).to(dtype)
    q = torch.randn(sum(q_lens), kv_heads * group, head_dim).to(dtype)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    return q, k_cache, v_cache, bt, tables, q_lens, ctx, qsl


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_matches_loop(group, block_size, dtype):
    rng = random.Random(group * 100 + block_size)
    torch.manual_seed(0)
    q, kc, vc, bt, tables, q_lens, ctx, qsl = make_batch(rng, 40, block_size, 800, 2, group, 64, dtype)
    scale = 64 ** -0.5
    got = torch_ops.paged_attention(q, kc, vc, bt, qsl, torch.tensor(ctx, dtype=torch.int32), scale)
    want = reference.paged_attention(q, kc, vc, bt, qsl, torch.tensor(ctx, dtype=torch.int32), scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [5, 16, 40, 1000])
@pytest.mark.parametrize("group, block_size", [(1, 16), (3, 16), (8, 32)])
def test_sliding_window_gathers_only_the_window(window, group, block_size):
    """Per-request windows over ragged prefill chunks and decodes (shuffled tables, GQA): the
    result matches the loop, and the blocks wholly before each window are NaN while it runs
    (a gather that took one would spread NaN into the output)."""
    rng = random.Random(window * 10 + group)
    torch.manual_seed(window)
    q, kc, vc, bt, tables, q_lens, ctx, qsl = make_batch(rng, 30, block_size, 700, 2, group, 64, torch.float32)
    seq_lens = torch.tensor(ctx, dtype=torch.int32)
    want = reference.paged_attention(q, kc, vc, bt, qsl, seq_lens, 0.125, window)
    poisoned = reference.poison_out_of_window(kc, vc, bt, qsl, seq_lens, window)
    assert (poisoned > 0) == (window < 1000)
    plan = torch_ops.plan_paged_attention(bt, qsl, seq_lens, block_size, 2 * group, 2, window)
    got = torch_ops.paged_attention(q, kc, vc, bt, qsl, seq_lens, 0.125, plan, sliding_window=window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if window < block_size:  # a decode gathers at most the two blocks its window spans
        assert all(g.num_blocks <= 2 for g in plan if g.q_len == 1)


@pytest.mark.parametrize("window", [0, 20])
def test_softcap_matches_loop(window):
    """Soft-capped scores on prefill chunks (which leave SDPA for the explicit path) and decodes."""
    rng = random.Random(5)
    torch.manual_seed(5)
    q, kc, vc, bt, tables, q_lens, ctx, qsl = make_batch(rng, 20, 16, 500, 2, 3, 64, torch.float32)
    seq_lens = torch.tensor(ctx, dtype=torch.int32)
    want = reference.paged_attention(q, kc, vc, bt, qsl, seq_lens, 0.125, window, softcap=0.5)
    got = torch_ops.paged_attention(q, kc, vc, bt, qsl, seq_lens, 0.125, sliding_window=window, softcap=0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    uncapped = torch_ops.paged_attention(q, kc, vc, bt, qsl, seq_lens, 0.125, sliding_window=window)
    assert not torch.allclose(got, uncapped, atol=1e-3)


def test_decode_groups_trade_padding_for_calls():
    assert torch_ops.decode_group_sizes([100] * 64, 16) == [64]  # equal lengths: one group
    assert torch_ops.decode_group_sizes([7], 16) == [1]
    wide = torch_ops.decode_group_sizes(list(range(16, 4096, 32)), 16)
    assert len(wide) > 1 and sum(wide) == 128 and max(wide) - min(wide) <= 1
    widest = torch_ops.decode_group_sizes(list(range(1, 64000, 64)), 16)
    assert len(widest) == torch_ops.MAX_DECODE_GROUPS and sum(widest) == 1000


def test_paged_attention_over_several_decode_groups():
    rng = random.Random(7)
    torch.manual_seed(0)
    q, kc, vc, bt, tables, q_lens, ctx, qsl = make_batch(rng, 4, 16, 3000, 2, 3, 64, torch.float32)
    # 32 decodes with contexts spread over 1..2000 tokens, after the batch's own requests
    extra = [rng.randrange(1, 2000) for _ in range(32)]
    ids = sorted(set(range(3000)) - {b for t in tables for b in t})
    rng.shuffle(ids)
    for c in extra:
        n = -(-c // 16)
        tables.append(ids[:n])
        ids = ids[n:]
    q_lens, ctx = q_lens + [1] * 32, ctx + extra
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(sum(q_lens), 6, 64)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    seq_lens = torch.tensor(ctx, dtype=torch.int32)
    plan = torch_ops.plan_paged_attention(bt, qsl, seq_lens, 16, 6, 2)
    assert sum(g.q_len == 1 for g in plan) > 1
    got = torch_ops.paged_attention(q, kc, vc, bt, qsl, seq_lens, 64 ** -0.5, plan)
    torch.testing.assert_close(got, reference.paged_attention(q, kc, vc, bt, qsl, seq_lens, 64 ** -0.5),
                               atol=1e-5, rtol=1e-5)


def test_reshape_and_cache_writes_slots():
    kc = torch.zeros(4, 2, 8, 4)  # [blocks, kv heads, block size, head dim]
    vc = torch.zeros(4, 2, 8, 4)
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    slots = torch.tensor([17, 3, 30])
    torch_ops.reshape_and_cache(k, v, kc, vc, slots)
    torch.testing.assert_close(kc[2, :, 1], k[0])
    torch.testing.assert_close(vc[0, :, 3], v[1])
    torch.testing.assert_close(kc[3, :, 6], k[2])
    assert int((kc != 0).any(-1).sum()) == 6  # three tokens, two heads each


def test_rms_norm_with_residual():
    x, res, w = torch.randn(5, 32), torch.randn(5, 32), torch.randn(32)
    normed, new_res = torch_ops.rms_norm(x, w, 1e-6, res)
    s = x + res
    torch.testing.assert_close(new_res, s)
    torch.testing.assert_close(normed, w * s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_rotary_matches_rotate_half_formula():
    d, positions = 16, torch.tensor([0, 5, 99])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(128).float()[:, None] * inv
    cache = torch.cat([freqs.cos(), freqs.sin()], -1)
    q, k = torch.randn(3, 4, d), torch.randn(3, 2, d)
    cos = torch.cat([freqs.cos(), freqs.cos()], -1)[positions][:, None]
    sin = torch.cat([freqs.sin(), freqs.sin()], -1)[positions][:, None]

    def rotate_half(x):
        return torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)

    want_q, want_k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    torch_ops.rotary_embedding(q, k, *torch_ops.rope_cos_sin(positions, cache, q.dtype))
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)


def test_silu_and_mul():
    x = torch.randn(3, 10)
    torch.testing.assert_close(torch_ops.silu_and_mul(x), F.silu(x[:, :5]) * x[:, 5:])


def test_apply_token_bitmask():
    logits = torch.zeros(2, 40)
    mask = torch.zeros(2, 2, dtype=torch.int32)
    mask[0, 0] = 1 << 3
    mask[0, 1] = 1 << 5  # token 37
    mask[1, 0] = -1  # all 32 bits: tokens 0..31
    torch_ops.apply_token_bitmask(logits, mask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [3, 37]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == list(range(32))
