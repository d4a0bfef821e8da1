"""paged_attention, reshape_and_cache and rotary_embedding against the plain references (tests/kernels/reference.py) on
ragged batches: query lengths 1 to 37, contexts 1 to 300, GQA ratios 1, 3 and 8, shuffled
block tables with unused rows, block sizes 8, 16 and 32, head dims 64, 96 and 128. Queries are
views into a fused QKV output and block tables a column slice of a wider table, as the engine
passes them."""

from __future__ import annotations

import types

import pytest
import torch

from pageserve.triton_kernels.paged_attention import split_partitions, paged_attention
from pageserve.triton_kernels.reshape_and_cache import reshape_and_cache
from pageserve.triton_kernels.rotary_embedding import rotary_embedding
from tests.kernels import reference

pytestmark = [pytest.mark.unit, pytest.mark.slow]

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# (query heads, KV heads, head dim): GQA ratios 1, 3, 8 and 8 over two KV heads
HEADS = [(4, 4, 64), (6, 2, 96), (8, 1, 128), (16, 2, 64)]


def make_batch(q_lens, ctx_lens, num_kv_heads, head_dim, block_size, dtype, device, seed):
    """A paged cache filled with noise, whose requests own shuffled blocks scattered among
    blocks nobody owns; block tables padded with zeros to the longest request, and sliced out
    of a wider table (so that their row stride is not their width)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-c // block_size) for c in ctx_lens]
    num_blocks = 2 * sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=g)
    block_tables = torch.zeros(len(q_lens), max(blocks_per_seq) + 3, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        block_tables[b, :n] = order[used:used + n]
        used += n
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.randn(shape, generator=g).to(device, dtype)
    v_cache = torch.randn(shape, generator=g).to(device, dtype)
    query_start_loc = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    seq_lens = torch.tensor(ctx_lens, dtype=torch.int32)
    block_tables = block_tables.to(device)[:, :max(blocks_per_seq)]
    return k_cache, v_cache, block_tables, query_start_loc.to(device), seq_lens.to(device)


def random_lengths(num_seqs, max_q, max_ctx, seed):
    """Ragged query and context lengths, each context at least its query."""
    g = torch.Generator().manual_seed(seed)
    q_lens = torch.randint(1, max_q + 1, (num_seqs,), generator=g).tolist()
    ctx = [q + int(torch.randint(0, max_ctx - q + 1, (1,), generator=g)) for q in q_lens]
    return q_lens, ctx


def check_attention(q_lens, ctx_lens, heads, block_size, dtype, device, seed, sliding_window=0, softcap=0.0,
                    **kwargs):
    """With a sliding window, the blocks wholly before it are NaN when the kernel runs (so a
    kernel that read one fails); returns the output and how many blocks were poisoned."""
    num_heads, num_kv_heads, head_dim = heads
    k_cache, v_cache, bt, qsl, sl = make_batch(q_lens, ctx_lens, num_kv_heads, head_dim,
                                               block_size, dtype, device, seed)
    qkv = torch.randn(sum(q_lens), (num_heads + 2 * num_kv_heads) * head_dim,
                      generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)
    q = qkv[:, :num_heads * head_dim].view(-1, num_heads, head_dim)  # token stride > H * D
    scale = head_dim ** -0.5
    want = reference.paged_attention(q.cpu(), k_cache.cpu(), v_cache.cpu(), bt.cpu(), qsl.cpu(),
                                     sl.cpu(), scale, sliding_window, softcap)
    poisoned = 0
    if softcap:
        kwargs["softcap"] = softcap
    if sliding_window:
        poisoned = reference.poison_out_of_window(k_cache, v_cache, bt.cpu(), qsl.cpu(), sl.cpu(), sliding_window)
        kwargs["sliding_window"] = sliding_window
    out = paged_attention(q, k_cache, v_cache, bt, qsl, sl, scale, max(q_lens), max(ctx_lens), **kwargs)
    torch.testing.assert_close(out.cpu(), want, **TOL[dtype])
    return out, poisoned


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads", HEADS)
def test_mixed_step(device, dtype, block_size, heads):
    """Prefill chunks over cached context beside single-token decodes, in one launch."""
    seed = block_size + heads[0] * 7 + heads[2]
    q_lens, ctx = random_lengths(6, 37, 300, seed)
    q_lens += [1, 37, 1]  # a decode, a whole-prompt chunk, and a one-token context
    ctx += [300, 37, 1]
    check_attention(q_lens, ctx, heads, block_size, dtype, device, seed)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("num_partitions, partition_size, dtype",
                         [(0, 64, torch.float32), (0, 64, torch.bfloat16), (5, 64, torch.float32),
                          (5, 64, torch.bfloat16), (19, 16, torch.float32), (12, 64, torch.float32)])
def test_decode_one_pass_and_split(device, dtype, heads, num_partitions, partition_size):
    """Decode-only steps through the one-pass kernel and the split-KV path. Contexts shorter
    than the last partitions leave them empty; 19 partitions take the reduce two chunks (in
    float32 only: the reduce's sums are float32 whatever the cache holds, and bfloat16 loads
    are covered by the 0 and 5 partitions; under the interpreter each 19-partition case
    costs 5-10 s). 12 partitions of 64 are more than the longest context needs, as in a CUDA
    graph captured for the longest context the model takes: the last ones are empty for all."""
    ctx = [1, 300, 64, 65, 129, 17, 250]
    check_attention([1] * len(ctx), ctx, heads, 16, dtype, device, heads[0] + num_partitions,
                    num_partitions=num_partitions, partition_size=partition_size, block_n=16)


def test_block_tile_wider_than_cache_block(device):
    """A KV tile of 128 tokens gathers from four 32-token blocks at once."""
    check_attention([5, 1, 20], [300, 128, 20], (8, 2, 64), 32, torch.float32, device, 3, block_n=128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [5, 16, 40, 1000])
@pytest.mark.parametrize("block_size, heads", [(16, (6, 2, 64)), (8, (4, 4, 64)), (32, (8, 1, 128))])
def test_sliding_window_mixed_step(device, dtype, window, block_size, heads):
    """Windows smaller and larger than a block (and than every context) over prefill chunks
    and decodes; the blocks before each window are NaN, so reading one fails."""
    seed = window + block_size + heads[0]
    q_lens, ctx = random_lengths(5, 37, 200, seed)
    q_lens += [1, 37, 1, 3]
    ctx += [200, 37, 1, 150]
    _, poisoned = check_attention(q_lens, ctx, heads, block_size, dtype, device, seed, sliding_window=window)
    assert (poisoned > 0) == (window < 100)


@pytest.mark.parametrize("num_partitions, partition_size", [(0, 64), (5, 64), (19, 16)])
def test_sliding_window_decode_one_pass_and_split(device, num_partitions, partition_size):
    """Split-KV decodes whose first partitions lie wholly before the window (they see no
    token; the reduce must skip them, also across its chunks of 16)."""
    ctx = [1, 300, 64, 65, 129, 17, 250]
    _, poisoned = check_attention([1] * len(ctx), ctx, (6, 2, 64), 16, torch.float32, device, num_partitions,
                                  sliding_window=20, num_partitions=num_partitions,
                                  partition_size=partition_size, block_n=16)
    assert poisoned > 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_partitions", [0, 5])
def test_softcap(device, dtype, num_partitions):
    """Gemma 2's attention-logit cap (cap * tanh(s / cap)), low enough to change every score,
    with and without a window, on a mixed step and on split decodes."""
    if num_partitions:
        check_attention([1] * 4, [300, 64, 129, 17], (6, 2, 64), 16, dtype, device, 5, softcap=0.5,
                        num_partitions=num_partitions, partition_size=64, block_n=16)
    else:
        q_lens, ctx = random_lengths(5, 37, 200, 9)
        check_attention(q_lens, ctx, (6, 2, 64), 16, dtype, device, 9, softcap=0.5)
    q_lens = [1, 1, 1] if num_partitions else [1, 20, 1]  # the split path takes decodes only
    check_attention(q_lens, [150, 40, 9], (8, 2, 64), 16, dtype, device, 4, sliding_window=10,
                    softcap=0.5, num_partitions=num_partitions, partition_size=64, block_n=16)


def test_split_heuristic():
    cpu = torch.device("cpu")
    assert split_partitions(2, 8, 1, 4096, cpu) == 8  # few long decodes: split
    assert split_partitions(64, 8, 1, 4096, cpu) == 0  # enough programs already
    assert split_partitions(2, 8, 5, 4096, cpu) == 0  # a prefill in the step
    assert split_partitions(2, 8, 1, 300, cpu) == 0  # one partition's worth of context


def test_sm_count_is_read_from_the_cuda_device_once(monkeypatch):
    """The CUDA lookup behind the split heuristic, run here with the device properties faked."""
    from pageserve.triton_kernels import paged_attention as module

    calls = []
    props = types.SimpleNamespace(multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: calls.append(d) or props)
    module._sm_count.cache_clear()
    try:
        cuda = torch.device("cuda")
        assert module.max_split_seqs(2, cuda) == 65 and module.max_split_seqs(8, cuda) == 16
        assert split_partitions(65, 2, 1, 4096, cuda) == 8 and split_partitions(66, 2, 1, 4096, cuda) == 0
        assert calls == [cuda]
    finally:
        module._sm_count.cache_clear()  # a real GPU's count is looked up again


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_launcher_chooses_the_split_path(device, dtype):
    """The launcher's own choice, default partitions (512) and tile: two long decodes."""
    assert split_partitions(2, 2, 1, 1100, torch.device(device)) == 3
    check_attention([1, 1], [1100, 70], (6, 2, 64), 16, dtype, device, 11)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size, heads", [(16, (4, 2, 64)), (32, (6, 3, 96)), (16, (8, 8, 128))])
