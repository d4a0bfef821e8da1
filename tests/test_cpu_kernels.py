"""The C float32 kernels of the CPU path (triton_kernels/cpu_kernels.c): the linear layer against
a float64 matmul, the small ops and decode attention against torch_ops, the per-step-size
choice between the C linear and torch, and greedy parity with HF when every step runs them."""

import itertools
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pageserve.runtime import LLM
from pageserve.triton_kernels import cpu_kernels, linear_plan
from pageserve.loadtest.tiny_model import build_tiny_model
from tests.hf_reference import hf_greedy
from tests.test_parity import random_prompts, run_ours

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def native(native_kernels):
    return native_kernels


@pytest.fixture(scope="module", params=["native", "avx2"])
def kernel(request, native):
    """The kernels built for this CPU, and, where it has AVX-512, built for AVX2 too (the path
    older CPUs take): every property of the kernels themselves holds for each."""
    if request.param == "native":
        return native
    return request.getfixturevalue("avx2_kernels")


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 17, 64, 300])
@pytest.mark.parametrize("out_features,in_features", [(1, 1), (7, 13), (64, 576), (130, 1536), (3, 40), (512, 40),
                                                      (0, 40)])
def test_matches_a_float64_matmul(kernel, rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen)
    for bias in (None, b):
        want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        got = kernel(x, w, bias)
        assert got.dtype == torch.float32 and got.shape == (rows, out_features)
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4 * in_features ** 0.5)


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 64, 130])
@pytest.mark.parametrize("out_features,in_features", [(1, 1), (7, 13), (64, 576), (13, 1536), (6, 40), (301, 96)])
def test_bfloat16_weights_give_the_float32_sums_bit_for_bit(kernel, rows, out_features, in_features):
    """A matrix kept in bfloat16 is widened as it is read (in registers below 8 rows, a tile at
    a time at 8 and up): the same sums as its float32 copy, to the bit, partial tiles and
    tails included."""
    gen = torch.Generator().manual_seed(rows * 7 + in_features)
    x = torch.randn(rows, in_features, generator=gen)
    w16 = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    b = torch.randn(out_features, generator=gen)
    for bias in (None, b):
        assert torch.equal(kernel(x, w16, bias), kernel(x, w16.float(), bias))
    plan = linear_plan.LinearPlan(kernel)  # torch's side of the plan gets a float32 copy
    assert torch.equal(plan(x, w16, b), F.linear(x, w16.float(), b))


@pytest.mark.parametrize("rows", [16, 17, 64])
def test_outputs_summed_aside_are_the_same_bits(kernel, rows):
    """At 16 rows and up, outputs whose rows lie a multiple of 1 KB apart (512 columns here) are
    summed into a scratch and copied out; 500 columns are written in place: the same sums."""
    gen = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 96, generator=gen), torch.randn(512, 96, generator=gen), torch.randn(512, generator=gen)
    for wide in (w, w.to(torch.bfloat16)):
        assert torch.equal(kernel(x, wide, b)[:, :500], kernel(x, wide[:500], b[:500]))
        assert torch.equal(kernel(x, wide)[:, 250:], kernel(x, wide[250:]))


def test_narrowing_keeps_exact_matrices_only(native):
    from pageserve.runtime.models.weight_formats import narrow_exact_matrices

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens, self.proj, self.norm = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 16), \
                torch.nn.LayerNorm(16)
            self.lm_head = None

    model = Tied()
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16).float()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.proj.weight.data[3, 5] += 2 ** -20  # one value bfloat16 cannot hold: nothing narrows
    assert narrow_exact_matrices(model) == 0
    assert all(p.dtype == torch.float32 for p in model.parameters())
    wide = torch.nn.Linear(64, 8)  # a float16 checkpoint's matrix (64 columns: whole h16 blocks)
    model.wide = wide
    wide.weight.data = wide.weight.data.half().float()
    wide.weight.data[0, :4] = torch.tensor([-0.0, 2 ** -24, -65504.0, float("inf")])  # subnormal, extremes
    values = wide.weight.detach().clone()
    assert narrow_exact_matrices(model) == 8 * 64 * 2  # only the matrix whose values are all float16's
    assert wide.weight.block_format == "h16" and model.proj.weight.dtype == torch.float32
    assert torch.equal(native.widen(wide.weight).view(torch.int32), values.view(torch.int32))
    del model.wide
    model.proj.weight.data[3, 5] = before["proj.weight"][3, 5]
    assert narrow_exact_matrices(model) == (32 * 16 + 16 * 16) * 2
    assert model.embed_tokens.weight.dtype == model.proj.weight.dtype == torch.bfloat16  # the tied lm_head's too
    assert model.proj.bias.dtype == model.norm.weight.dtype == torch.float32  # vectors stay
    for n, p in model.named_parameters():
        assert torch.equal(p.float(), before[n]), n


