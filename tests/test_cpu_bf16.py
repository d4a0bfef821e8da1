"""bfloat16 arithmetic in the C kernels (triton_kernels/cpu_linear_bf16.c, `--dtype bfloat16` on a
CPU with AVX512-BF16): the linear against exact products of the rounded inputs and against
torch's bfloat16 matmul, the same bits for a row whatever the rows beside it up to 15 and
whatever the weights' format, the small ops and attention rounded where torch's bfloat16 ops
round, and an engine that runs so, with its decoder stack equal to its layers and its logits
near HF's in bfloat16. Where the CPU lacks AVX512-BF16, `--dtype bfloat16` keeps torch's path."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pageserve.loadtest.tiny_model import build_tiny_model
from pageserve.runtime import LLM, SamplingParams
from pageserve.runtime.config import cpu_flags
from pageserve.triton_kernels import cpu_kernels, linear_plan, torch_ops
from pageserve.triton_kernels.cpu_kernels import blocks
from tests.test_kv_cache_dtype import STEPS, make_step, query_starts

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def lib(native_kernels):
    k = native_kernels
    if not k.has_bf16_dot:
        pytest.skip("no C kernels with AVX512-BF16 on this CPU")
    return cpu_kernels.CpuKernels(k.path, bf16_dot=True)


def r16(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().float()


def ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in bfloat16 units in the last place of the larger."""
    big = torch.maximum(got.abs(), want.abs()).clamp_min(1e-30)
    return (got - want).abs() / (2.0 ** (torch.floor(torch.log2(big)) - 7))


def q4_1(rows: int, cols: int, seed: int, kind: str = "q4_1") -> torch.Tensor:
    gguf = pytest.importorskip("gguf")
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.1
    q = gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, kind.upper()))
    return blocks(torch.from_numpy(np.ascontiguousarray(q)), kind, cols)


@pytest.mark.parametrize("rows", [1, 2, 7, 15, 16, 33, 64, 130])
@pytest.mark.parametrize("out_features,in_features", [(1, 13), (7, 40), (64, 576), (130, 1536), (301, 96)])
def test_linear_is_the_rounded_products_summed(lib, rows, out_features, in_features):
    """y = round(sum of bf16(x) bf16(w) + bias): within one bfloat16 step of the exact sum
    rounded, and of torch's bfloat16 matmul (which sums in another order)."""
    gen = torch.Generator().manual_seed(rows * 31 + in_features)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen)
    b = r16(torch.randn(out_features, generator=gen))  # the engine's biases are bfloat16 values
    for weight in (w, w.bfloat16()):
        got = lib(x, weight, b)
        assert torch.equal(got, r16(got))  # outputs are bfloat16 values
        exact = r16(x).double() @ r16(w).double().T + r16(b).double()
        assert ulps(got.double(), exact).max() <= 1.5, (weight.dtype, rows)  # half a step, and float32 sums
        torch_bf16 = F.linear(x.bfloat16(), w.bfloat16(), b.bfloat16()).float()
        assert ulps(got, torch_bf16).max() <= 2


def test_a_row_is_the_same_bits_beside_up_to_15_others_and_from_blocks(lib):
    """Up to 15 rows each output sums its 32-value chunks into four accumulators in the same
    order; GGUF blocks are the rounded widened values: one request's row is the same however
    many share its step (below panels), and the same from Q4_1 blocks as from their values."""
    gen = torch.Generator().manual_seed(5)
    w = q4_1(200, 576, 1)
    wide = lib.widen(w)
    x = torch.randn(15, 576, generator=gen)
    alone = torch.cat([lib(x[i:i + 1], w) for i in range(15)])
    for rows in (2, 5, 15):
        assert torch.equal(lib(x[:rows], w), alone[:rows])
    assert torch.equal(lib(x, wide), alone)
    assert torch.equal(lib(x[:1], wide.bfloat16()), alone[:1])
    many = torch.randn(64, 576, generator=gen)
    assert torch.equal(lib(many, w), lib(many, wide))  # panels: blocks against their values too