def test_reshape_and_cache(device, dtype, block_size, heads):
    num_heads, num_kv_heads, head_dim = heads
    tokens = 23
    g = torch.Generator().manual_seed(tokens + block_size)
    # key and value as views into a fused QKV output, as the model passes them
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(device, dtype)
    _, key, value = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    key = key.view(tokens, num_kv_heads, head_dim)
    value = value.view(tokens, num_kv_heads, head_dim)
    num_blocks = 8
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[4] = -1  # padding: written nowhere
    cache = torch.randn(2, num_blocks, num_kv_heads, block_size, head_dim, generator=g).to(device, dtype)
    want = cache.clone()
    live = slots >= 0
    reference.reshape_and_cache(key[live.to(device)], value[live.to(device)], want[0], want[1],
                                slots[live].to(device))
    reshape_and_cache(key, value, cache[0], cache[1], slots.to(device))
    assert torch.equal(cache, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 2, 64), (6, 2, 96), (8, 1, 128)])
@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_rotary_embedding(device, dtype, heads, partial):
    """Each head rotated through views of the fused qkv rows; partial rotary (Phi-4-mini): the
    first 3/4 of each head, the rest left as it was."""
    num_heads, num_kv_heads, head_dim = heads
    rot = int(head_dim * partial)
    tokens = 19
    g = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(device, dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    q = q.view(tokens, num_heads, head_dim)
    k = k.view(tokens, num_kv_heads, head_dim)
    original_v = v.clone()
    positions = torch.randint(0, 500, (tokens,), generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.arange(512).float()[:, None] * inv_freq[None, :]
    cos, sin = reference.rope_cos_sin(positions, torch.cat([freqs.cos(), freqs.sin()], -1).to(device), dtype)
    original_q, want_q, want_k = q.clone(), q.clone(), k.clone()
    reference.rotary_embedding(want_q[..., :rot], want_k[..., :rot], cos, sin)
    rotary_embedding(q[..., :rot], k[..., :rot], cos, sin)
    torch.testing.assert_close(q, want_q, **TOL[dtype])
    torch.testing.assert_close(k, want_k, **TOL[dtype])
    assert not torch.allclose(q[..., :rot], original_q[..., :rot], atol=0.1)  # rotated in place, through the view
    assert torch.equal(q[..., rot:], original_q[..., rot:])
    assert torch.equal(v, original_v)  # the padded heads of a program (6 -> 8) touch nothing