@pytest.mark.engine
@pytest.mark.parametrize("arch,weights", [("llama", torch.bfloat16), ("qwen2", torch.bfloat16),
                                          ("llama", torch.float16)])
def test_a_16_bit_checkpoint_runs_float32_from_16_bit_matrices(tmp_path, native, monkeypatch, arch, weights):
    """float32 activations over a bfloat16 checkpoint keep the matrices (the tied embedding
    too) in bfloat16, over a float16 one in h16 blocks: the same tokens and logprobs, to the
    bit, as with float32 copies, through prompt chunks past the C kernel's rows (torch's matmul
    on a widened copy), the decoder stack and the layer-by-layer path."""
    from pageserve.runtime import SamplingParams
    from pageserve.runtime import model_runner

    def up_to_128_rows(self, weights, reps=3):
        self.use_kernel = [rows <= 128 for rows in linear_plan.ROW_BUCKETS]
    monkeypatch.setattr(linear_plan.LinearPlan, "measure", up_to_128_rows)
    model_dir = build_tiny_model(tmp_path / arch, arch=arch, weights_dtype=weights,
                                 tie_word_embeddings=arch == "llama")
    prompts = random_prompts(384)[:6]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=2)

    def run():
        llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=0.01, max_num_batched_tokens=256)
        model = llm.engine.runner.model
        outs = llm.generate(prompts, params, use_tqdm=False)
        return model, [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs],
                        [d and {t: lp.logprob for t, lp in d.items()} for d in o.prompt_logprobs]) for o in outs]

    model, narrow = run()
    head = model.embed_tokens if arch == "llama" else model.lm_head
    kept = [w.dtype if w.dtype != torch.uint8 else w.block_format for w in (
        model.layers[0].mlp.down_proj.weight, model.layers[1].self_attn.qkv_proj.weight, head.weight)]
    assert kept == [torch.bfloat16 if weights == torch.bfloat16 else "h16"] * 3
    assert model.norm.weight.dtype == torch.float32
    if arch == "qwen2":  # untied: the embedding is only looked up; the q/k/v bias is a vector
        assert model.embed_tokens.weight.dtype == model.layers[0].self_attn.qkv_proj.bias.dtype == torch.float32
    monkeypatch.setattr(model_runner, "narrow_exact_matrices", lambda model: 0)
    model, wide = run()
    assert model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    assert wide == narrow