def test_the_tiles_where_the_cpu_has_amx(lib):
    """On a CPU with AMX (Sapphire Rapids and later) panels of 16 rows and more, and the
    attention of groups of rows, multiply in its tiles: the library says so. Their sums are
    checked beside the vdpbf16ps paths' by the tests above and test_kv_cache_dtype's."""
    if "amx_bf16" not in cpu_flags():
        pytest.skip("no AMX on this CPU")
    assert lib.isa.endswith("and AMX")


def test_weights_laid_out_once_for_amx_give_the_same_bits(lib, monkeypatch):
    """From 16 rows, with AMX, a weight is rounded and laid out for the tiles once and kept on
    it (CpuKernels.packed): the bits of laying it out in each call. Q4_1 and Q4_0 matrices keep
    their 4-bit codes in the tiles' order (less than a third of the bytes) and are widened as
    they are multiplied. Written in place, a weight is laid out again; past PACKED_BUDGET, each
    call lays it out as before."""
    if not lib.amx:
        pytest.skip("no AMX here")
    gen = torch.Generator().manual_seed(11)
    weights = (q4_1(130, 576, 4), q4_1(45, 1536, 5, "q4_0"), q4_1(96, 96, 6), torch.randn(70, 96, generator=gen),
               torch.randn(33, 1536, generator=gen).bfloat16())
    for w in weights:
        x = torch.randn(40, cpu_kernels.in_features(w), generator=gen)
        b = r16(torch.randn(w.shape[0], generator=gen))
        monkeypatch.setattr(cpu_kernels, "PACKED_BUDGET", 0)
        fresh = lib(x, w, b)
        assert getattr(w, "_amx_packed", None) is None
        monkeypatch.undo()
        assert torch.equal(lib(x, w, b), fresh) and w._amx_packed is not None
        assert torch.equal(lib(x[:15], w, b), fresh[:15])  # below 16 rows: the rows' path, as before
        assert torch.equal(lib(x[:33], w, b), fresh[:33])  # a block of x of one row
        kept = w._amx_packed[0]
        kind = {4: 1, 3: 2}.get(cpu_kernels.weight_format(w)[0], 0)  # Q4_1, Q4_0: their codes, else bfloat16
        assert kept[0].item() == kind  # the layout's kind
        four_bit = kind > 0
        rows, chunks = -(-w.shape[0] // 32), -(-cpu_kernels.in_features(w) // 32)
        assert kept.numel() * 4 == 64 + rows * chunks * (640 if four_bit else 2048)
    held = w._amx_packed[0]
    w.mul_(2)  # written in place: laid out again
    got = lib(x, w, b)
    assert w._amx_packed[0] is not held
    monkeypatch.setattr(cpu_kernels, "PACKED_BUDGET", 0)
    del w._amx_packed
    assert torch.equal(got, lib(x, w, b))


def test_the_decoder_stack_reads_the_amx_layouts(lib):
    """18 decodes through the C decoder stack (its matrices laid out for the tiles when it is
    built) give the layer-by-layer path's bits with each matrix laid out in the call."""
    if not lib.amx:
        pytest.skip("no AMX here")
    from tests.test_quant_blocks import layer_by_layer

    hidden, heads, kv_heads, d, inter, block_size, t = 64, 4, 2, 32, 96, 16, 18
    gen = torch.Generator().manual_seed(3)
    shapes = [((heads + 2 * kv_heads) * d, hidden), (hidden, heads * d), (2 * inter, hidden), (hidden, inter)]
    layers = []
    for layer in range(2):
        w = [q4_1(rows, cols, 10 * layer + i) for i, (rows, cols) in enumerate(shapes)]
        norms = [r16(1 + 0.1 * torch.randn(hidden, generator=gen)) for _ in range(2)]
        layers.append((norms[0], w[0], None, w[1], norms[1], w[2], w[3]))
    final_norm = r16(1 + 0.1 * torch.randn(hidden, generator=gen))
    caches = [tuple(r16(torch.randn(3 * t, kv_heads, block_size, d, generator=gen)) for _ in range(2))
              for _ in range(2)]
    lens = torch.randint(1, 48, (t,), generator=gen, dtype=torch.int32)
    tables = torch.randperm(3 * t, generator=gen).view(t, 3).int()
    slots = tables[torch.arange(t), (lens - 1) // block_size].long() * block_size + (lens - 1) % block_size
    x, cos_sin = torch.randn(t, hidden, generator=gen), torch.randn(t, d, generator=gen)
    ours = [tuple(c.clone() for c in pair) for pair in caches]
    stack = lib.decode_stack(layers, final_norm, 1e-5, ours)
    assert all(layers[0][j]._amx_packed is not None for j in (1, 3, 5, 6))
    got = lib.decode_layers(stack, x, cos_sin, slots, tables, lens, d ** -0.5)
    per_call = cpu_kernels.CpuKernels(lib.path, bf16_dot=True)
    per_call.packed = lambda weight: None
    theirs = [tuple(c.clone() for c in pair) for pair in caches]
    want = layer_by_layer(per_call, layers, final_norm, 1e-5, theirs, x, cos_sin, slots, tables, lens, heads,
                          kv_heads, d)
    assert torch.equal(got, want) and got.isfinite().all()


def test_the_plan_gives_torch_the_same_arithmetic(lib):
    """Where torch's matmul runs instead (a bucket where it was faster; every bucket before the
    plan is measured), it multiplies the same rounded values in bfloat16."""
    plan = linear_plan.LinearPlan(lib)
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(600, 96, generator=gen), q4_1(40, 96, 3)
    ours = lib(x, w)
    theirs = plan(x, w)  # 600 rows: torch
    assert torch.equal(theirs, r16(theirs)) and ulps(theirs, ours).max() <= 2


def test_small_ops_round_where_torch_rounds(lib):
    gen = torch.Generator().manual_seed(3)
    t, h = 9, 96
    x, res, w = (r16(torch.randn(t, h, generator=gen)) for _ in range(3))
    w = w[0]
    normed, new_res = lib.rms_norm(x, w, 1e-6, res)
    want_n, want_r = torch_ops.rms_norm(x.bfloat16(), w.bfloat16(), 1e-6, res.bfloat16())
    assert torch.equal(new_res, want_r.float())
    assert ulps(normed, want_n.float()).max() <= 1

    heads, kv, d = 4, 2, 64
    qkv = r16(torch.randn(t, (heads + 2 * kv) * d, generator=gen))
    cache = torch.randn(64, d, generator=gen)
    positions = torch.arange(t) * 7
    cos, sin = torch_ops.rope_cos_sin(positions, cache, torch.float32)
    ours = qkv.clone()
    q, k = ours[:, :heads * d].view(t, heads, d), ours[:, heads * d:(heads + kv) * d].view(t, kv, d)
    lib.rotary_embedding(q, k, cos[:, 0], sin[:, 0])
    ref = qkv.bfloat16()
    cb, sb = torch_ops.rope_cos_sin(positions, cache, torch.bfloat16)
    torch_ops.rotary_embedding(ref[:, :heads * d].view(t, heads, d), ref[:, heads * d:(heads + kv) * d].view(t, kv, d),
                               cb, sb)
    assert torch.equal(ours, ref.float())

    gate_up = r16(torch.randn(t, 2 * h, generator=gen) * 3)
    got = lib.silu_and_mul(gate_up)
    assert ulps(got, torch_ops.silu_and_mul(gate_up.bfloat16()).float()).max() <= 1


def test_attention_rounds_scores_probabilities_and_output(lib):
    """A decode step against torch_ops' bfloat16 decode path (scores of q k^T in bfloat16,
    softmax in float32, probabilities in bfloat16): the output is bfloat16 values within a
    step or two of it (the sums run in another order)."""
    gen = torch.Generator().manual_seed(4)
    heads, kv, d, bs, blocks_n, b = 6, 2, 64, 16, 12, 3
    kc, vc = (r16(torch.randn(blocks_n, kv, bs, d, generator=gen)) for _ in range(2))
    q = r16(torch.randn(b, heads, d, generator=gen))
    k, v = (r16(torch.randn(b, kv, d, generator=gen)) for _ in range(2))
    tables = torch.randperm(blocks_n, generator=gen)[:b * 4].view(b, 4).int()
    lens = torch.tensor([20, 64, 37], dtype=torch.int32)
    slots = (tables[torch.arange(b), (lens - 1) // bs].long() * bs + (lens - 1) % bs)
    kc2, vc2 = kc.clone(), vc.clone()
    got = lib.paged_attention(q, k, v, kc2, vc2, slots, tables, lens, d ** -0.5)
    assert torch.equal(got, r16(got))
    torch_ops.reshape_and_cache(k, v, kc, vc, slots)
    qsl = torch.arange(b + 1, dtype=torch.int32)
    want = torch_ops.paged_attention(q.bfloat16(), kc.bfloat16(), vc.bfloat16(), tables, qsl, lens, d ** -0.5).float()
    assert ulps(got, want).max() <= 3


@pytest.mark.engine
def test_the_engine_multiplies_in_bfloat16_and_follows_hf_bfloat16(tmp_path, lib):
    """--dtype bfloat16 with AVX512-BF16: float32 activations and KV cache, every weight a
    bfloat16 value; the decode stack gives the layers' bits; next-token log-probabilities stay
    near HF's in bfloat16 on the same weights (as near as HF bfloat16 is to HF float32)."""
    from transformers import AutoModelForCausalLM

    from pageserve.runtime.kernels import TorchKernels

    model_dir = build_tiny_model(tmp_path / "llama", arch="llama")
    llm = LLM(str(model_dir), dtype="bfloat16", kv_cache_memory=0.01, max_num_batched_tokens=64)
    cfg, runner = llm.engine.config.model, llm.engine.runner
    assert cfg.dtype == torch.float32 and cfg.bf16_matmuls and runner.kernels.cpu_lib.bf16_dot
    assert all(torch.equal(p, r16(p)) for p in runner.model.parameters() if p.dtype == torch.float32)
    prompt = [5, 17, 99, 3, 250, 41, 7, 8, 300, 12]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    stacked = llm.generate([prompt], params, use_tqdm=False)[0]
    original = TorchKernels.decoder_stack
    try:
        TorchKernels.decoder_stack = lambda self, *args: None
        layered = llm.generate([prompt], params, use_tqdm=False)[0]
    finally:
        TorchKernels.decoder_stack = original
    assert stacked.outputs[0].token_ids == layered.outputs[0].token_ids
    assert [{t: lp.logprob for t, lp in d.items()} for d in stacked.outputs[0].logprobs] == \
        [{t: lp.logprob for t, lp in d.items()} for d in layered.outputs[0].logprobs]

    seq = prompt + list(stacked.outputs[0].token_ids)
    with torch.inference_mode():
        hf = {dt: AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dt)(torch.tensor([seq])).logits[0]
              .float().log_softmax(-1) for dt in (torch.float32, torch.bfloat16)}
    ours = [d for d in stacked.prompt_logprobs[1:]]  # positions 1.. of the prompt
    gap = max(abs(d[t].logprob - hf[torch.bfloat16][i, t].item()) for i, d in enumerate(ours) for t in d)
    scale = max(abs(d[t].logprob - hf[torch.float32][i, t].item()) for i, d in enumerate(ours) for t in d)
    hf_gap = (hf[torch.bfloat16] - hf[torch.float32]).abs().max().item()
    assert gap <= 3 * max(hf_gap, 0.01), (gap, hf_gap, scale)


def test_bfloat16_takes_the_c_kernels_unless_eager(lib, monkeypatch):
    """bfloat16: bfloat16 matmuls in the C kernels; torch's bfloat16 with --enforce-eager or
    without the kernels."""
    from pageserve.runtime.engine_args import EngineArgs

    cpu = torch.device("cpu")
    assert EngineArgs(dtype="bfloat16").resolve_dtype(cpu) == (torch.float32, True)
    assert EngineArgs(dtype="bfloat16", enforce_eager=True).resolve_dtype(cpu) == (torch.bfloat16, False)
    monkeypatch.setenv("PAGESERVE_NO_CPU_KERNELS", "1")
    assert EngineArgs(dtype="bfloat16").resolve_dtype(cpu) == (torch.bfloat16, False)


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (8, 2, 128), (6, 2, 80), (4, 4, 32), (6, 2, 40),
                                             (64, 1, 16)])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_every_way_a_step_is_cut_follows_torchs_bfloat16_attention(lib, step, heads, kv_heads, d, softcap):
    """Decodes, groups of rows and prompt chunks against torch_ops' attention in bfloat16 over the
    same cache, q a bfloat16 value as the bfloat16 arithmetic leaves it. Groups of heads of 16n
    floats multiply in bfloat16 pairs of positions (a run of odd length pairs its last row with
    a zero) and round the probabilities before they are normalised; torch after: both within
    a few bfloat16 steps of each head's largest value. Gemma 2's soft cap on the scores (torch
    caps the bfloat16 scores, rounding after each operation; C the float32 ones) too."""
    q, k, v, caches, bt, sl, lens, qsl = make_step(STEPS[step], heads, kv_heads, d,
                                                   torch.Generator().manual_seed(heads + d))
    q = r16(q)
    got = lib.paged_attention(q, k, v, *(c.bfloat16() for c in caches), sl, bt, lens, 0.125, qsl, softcap=softcap)
    torch_ops.reshape_and_cache(k, v, *caches, sl)
    want = torch_ops.paged_attention(q.bfloat16(), *(c.bfloat16() for c in caches), bt, query_starts(qsl, len(lens)), lens,
                                   0.125, softcap=softcap).float()
    big = torch.maximum(got.abs(), want.abs()).amax(-1, keepdim=True).clamp_min(1e-30)  # each head's largest
    steps = (got - want).abs() / 2.0 ** (torch.floor(torch.log2(big)) - 7)
    assert torch.equal(got, r16(got))
    assert steps.max() <= 4, steps.max()  # 3.5 at most before and after the pairs; a pairing mistake gives ~400


@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (8, 2, 128), (6, 2, 40)])
def test_prompt_rows_passed_as_decodes_give_the_chunks_bits(lib, heads, kv_heads, d):
    """The decoder stack passes a step's prompt rows as decodes, a block table and a length
    each: they attend to the bit as the same rows as chunks of the step do, in bfloat16 pairs
    (heads of 16n floats) and AMX tiles (32n up to 128, where the CPU has them), from position
    0, after cached positions and beside decodes."""
    reqs = STEPS["prompt chunks and decodes"]
    q, k, v, caches, bt, sl, lens, qsl = make_step(reqs, heads, kv_heads, d, torch.Generator().manual_seed(d))
    q = r16(q)
    chunked = lib.paged_attention(q, k, v, *(c.bfloat16() for c in caches), sl, bt, lens, 0.125, qsl)
    rows = qsl.diff()
    row_lens = torch.tensor([before + t + 1 for before, n in reqs for t in range(n)], dtype=torch.int32)
    decodes = lib.paged_attention(q, k, v, *(c.bfloat16() for c in caches), sl, bt.repeat_interleave(rows, 0),
                                  row_lens, 0.125)
    assert torch.equal(decodes, chunked)