def test_strided_rows_and_a_weight_slice(kernel):
    """Row views of a wider tensor (q/k/v split, a fused weight's rows) are read in place."""
    w = torch.randn(300, 64)[100:200]  # rows of a fused weight
    for rows in (6, 40):  # a register tile; panels of x
        x = torch.randn(rows, 100)[:, 10:74]  # row stride 100
        assert torch.allclose(kernel(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    x3 = torch.randn(2, 3, 64)  # leading dims kept
    assert torch.allclose(kernel(x3, w), F.linear(x3, w), rtol=1e-5, atol=1e-4)


def test_wrong_input_is_an_error(kernel):
    with pytest.raises(TypeError):
        kernel(torch.randn(1, 8, dtype=torch.bfloat16), torch.randn(4, 8))
    with pytest.raises(ValueError):
        kernel(torch.randn(1, 8), torch.randn(4, 9))
    with pytest.raises(ValueError):
        kernel(torch.randn(1, 8), torch.randn(8, 4).t())  # columns not contiguous


@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_small_ops_match_torch_ops(kernel, tokens):
    from pageserve.triton_kernels import torch_ops

    gen = torch.Generator().manual_seed(tokens)
    hidden, heads, kv_heads, d = 96, 6, 2, 16
    x = torch.randn(tokens, hidden, generator=gen)
    res = torch.randn(tokens, hidden, generator=gen)
    w = torch.randn(hidden, generator=gen)
    for residual in (None, res):
        got, want = kernel.rms_norm(x, w, 1e-5, residual), torch_ops.rms_norm(x, w, 1e-5, residual)
        for g, e in zip(got, want):
            assert torch.allclose(g, e, rtol=1e-5, atol=1e-5)
    # q and k as the model makes them: views into one fused qkv row
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen)
    cache = torch.randn(64, d, generator=gen)
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    cos, sin = torch_ops.rope_cos_sin(positions, cache, torch.float32)
    ours, ref = qkv.clone(), qkv.clone()
    for t, rope in ((ours, kernel.rotary_embedding), (ref, torch_ops.rotary_embedding)):
        q = t[:, :heads * d].reshape(tokens, heads, d)
        k = t[:, heads * d:(heads + kv_heads) * d].reshape(tokens, kv_heads, d)
        rope(q, k, cos, sin)
    assert torch.allclose(ours, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(ours[:, (heads + kv_heads) * d:], qkv[:, (heads + kv_heads) * d:])  # v untouched
    # partial rotary (Phi-4-mini): the first 10 of each head's 16 values turn, the other 6 pass
    cos, sin = torch_ops.rope_cos_sin(positions, cache[:, :10], torch.float32)
    ours, ref = qkv.clone(), qkv.clone()
    for t, rope in ((ours, kernel.rotary_embedding), (ref, torch_ops.rotary_embedding)):
        heads_of = t[:, :(heads + kv_heads) * d].view(tokens, heads + kv_heads, d)
        rope(heads_of[:, :heads, :10], heads_of[:, heads:, :10], cos, sin)
    assert torch.allclose(ours, ref, rtol=1e-5, atol=1e-5)
    turned = ours[:, :(heads + kv_heads) * d].view(tokens, -1, d)
    assert torch.equal(turned[..., 10:], qkv[:, :(heads + kv_heads) * d].view(tokens, -1, d)[..., 10:])
    assert not torch.allclose(turned[..., :10], qkv[:, :(heads + kv_heads) * d].view(tokens, -1, d)[..., :10])
    gate_up = torch.randn(tokens, 2 * 80, generator=gen) * 4
    assert torch.allclose(kernel.silu_and_mul(gate_up), torch_ops.silu_and_mul(gate_up), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (9, 3, 64), (8, 1, 24), (6, 2, 7), (4, 2, 96),
                                                    (8, 2, 128)])
@pytest.mark.parametrize("step", ["decode", "decodes", "mixed"])
@pytest.mark.parametrize("scale,window,softcap", [(0.3, 0, 0.0), (30.0, 0, 0.0), (0.3, 5, 0.0), (0.3, 40, 0.0),
                                                  (30.0, 0, 50.0), (0.3, 40, 2.0), (0.0625, 5, 50.0)])
def test_paged_attention_matches_torch_ops(kernel, heads, kv_heads, head_dim, step, scale, window, softcap):
    """Over scattered blocks, the new K/V written at their slots first. decode: one token per
    request at ragged context lengths (paged_decode), one KV head a work item; decodes: enough
    requests (on 2 threads) for a token's every KV head to be one item; mixed: prompt chunks
    (from the start, after cached context, one token long) beside decodes, causal in each
    chunk. A scale of 30 spreads the scores by hundreds: a maximum taken wrong overflows. A
    sliding window (Gemma 3's, Mistral's): each token sees its last `window` positions, and the
    table entries of blocks wholly before a request's first window point at a block of NaN, as
    the KV manager's placeholders point at blocks it gave back. A soft cap (Gemma 2's): the scores
    of 30 squeezed into (-50, 50), those of 0.3 into (-2, 2), and Gemma 2's own (small scores under
    a cap of 50, where tanh is nearly linear)."""
    from pageserve.triton_kernels import torch_ops

    gen = torch.Generator().manual_seed(heads * 10 + head_dim)
    block_size, num_blocks = 16, 60
    # (context before the step, tokens in the step)
    reqs = ([(n - 1, 1) for n in (1, 16, 17, 33, 100, 5)] if step == "decode" else
            [(n - 1, 1) for n in (1, 16, 17, 33, 100, 5, 2, 64, 48, 9)] if step == "decodes" else
            [(0, 37), (5, 1), (40, 20), (100, 1), (16, 16), (0, 1), (63, 70)])
    caches = [torch.randn(num_blocks + 1, kv_heads, block_size, head_dim, generator=gen) for _ in range(2)]
    for c in caches:
        c[num_blocks] = float("nan")  # the placeholder: read, it would poison the output
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots = [], []
    for before, n in reqs:
        blocks = [order.pop() for _ in range(-(-(before + n) // block_size))]
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(before, before + n)]
        if window:
            gone = max(before + 1 - window, 0) // block_size  # blocks wholly before its first row's window
            blocks[:gone] = [num_blocks] * gone
        tables.append(blocks + [0] * (10 - len(blocks)))
    t = len(slots)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=gen)
    q = qkv[:, :heads * head_dim].reshape(t, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].reshape(t, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].reshape(t, kv_heads, head_dim)
    bt = torch.tensor(tables, dtype=torch.int32)
    sl = torch.tensor(slots, dtype=torch.int64)
    lens = torch.tensor([before + n for before, n in reqs], dtype=torch.int32)
    qsl = torch.tensor([0] + list(itertools.accumulate(n for _, n in reqs)), dtype=torch.int32)
    ref_k, ref_v = caches[0].clone(), caches[1].clone()
    torch_ops.reshape_and_cache(k, v, ref_k, ref_v, sl)
    want = torch_ops.paged_attention(q.contiguous(), ref_k, ref_v, bt, qsl, lens, scale, sliding_window=window,
                                     softcap=softcap)
    if step != "mixed":
        threads = torch.get_num_threads()  # the kernels share torch's OpenMP runtime
        torch.set_num_threads(2 if step == "decodes" else threads)  # 10 decodes: 4 tokens a thread or more
        try:
            got = kernel.paged_attention(q, k, v, caches[0], caches[1], sl, bt, lens, scale, sliding_window=window,
                                         softcap=softcap)
        finally:
            torch.set_num_threads(threads)
    else:
        got = kernel.paged_attention(q, k, v, caches[0], caches[1], sl, bt, lens, scale, qsl, sliding_window=window,
                                     softcap=softcap)
    for c, ref in zip(caches, (ref_k, ref_v)):
        assert torch.allclose(c, ref, rtol=0, atol=0, equal_nan=True)
    tol = 1e-5 if scale < 1 or softcap else 2e-3  # scores in the hundreds: their rounding grows with them
    assert torch.allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (8, 1, 64), (6, 2, 40), (2, 1, 24), (96, 2, 16)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (7, 0.0), (100, 0.0), (0, 1.5), (7, 1.5)])
def test_paged_decode_of_a_few_requests_in_pieces(kernel, heads, kv_heads, d, window, softcap):
    """One or two requests, fewer (request, KV head) items than twice the threads: each context
    (or its sliding window's part) is cut into pieces, each piece of every head (past 64 heads,
    of one KV head's), then merged. Torch's attention; contexts shorter than the pieces leave
    some empty; heads of 40 and 24 floats take the scalar tails."""
    from pageserve.triton_kernels import torch_ops

    threads = torch.get_num_threads()  # the kernels share torch's OpenMP runtime
    if threads < 2:
        pytest.skip("one thread: no pieces")
    gen = torch.Generator().manual_seed(heads)
    block_size = 16
    caches = [torch.randn(60, kv_heads, block_size, d, generator=gen) for _ in range(2)]
    bt = torch.randperm(60, generator=gen).int()[:54].reshape(2, 27)
    checked = 0
    for lens in ([1], [2], [3], [17], [400], [1, 5], [130, 333], [429, 2]):
        n = len(lens)
        if n * kv_heads >= 2 * threads:  # the whole-context items (the test above)
            continue
        sl = torch.tensor([int(bt[i, (L - 1) // block_size]) * block_size + (L - 1) % block_size
                           for i, L in enumerate(lens)], dtype=torch.int64)
        q = torch.randn(n, heads, d, generator=gen)
        k, v = torch.randn(n, kv_heads, d, generator=gen), torch.randn(n, kv_heads, d, generator=gen)
        lens_t = torch.tensor(lens, dtype=torch.int32)
        got = kernel.paged_attention(q, k, v, caches[0], caches[1], sl, bt[:n], lens_t, 0.125, sliding_window=window,
                                     softcap=softcap)
        want = torch_ops.paged_attention(q, caches[0], caches[1], bt[:n], torch.arange(n + 1, dtype=torch.int32),
                                         lens_t, 0.125, sliding_window=window, softcap=softcap)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), lens
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (8, 1, 64), (6, 2, 40), (4, 4, 16), (2, 1, 24),
                                             (96, 2, 16)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (6, 0.0), (50, 0.0), (50, 1.5)])
def test_paged_decode_of_verification_rows_in_groups(kernel, heads, kv_heads, d, threads, window, softcap):
    """A speculative verification: T = 2..17 rows of one sequence at consecutive positions (each
    row a decode of its own, the same block table) beside other requests, read as one group per
    KV head, each row seeing its own positions only; contexts off the block boundaries, tables
    shuffled, a group of 17 rows past 64 heads. Longer runs (the decoder stack's prompt rows, from
    position 0 or after cached ones, beside decodes and shorter runs; 96 heads: a decode's are
    more than one item) go as the prompt attention takes a chunk. Under a sliding window, a
    group's later rows see less than its first (with a window of 6, none of its first pieces).
    Torch's attention of each row on its own; the same rows as chunks of a step
    (query_start_loc) give the same bits, soft-capped (Gemma 2) too."""
    from pageserve.triton_kernels import torch_ops

    gen = torch.Generator().manual_seed(heads * 100 + d)
    block_size, num_blocks = 16, 400
    caches = [torch.randn(num_blocks, kv_heads, block_size, d, generator=gen) for _ in range(2)]
    order = torch.randperm(num_blocks, generator=gen).tolist()
    # per request: (context length of its first row, rows)
    batches = [[(700, 9)], [(1, 2)], [(5, 17)], [(30, 3), (100, 1), (555, 9), (2, 1), (41, 2)],
               [(17, 1), (300, 17), (301, 17)], [(16, 5)], [(999, 4)], [(64, 1), (65, 1)],
               [(1, 40)], [(200, 41), (50, 1), (3, 18), (77, 1)], [(1, 18), (33, 2)], [(10, 5), (300, 20), (2, 1)]]
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)  # the kernels share torch's OpenMP runtime
    try:
        for reqs in batches:
            tables, lens, slots, width, free = [], [], [], 70, list(order)
            for first, rows in reqs:
                blocks = [free.pop() for _ in range(-(-(first + rows - 1) // block_size))]
                for t in range(rows):
                    tables.append(blocks + [0] * (width - len(blocks)))
                    lens.append(first + t)
                    p = first + t - 1
                    slots.append(blocks[p // block_size] * block_size + p % block_size)
            n = len(lens)
            qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen)
            q = qkv[:, :heads * d].reshape(n, heads, d)
            k = qkv[:, heads * d:(heads + kv_heads) * d].reshape(n, kv_heads, d)
            v = qkv[:, (heads + kv_heads) * d:].reshape(n, kv_heads, d)
            bt, sl = torch.tensor(tables, dtype=torch.int32), torch.tensor(slots, dtype=torch.int64)
            lens_t = torch.tensor(lens, dtype=torch.int32)
            ref_k, ref_v = caches[0].clone(), caches[1].clone()
            torch_ops.reshape_and_cache(k, v, ref_k, ref_v, sl)
            want = torch_ops.paged_attention(q.contiguous(), ref_k, ref_v, bt, torch.arange(n + 1, dtype=torch.int32),
                                             lens_t, 0.125, sliding_window=window, softcap=softcap)
            got = kernel.paged_attention(q, k, v, caches[0], caches[1], sl, bt, lens_t, 0.125, sliding_window=window,
                                         softcap=softcap)
            assert torch.equal(caches[0], ref_k) and torch.equal(caches[1], ref_v)
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (reqs, (got - want).abs().max())
            if all(rows == 1 for _, rows in reqs):
                continue  # plain decodes: no groups
            # the same rows as chunks of a step (the layer-by-layer path): the same bits
            starts = [0] + list(itertools.accumulate(rows for _, rows in reqs))
            chunked = kernel.paged_attention(q, k, v, caches[0].clone(), caches[1].clone(), sl, bt[starts[:-1]],
                                             lens_t[[e - 1 for e in starts[1:]]], 0.125,
                                             torch.tensor(starts, dtype=torch.int32), sliding_window=window,
                                             softcap=softcap)
            assert torch.equal(chunked, got), reqs
    finally:
        torch.set_num_threads(saved)


def test_a_window_that_hides_a_first_piece_from_later_rows_on_the_scalar_build(portable_kernels):
    """The verification rows under a window of 6 on the build for any x86-64, whose exp is
    expf: a row that sees none of a piece sums its exponentials to NaN there, and merges only
    because the piece is marked empty (the vector builds' exp clamps the NaN away)."""
    test_paged_decode_of_verification_rows_in_groups(portable_kernels, 9, 3, 64, 2, 6, 0.0)


def test_soft_capped_scores_on_the_scalar_build(portable_kernels):
    """Gemma 2's soft cap through tanhf, the build for any x86-64's."""
    test_paged_decode_of_verification_rows_in_groups(portable_kernels, 9, 3, 64, 2, 50, 1.5)


def test_silu_is_accurate_over_the_whole_range(kernel):
    """The vectorised exp: within a few float32 ulp of float64 SiLU from -100 to 100, and
    finite at the ends (no overflow into inf or nan)."""
    gate = torch.cat([torch.linspace(-100, 100, 40001), torch.tensor([0.0, -0.0, 1e-30, -88.0, 89.0])])
    gate = gate.reshape(1, -1)
    up = torch.full_like(gate, 3.0)
    got = kernel.silu_and_mul(torch.cat([gate, up], dim=1)).double()
    want = 3.0 * gate.double() * torch.sigmoid(gate.double())
    assert torch.isfinite(got).all()
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-30)


def test_small_ops_refuse_what_they_cannot_read(kernel):
    x = torch.randn(2, 8)
    with pytest.raises(ValueError):
        kernel.rms_norm(x, torch.randn(9), 1e-5)
    with pytest.raises(TypeError):
        kernel.silu_and_mul(x.double())
    cs = torch.randn(2, 1, 16)
    q = torch.randn(2, 2, 16)
    with pytest.raises(ValueError):  # cos and sin not the halves of one row
        kernel.rotary_embedding(q, q.clone(), cs[..., :8], cs[..., :8])
    cache = torch.zeros(4, 2, 16, 16)
    with pytest.raises(ValueError):  # int64 block tables
        kernel.paged_decode(q, q, q, cache, cache, torch.zeros(2, dtype=torch.int64),
                            torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, dtype=torch.int32), 1.0)


def test_the_plan_runs_the_faster_path_per_step_size(kernel):
    plan = linear_plan.LinearPlan(kernel)
    calls = []
    plan.kernel = lambda x, w, b=None: calls.append(x.shape[0]) or kernel(x, w, b)
    plan.measure([torch.randn(256, 128), torch.randn(128, 256)], reps=1)
    assert set(plan.timings) == set(linear_plan.ROW_BUCKETS)
    assert all(t > 0 and k > 0 for t, k in plan.timings.values())
    plan.use_kernel = [rows <= 4 for rows in linear_plan.ROW_BUCKETS]
    calls.clear()
    w = torch.randn(16, 8)
    for rows in (1, 3, 4, 5, 600):
        x = torch.randn(rows, 8)
        assert torch.allclose(plan(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert calls == [1, 3, 4]  # 5 takes the bucket of 8, 600 is past the last bucket


def test_a_negative_slot_writes_nothing(kernel):
    cache = torch.zeros(2, 1, 16, 8)
    k = torch.ones(1, 1, 8)
    kernel.paged_decode(torch.ones(1, 1, 8), k, k, cache, cache.clone(), torch.tensor([-1]),
                        torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0)
    assert not cache.any()


def test_an_unwritable_cache_keeps_torch(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        assert cpu_kernels.load(ro / "kernels") is None
    finally:
        ro.chmod(0o700)


def test_a_file_where_the_cache_folder_should_be_keeps_torch(tmp_path):
    (tmp_path / "kernels").write_text("not a folder")
    assert cpu_kernels.load(tmp_path / "kernels") is None


def test_no_compiler_keeps_torch(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert cpu_kernels.load(tmp_path / "empty") is None
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PAGESERVE_NO_CPU_KERNELS", "1")
    assert cpu_kernels.load(tmp_path / "empty") is None


@pytest.mark.engine
def test_greedy_parity_with_the_kernel_on_every_step(tmp_path, native, monkeypatch):
    """Chunked prompts (up to 64 rows a step) and decodes all go through the C kernels."""
    def everywhere(self, weights, reps=3):
        self.use_kernel = [True] * len(linear_plan.ROW_BUCKETS)
    monkeypatch.setattr(linear_plan.LinearPlan, "measure", everywhere)
    model_dir = build_tiny_model(tmp_path / "llama", arch="qwen2")  # q/k/v biases too
    prompts = random_prompts(384)[:10]
    expected = hf_greedy(model_dir, prompts, max_new_tokens=16)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=0.01, max_num_batched_tokens=64,
              debug_checks=True)
    kernels = llm.engine.runner.kernels
    assert kernels.linear_plan is not None and all(kernels.linear_plan.use_kernel)
    if native.vectorized:  # built with AVX2 + FMA: the C small ops and decode attention too
        assert kernels.ops.rms_norm.__self__ is kernels.linear_plan.kernel and kernels.cpu_lib is not None
    assert run_ours(llm, prompts, 16) == expected


@pytest.mark.engine
def test_enforce_eager_keeps_torch_ops(tiny_model_dir, native):
    import argparse

    from pageserve.app.serve import add_args
    from pageserve.runtime.engine_args import EngineArgs
    from pageserve.triton_kernels import torch_ops

    eager = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=0.01, enforce_eager=True)
    assert eager.engine.runner.kernels.linear_plan is None and eager.engine.runner.kernels.ops is torch_ops
    compiled = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=0.01)
    assert compiled.engine.runner.kernels.linear_plan is not None
    parser = argparse.ArgumentParser()
    add_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args(["--enforce-eager"])).enforce_eager


def test_weights_move_into_one_huge_page_buffer():
    """...and the kernel backs it with huge pages where THP is not off: madvise on glibc's heap,
    whose pages had been touched before, once got 16 of the 87 MiB resident there."""
    from pageserve.runtime.cpu_env import keep_freed_memory, resident_kib, weights_in_huge_pages

    keep_freed_memory()  # as the engine does: freed memory stays in the heap, its pages touched
    touched = torch.ones(16 << 20)
    del touched
    model = torch.nn.Sequential(torch.nn.Embedding(4096, 128), torch.nn.Linear(128, 4096), torch.nn.LayerNorm(128))
    model[1].weight = model[0].weight  # tied, as an lm_head on its embedding
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    moved = weights_in_huge_pages(model)
    if moved == 0:
        pytest.skip("madvise(MADV_HUGEPAGE) is not to be had here")
    assert moved == 4096 * 128 * 4  # the one large parameter, once; the small ones stay
    assert model[0].weight is model[1].weight and model[0].weight.data_ptr() % (2 << 20) == 0
    thp, status = Path("/sys/kernel/mm/transparent_hugepage/enabled"), Path("/proc/self/status")
    off = not thp.exists() or "[never]" in thp.read_text() or "THP_enabled:\t0" in status.read_text()
    kib = None if off else resident_kib(model[0].weight)
    if kib is not None:  # THP on, smaps readable: the whole buffer in huge pages
        assert kib[1] >= 2048 and kib[1] == kib[0], kib
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert model[2](model[0](torch.tensor([1, 2]))).shape == (2, 128)


def _qwen2_on_c_linears(tmp_path, native, monkeypatch, arch: str = "qwen2", **overrides) -> Path:
    """A tiny Qwen2 (q/k/v biases; Qwen3: q/k norms) whose every linear runs the C kernel, as
    the stack needs."""
    if not native.vectorized:
        pytest.skip("built without AVX2: the layer-by-layer path keeps torch's small ops")

    def everywhere(self, weights, reps=3):
        self.use_kernel = [True] * len(linear_plan.ROW_BUCKETS)
    monkeypatch.setattr(linear_plan.LinearPlan, "measure", everywhere)
    return build_tiny_model(tmp_path / arch, arch=arch, **overrides)


def _record_stack(monkeypatch) -> list[tuple[int, int, int, bool]]:
    """Kernels.decoder_stack noting each step's (requests, tokens of its longest, tokens, stacked)."""
    from pageserve.runtime import kernels

    steps, original = [], kernels.TorchKernels.decoder_stack

    def counting(self, model, x, positions, meta, kv_caches):
        out = original(self, model, x, positions, meta, kv_caches)
        steps.append((meta.seq_lens.numel(), meta.max_query_len, x.shape[0], out is not None))
        return out
    monkeypatch.setattr(kernels.TorchKernels, "decoder_stack", counting)
    return steps


@pytest.mark.engine
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_decoder_stack_is_the_layer_by_layer_path_bit_for_bit(tmp_path, native, monkeypatch, arch):
    """Decode steps and steps of short prompts of a Llama-style model run the decoder stack in
    one C call (Kernels.decoder_stack), each prompt token as a decode of its own position: the
    same logprobs, to the bit, as the layers one by one, at one and at several rows a step,
    with q/k/v biases (Qwen2) or q/k norms (Qwen3), for whole prompts and for the chunks after
    a prompt's first; a step past STACK_PROMPT_ROWS tokens keeps the layers."""
    from pageserve.runtime import SamplingParams
    from pageserve.runtime import kernels

    model_dir = _qwen2_on_c_linears(tmp_path, native, monkeypatch, arch)
    monkeypatch.setattr(kernels, "STACK_PROMPT_ROWS", 128)
    prompts = random_prompts(384)[:5] + [random_prompts(384, seed=1)[9]]  # 5 to 48 tokens, and 160
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    stacked = _record_stack(monkeypatch)

    def run(budget):
        llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=0.01, max_num_batched_tokens=budget)
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts[3:5]]  # one request a step
        outs += llm.generate(prompts, params, use_tqdm=False)  # six
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs],
                 [d and {t: lp.logprob for t, lp in d.items()} for d in o.prompt_logprobs]) for o in outs]

    for budget in (64, 256):
        stacked.clear()
        fused = run(budget)
        assert all(on == (rows <= 17 or tokens <= 128) for _, rows, tokens, on in stacked)
        assert any(on and rows > 17 for _, rows, _, on in stacked)  # prompts: 31 and 48 tokens
        # 64: every step, the 160-token prompt's chunks after its first too; 256: all six prompts' rows not
        assert all(on for *_, on in stacked) == (budget == 64)
        with monkeypatch.context() as m:
            m.setattr(kernels.TorchKernels, "decoder_stack", lambda self, *args: None)
            assert run(budget) == fused


@pytest.mark.engine
@pytest.mark.parametrize("dtype,arch", [("float32", "qwen2"), ("bfloat16", "qwen2"), ("bfloat16", "qwen3")])
def test_prompts_beside_decodes_and_after_cached_blocks_run_the_stack(tmp_path, native, monkeypatch, dtype, arch):
    """Prompts that arrive while another request decodes, one of them after the prefix cache's
    blocks of another's prompt: the steps that mix a decode with a prompt of more than 17 tokens,
    and the chunk after the cached positions, run the stack, their attention taking each
    chunk's rows as the layers' prompt attention takes them. Every request's logprobs are those
    of the layers one by one, in float32 and in bfloat16 arithmetic (heads of 32 floats: AMX
    tiles where the CPU has them), with Qwen3's q/k norms too."""
    from pageserve.runtime import SamplingParams
    from pageserve.runtime import kernels

    if dtype == "bfloat16" and not native.has_bf16_dot:
        pytest.skip("no AVX512-BF16: --dtype bfloat16 is torch's bfloat16 here, with no C kernels")
    model_dir = _qwen2_on_c_linears(tmp_path, native, monkeypatch, arch, hidden_size=192, num_attention_heads=6,
                                    num_key_value_heads=2)
    a, b = random_prompts(384, seed=2)[2], random_prompts(384, seed=3)[3]  # 17 and 31 tokens
    c = a + random_prompts(384, seed=4)[4][:40]  # a's first block cached, then 41 more
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    steps = _record_stack(monkeypatch)

    def run():
        engine = LLM(str(model_dir), dtype=dtype, kv_cache_memory=0.01).engine
        engine.add_request(a, params, request_id="a")
        logprobs, cached, arrivals = {}, {}, {2: ("b", b), 3: ("c", c)}
        for i in range(40):
            if i in arrivals:
                engine.add_request(arrivals[i][1], params, request_id=arrivals[i][0])
            for out in engine.step():
                if out.finished:
                    cached[out.request_id] = out.metrics.num_cached_tokens
                    logprobs[out.request_id] = [(d.token_id, d.logprob, d.top_ids, d.top_logprobs)
                                                for d in out.outputs[0].logprobs]
            if not engine.has_unfinished_requests():
                break
        assert cached == {"a": 0, "b": 0, "c": 16}
        return logprobs

    stacked = run()
    assert len(stacked) == 3 and all(on for *_, on in steps), steps
    assert any(n > 1 and rows > 17 for n, rows, _, _ in steps), steps[4:40]  # a prompt beside a decode
    assert any(n > 1 and rows == 41 for n, rows, _, _ in steps), steps  # c after a's cached blocks, beside decodes
    monkeypatch.setattr(kernels.TorchKernels, "decoder_stack", lambda self, *args: None)
    assert run() == stacked


@pytest.mark.engine
@pytest.mark.parametrize("arch,stacked", [("llama", True), ("phi3", True), ("qwen3", True), ("gemma2", False),
                                          ("mistral", False), ("mixtral", False)])
def test_decoder_stack_only_for_plain_layers(tmp_path, arch, stacked):
    """Gemma's layers, sliding windows (Mistral's tiny model has one) and experts keep the
    layer-by-layer path; a plain Llama (Phi-3, and Qwen3 with its q/k norms, too) is one stack,
    until a layer takes another attention scale."""
    llm = LLM(str(build_tiny_model(tmp_path / arch, arch=arch)), dtype="float32", kv_cache_memory=0.01)
    model = llm.engine.runner.model
    assert (model.stack_weights() is not None) == stacked
    if stacked:
        assert len(model.stack_weights()) == 2
        if arch == "qwen3":  # a q norm without its k norm never reaches C
            lib, caches = llm.engine.runner.kernels.cpu_lib, llm.engine.runner.kv_caches
            layers = model.stack_weights()
            if lib is not None:
                lib.decode_stack(layers, model.norm.weight, 1e-6, caches)
                with pytest.raises(ValueError, match="decode_stack: "):
                    lib.decode_stack([layers[0][:8] + (None,), layers[1]], model.norm.weight, 1e-6, caches)
        model.layers[1].self_attn.scale *= 2
        assert model.stack_weights() is None


def test_auto_dtype_takes_the_c_kernels(native, monkeypatch, caplog):
    """auto on a CPU: the C kernels wherever they build (the log says so and why), in bfloat16
    arithmetic where they have AVX512-BF16, else float32; without them torch's bfloat16 where
    the CPU multiplies bfloat16, else float32."""
    from pageserve.runtime.config import cpu_has_fast_bf16
    from pageserve.runtime.engine_args import EngineArgs

    cpu = torch.device("cpu")
    with caplog.at_level("INFO"):
        got = EngineArgs().resolve_dtype(cpu)
    if native.has_bf16_dot:
        assert got == (torch.float32, True) and "--dtype auto: the C kernels multiply in bfloat16" in caplog.text
    else:
        assert got == (torch.float32, False)
        assert "--dtype auto: float32 (float32 arithmetic in the C kernels" in caplog.text
    assert EngineArgs(dtype="float32").resolve_dtype(cpu) == (torch.float32, False)
    monkeypatch.setenv("PAGESERVE_NO_CPU_KERNELS", "1")
    assert EngineArgs().resolve_dtype(cpu) == (torch.bfloat16 if cpu_has_fast_bf16() else torch.float32, False)


def test_a_large_models_plan_times_a_share_of_its_rows():
    """The linear plan times at most MEASURED_VALUES of weight values: an even share of each
    matrix's rows, every column, blocks kept blocks; a small model's weights whole."""
    from pageserve.triton_kernels.cpu_kernels import blocks
    from pageserve.triton_kernels.linear_plan import rows_share

    small = [torch.zeros(64, 32), torch.zeros(32, 64)]
    assert rows_share(small, budget=4096) is small
    raw = torch.arange(128 * 4 * 34).remainder(251).to(torch.uint8).view(128, 136)
    big = [torch.arange(256 * 64, dtype=torch.float32).view(256, 64), blocks(raw, "q8_0", 128)]
    share = rows_share(big, budget=(256 * 64 + 128 * 128) // 4)
    assert [tuple(w.shape) for w in share] == [(64, 64), (32, 136)]
    assert torch.equal(share[0], big[0][:64]) and share[1].block_format == "q8_0" and share[1].in_features == 128
    assert torch.equal(share[1], big[1].data[:32])
