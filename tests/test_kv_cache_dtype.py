"""--kv-cache-dtype: a bfloat16 KV cache. The C attention over a bfloat16 cache gives the float32
cache's outputs to the bit when the values are bfloat16 ones (what the C kernels' bfloat16
arithmetic writes), in every way it cuts a step; torch's attention too; new values are rounded
to nearest even as torch rounds them; the engine's auto choice, its pool, swap and refusals."""

import itertools

import pytest
import torch

from pageserve.runtime import LLM, SamplingParams
from pageserve.runtime.engine_args import EngineArgs
from pageserve.triton_kernels import cpu_kernels, linear_plan, torch_ops
from tests.conftest import assert_pool_clean
from tests.test_parity import random_prompts

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module", params=["native", "native-r16", "avx2", "portable"])
def kernel(request, native_kernels):
    """The kernels of this CPU in float32 arithmetic, in bfloat16 arithmetic where it has it (the
    scores, probabilities and output rounded), built for AVX2 where it has AVX-512, and for any
    x86-64 (the scalar paths, as GCC vectorises them)."""
    if request.param == "native":
        return native_kernels
    if request.param == "native-r16":
        if not native_kernels.has_bf16_dot:
            pytest.skip("no AVX512-BF16 here")
        return cpu_kernels.CpuKernels(native_kernels.path, bf16_dot=True)
    return request.getfixturevalue(f"{request.param}_kernels")


def _bf16(t: torch.Tensor) -> torch.Tensor:
    """t's values rounded to bfloat16, kept in float32"""
    return t.bfloat16().float()


# (context before the step, rows in the step, rows as one request's chunk or as decodes)
STEPS = {
    "decodes, a KV head an item": [(n - 1, 1) for n in (1, 16, 17, 33, 100, 5)],
    "decodes, every head an item": [(n - 1, 1) for n in (1, 16, 17, 33, 100, 5, 2, 64, 48, 9, 300, 7)],
    "one decode in pieces": [(429, 1)],
    "two decodes in pieces": [(130, 1), (2, 1)],
    "prompt chunks and decodes": [(0, 37), (5, 1), (40, 20), (100, 1), (16, 16), (63, 70)],
    "chunks of at most 17 rows (groups)": [(30, 3), (100, 1), (555, 9), (2, 1), (41, 17)],
    "groups whose scores end a mapping": [(86, 12), (251, 14), (62, 7), (292, 13)],
}


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (8, 1, 24), (6, 2, 40), (96, 2, 16), (8, 2, 128),
                                             (6, 3, 64), (4, 4, 72), (64, 1, 40), (6, 2, 96), (4, 1, 32)])
def test_a_bfloat16_cache_gives_the_float32_caches_bits(kernel, step, heads, kv_heads, d):
    """Both caches hold the same bfloat16 values, and the step's new K/V are bfloat16 values:
    the outputs are the same bits and the caches hold the same values after the writes. Heads
    of 24, 40 and 72 floats take the 8-wide and scalar tails; 96 heads take one KV head an item;
    4, 2 and 1 query heads a KV head share V rows three, two and one at a time; 64 heads of 40
    floats in groups once read past their scores in the scalar build; heads of 32, 64, 96 and
    128 floats take one to four tiles of keys where AMX multiplies."""
    q, k, v, caches32, bt, sl, lens, qsl = make_step(STEPS[step], heads, kv_heads, d,
                                                     torch.Generator().manual_seed(heads * 7 + d))
    got = _same_bits(kernel, q, k, v, [c.bfloat16() for c in caches32], caches32, sl, bt, lens, qsl)
    # and the float32 outputs are attention's: torch's over the same cache
    ref = torch_ops.paged_attention(q.contiguous(), *caches32, bt, query_starts(qsl, len(lens)), lens, 0.125)
    tol = 2e-2 if kernel.bf16_dot else 1e-5  # bfloat16 arithmetic rounds the scores and the output
    assert torch.allclose(got, ref, rtol=tol, atol=tol)


def _same_bits(kernel, q, k, v, narrow, wide, sl, bt, lens, qsl):
    """The step over a narrow cache and over a float32 one of the same values: the same outputs
    and the same values written, to the bit. Returns the outputs."""
    threads = torch.get_num_threads()  # the kernels share torch's OpenMP runtime
    torch.set_num_threads(2)
    try:
        want = kernel.paged_attention(q, k, v, *wide, sl, bt, lens, 0.125, qsl)
        got = kernel.paged_attention(q, k, v, *narrow, sl, bt, lens, 0.125, qsl)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(narrow[0].float(), wide[0]) and torch.equal(narrow[1].float(), wide[1])
    assert torch.equal(got, want), (got - want).abs().max()
    return got


def query_starts(qsl, b):
    """query_start_loc, a decode step's too"""
    return torch.arange(b + 1, dtype=torch.int32) if qsl is None else qsl


def make_step(reqs, heads, kv_heads, d, gen):
    """A step of requests (context before, rows) over a float32 cache of bfloat16 values: q (not
    rounded), the step's new K and V (bfloat16 values, views of fused qkv rows), the caches,
    block tables, slots, seq_lens and query_start_loc (None: a decode step)."""
    block_size, num_blocks = 16, 120
    caches32 = [_bf16(torch.randn(num_blocks, kv_heads, block_size, d, generator=gen)) for _ in range(2)]
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots = [], []
    for before, n in reqs:
        blocks = [order.pop() for _ in range(-(-(before + n) // block_size))]
        tables.append(blocks + [0] * (40 - len(blocks)))
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(before, before + n)]
    t = len(slots)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=gen)
    qkv[:, heads * d:] = _bf16(qkv[:, heads * d:])
    q = qkv[:, :heads * d].reshape(t, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].reshape(t, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].reshape(t, kv_heads, d)
    bt = torch.tensor(tables, dtype=torch.int32)
    sl = torch.tensor(slots, dtype=torch.int64)
    lens = torch.tensor([before + n for before, n in reqs], dtype=torch.int32)
    qsl = None if all(n == 1 for _, n in reqs) else \
        torch.tensor([0] + list(itertools.accumulate(n for _, n in reqs)), dtype=torch.int32)
    return q, k, v, caches32, bt, sl, lens, qsl


@pytest.mark.parametrize("chunks", [[(555, 9), (41, 17)], [(0, 2)], [(30, 40)]])
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (6, 2, 40), (64, 1, 16), (8, 2, 128)])
def test_a_decode_beside_chunks_gives_its_bits_in_a_step_of_decodes(kernel, chunks, heads, kv_heads, d):
    """A decode beside chunks of up to 17 rows (decode_groups, in a step of at least 4 groups a
    thread) or longer (prompt_groups) is one item of all its heads, as in a step of decodes only:
    the same bits."""
    decodes = [(100, 1), (2, 1), (300, 1), (17, 1), (64, 1), (33, 1), (5, 1), (250, 1), (16, 1)]
    reqs = decodes[:2] + chunks + decodes[2:]
    q, k, v, caches, bt, sl, lens, qsl = make_step(reqs, heads, kv_heads, d, torch.Generator().manual_seed(d))
    rows = [qsl[i].item() for i, (_, n) in enumerate(reqs) if n == 1]
    which = [i for i, (_, n) in enumerate(reqs) if n == 1]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # nine decodes of 2+ KV heads: each an item, not pieces
    try:
        alone = kernel.paged_decode(q[rows], k[rows], v[rows], *(c.clone() for c in caches), sl[rows], bt[which],
                                    lens[which], 0.125)
        mixed = kernel.paged_attention(q, k, v, *caches, sl, bt, lens, 0.125, qsl)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(mixed[rows], alone)


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (6, 2, 40), (96, 2, 16), (8, 2, 128)])
def test_a_float8_cache_gives_a_float32_cache_of_its_values_bits(kernel, step, heads, kv_heads, d):
    """A float8 e4m3fn cache widens each value exactly where it is read: a float32 cache holding
    the same values (and new K/V already float8 values) gives the same outputs to the bit, in
    every way a step is cut; the new values are written as the same float8 values."""
    q, k, v, caches32, bt, sl, lens, qsl = make_step(STEPS[step], heads, kv_heads, d,
                                                     torch.Generator().manual_seed(heads * 5 + d))
    caches8 = [(c * 8).to(torch.float8_e4m3fn) for c in caches32]  # x8: subnormals, ties and saturation among them
    caches32 = [c.float() for c in caches8]
    k.copy_((k * 8).to(torch.float8_e4m3fn).float())
    v.copy_((v * 8).to(torch.float8_e4m3fn).float())
    _same_bits(kernel, q, k, v, caches8, caches32, sl, bt, lens, qsl)


@pytest.mark.parametrize("heads,kv_heads", [(96, 2), (8, 2)])
def test_a_row_that_sees_nothing_and_a_request_of_no_rows(kernel, heads, kv_heads):
    """Neither comes from the engine (it pads with a position of its own), but neither may crash:
    a decode row of no positions beside a group gives zeros (it divided by zero with 96 heads); a
    request with no rows in query_start_loc is skipped (it read before the seq_lens)."""
    q, k, v, caches, bt, sl, lens, _ = make_step([(10, 3), (0, 1)], heads, kv_heads, 32,
                                                 torch.Generator().manual_seed(0))
    bt, lens = bt[[0, 0, 0, 1]], torch.tensor([11, 12, 13, 0], dtype=torch.int32)
    sl[3] = -1
    out = kernel.paged_decode(q, k, v, *caches, sl, bt, lens, 0.125)
    assert not out.isnan().any() and not out[3].any()
    q, k, v, caches, bt, sl, lens, qsl = make_step([(5, 1), (20, 3), (7, 1)], 9, 3, 64,
                                                   torch.Generator().manual_seed(1))
    want = kernel.paged_attention(q, k, v, *(c.clone() for c in caches), sl, bt, lens, 0.125, qsl)
    empty_first = torch.tensor([0, 0, 3, 4], dtype=torch.int32)
    got = kernel.paged_attention(q[1:], k[1:], v[1:], *caches, sl[1:], bt, lens, 0.125, empty_first)
    assert torch.equal(got, want[1:])


def test_new_float8_values_are_rounded_as_torch_rounds_them(kernel):
    """float32 K/V written to a float8 e4m3fn cache: torch's .to(float8_e4m3fn) of each, bit for
    bit (to nearest even, ties among them; subnormals; saturated at 448, infinities too; -0; a
    NaN with its sign); over every magnitude the format holds."""
    gen = torch.Generator().manual_seed(8)
    vals = torch.cat([torch.randn(2048, generator=gen) * 2.0 ** e for e in range(-12, 11, 2)])
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # each code's value
    mids = (every[1:127] + every[:126]) / 2  # the ties between neighbours
    special = torch.tensor([448.0, 464.0, 465.0, 480.0, 1e6, float("inf"), -float("inf"), -0.0, float("nan"),
                            -float("nan")])
    vals = torch.cat([vals, every[every.isfinite()], mids, -mids, special])
    vals = torch.cat([vals, torch.zeros(-vals.numel() % 32)]).view(-1, 2, 16)
    t = vals.shape[0]
    caches = [torch.zeros(-(-t // 16), 2, 16, 16, dtype=torch.float8_e4m3fn) for _ in range(2)]
    slots = torch.arange(t)
    kernel.paged_decode(torch.randn(t, 2, 16, generator=gen), vals, vals, *caches, slots,
                        torch.arange(caches[0].shape[0], dtype=torch.int32).repeat(t, 1), (slots + 1).int(), 0.25)
    written = caches[0].permute(0, 2, 1, 3).reshape(-1, 2, 16)[:t]
    want = vals.to(torch.float8_e4m3fn)
    assert torch.equal(written.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[0].view(torch.uint8))


def test_new_values_are_rounded_as_torch_rounds_them(kernel):
    """float32 K/V written to a bfloat16 cache: torch's .bfloat16() of each (to nearest, ties to
    even), a tie and a NaN among them; and the attention reads what was written."""
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(4, 2, 16, generator=gen)
    v = torch.randn(4, 2, 16, generator=gen)
    # two ties, a NaN, subnormals (kept, as torch keeps them), the largest float
    k[0, 0, :7] = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8), float("nan"), 1e-39, -3e-40,
                                torch.finfo(torch.float32).max])
    caches = [torch.zeros(4, 2, 16, 16, dtype=torch.bfloat16) for _ in range(2)]
    slots = torch.tensor([0, 17, 33, 63], dtype=torch.int64)
    bt = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32).repeat(4, 1)
    kernel.paged_decode(torch.randn(4, 4, 16, generator=gen), k, v, *caches, slots, bt,
                        torch.tensor([1, 18, 34, 64], dtype=torch.int32), 0.25)
    written_k = caches[0].permute(0, 2, 1, 3).reshape(64, 2, 16)[slots]
    written_v = caches[1].permute(0, 2, 1, 3).reshape(64, 2, 16)[slots]
    nan = written_k.isnan()
    assert torch.equal(nan, k.isnan())  # a NaN stays one (torch's own bits for it vary by path)
    assert torch.equal(written_k.view(torch.int16)[~nan], k.bfloat16().view(torch.int16)[~nan])  # the same bits
    assert torch.equal(written_v, v.bfloat16())
    assert written_k[0, 0, :3].tolist() == [1.0, 1.0 + 4 * 2 ** -8, -1.0]


@pytest.mark.parametrize("reqs", [[(5, 1), (40, 1), (0, 1)], [(0, 37), (5, 1), (40, 20)]])
def test_torch_attention_widens_a_bfloat16_cache(reqs):
    """torch_ops over a bfloat16 cache: the float32 cache's outputs (its decode path and SDPA's),
    and reshape_and_cache rounds as .bfloat16() does."""
    gen = torch.Generator().manual_seed(len(reqs))
    heads, kv_heads, d, block_size = 6, 2, 32, 16
    cache32 = [_bf16(torch.randn(20, kv_heads, block_size, d, generator=gen)) for _ in range(2)]
    cache16 = [c.bfloat16() for c in cache32]
    slots, tables, free = [], [], list(range(20))
    for before, n in reqs:
        blocks = [free.pop() for _ in range(-(-(before + n) // block_size))]
        tables.append(blocks + [0] * (4 - len(blocks)))
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(before, before + n)]
    t = len(slots)
    k, v = torch.randn(t, kv_heads, d, generator=gen), torch.randn(t, kv_heads, d, generator=gen)
    sl = torch.tensor(slots)
    torch_ops.reshape_and_cache(_bf16(k), _bf16(v), *cache32, sl)
    torch_ops.reshape_and_cache(k, v, *cache16, sl)
    assert torch.equal(cache16[0].float(), cache32[0]) and torch.equal(cache16[1].float(), cache32[1])
    q = torch.randn(t, heads, d, generator=gen)
    args = (torch.tensor(tables, dtype=torch.int32),
            torch.tensor([0] + list(itertools.accumulate(n for _, n in reqs)), dtype=torch.int32),
            torch.tensor([b + n for b, n in reqs], dtype=torch.int32), 0.2)
    workspace = torch_ops.Workspace()
    want = torch_ops.paged_attention(q, *cache32, *args, workspace=workspace)
    assert torch.equal(torch_ops.paged_attention(q, *cache16, *args, workspace=workspace), want)


def _generate(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_pool_clean(llm.engine)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


@pytest.fixture
def c_matmuls_everywhere(monkeypatch):
    """Every step's matmuls in C whatever the start-up timing says, so that two engines run the
    same arithmetic (the timed choice may differ between them on a busy machine)."""
    def everywhere(self, weights, reps=3):
        self.use_kernel = [True] * len(linear_plan.ROW_BUCKETS)
    monkeypatch.setattr(linear_plan.LinearPlan, "measure", everywhere)


@pytest.mark.engine
def test_auto_keeps_the_bfloat16_arithmetics_values_at_half_the_bytes(tiny_model_dir, native_kernels,
                                                                     c_matmuls_everywhere):
    """With the C kernels' bfloat16 arithmetic (--dtype auto on AVX512-BF16) every K and V value is
    a bfloat16 one: auto keeps them in bfloat16, twice the blocks in the same memory, and the
    tokens and logprobs are those of a float32 cache, to the bit (prompt chunks, decodes, prefix
    hits). Elsewhere auto keeps the activations' dtype."""
    kw = dict(kv_cache_memory=0.002, max_num_batched_tokens=64, max_model_len=512, debug_checks=True)
    auto = LLM(str(tiny_model_dir), **kw)
    cfg = auto.engine.config.model
    if not native_kernels.has_bf16_dot:
        assert not cfg.bf16_matmuls and cfg.kv_cache_dtype == cfg.dtype
        pytest.skip("no AVX512-BF16 here: nothing else to compare")
    assert cfg.bf16_matmuls and cfg.kv_cache_dtype == torch.bfloat16
    wide = LLM(str(tiny_model_dir), kv_cache_dtype="float32", **kw)
    assert wide.engine.config.model.kv_cache_dtype == torch.float32
    assert auto.engine.config.cache.num_blocks == 2 * wide.engine.config.cache.num_blocks
    prompts = random_prompts(384)[:6]
    prompts += [prompts[0] + prompts[1][:20]]  # a prefix hit
    assert _generate(auto, prompts) == _generate(wide, prompts)


@pytest.mark.engine
@pytest.mark.parametrize("kv,dtype", [("bfloat16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)])
def test_a_narrow_cache_under_float32_arithmetic(tiny_model_dir, native_kernels, kv, dtype):
    """--dtype float32 --kv-cache-dtype bfloat16 or fp8: the C path and torch's own
    (--enforce-eager) round the same values into the cache and give the same greedy tokens, under
    preemption by swap and by recompute as without; a float8 pool holds 4x float32's blocks."""
    prompts = [p * 3 for p in random_prompts(384)[:8]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def run(kv=kv, **kw):
        llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_dtype=kv, max_model_len=512,
                  max_num_batched_tokens=128, debug_checks=True, **kw)
        assert llm.engine.runner.kv_caches[0][0].dtype == (dtype if kv != "float32" else torch.float32)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_pool_clean(llm.engine)
        return outs, llm.engine.scheduler, llm.engine.config.cache.num_blocks

    expected, _, blocks = run(kv_cache_memory=0.01, enforce_eager=True)
    ratio = 4 // dtype.itemsize
    assert abs(blocks - ratio * run("float32", kv_cache_memory=0.01)[2]) < ratio  # (the pool's bytes in whole blocks)
    got, _, _ = run(kv_cache_memory=0.01)
    assert got == expected
    block = 2 * 2 * 2 * 16 * 16 * dtype.itemsize  # layers, K/V, KV heads, block size, head dim, bytes
    for mode in ("swap", "recompute"):
        tight, sched, _ = run(kv_cache_memory=40 * block / 2 ** 30, swap_space=14 * block / 2 ** 30,
                              preemption_mode=mode)
        assert sched.num_preemptions > 0
        assert tight == expected, mode


def test_what_is_refused():
    with pytest.raises(ValueError, match="of the float8 formats only e4m3 is"):
        EngineArgs(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="must be one of auto, bfloat16, float32, fp8, fp8_e4m3"):
        EngineArgs(kv_cache_dtype="int8")
    for name in ("fp8", "fp8_e4m3"):
        assert EngineArgs(kv_cache_dtype=name).resolve_kv_cache_dtype(torch.device("cpu"), torch.float32, True) \
            == torch.float8_e4m3fn
        with pytest.raises(ValueError, match="a float8 KV cache is served on a CPU only"):
            EngineArgs(kv_cache_dtype=name).resolve_kv_cache_dtype(torch.device("cuda"), torch.bfloat16, False)
    triton = EngineArgs(attention_backend="triton", kv_cache_dtype="float32")
    with pytest.raises(ValueError, match="Triton attention keeps K and V in the model's dtype"):
        triton.resolve_kv_cache_dtype(torch.device("cuda"), torch.bfloat16, False)
    assert triton.resolve_kv_cache_dtype(torch.device("cuda"), torch.float32, False) == torch.float32
    cpu = EngineArgs(kv_cache_dtype="bfloat16")
    assert cpu.resolve_kv_cache_dtype(torch.device("cpu"), torch.float32, False) == torch.bfloat16
    assert EngineArgs().resolve_kv_cache_dtype(torch.device("cpu"), torch.float32, True) == torch.bfloat16
    # an adapter's delta is added unrounded: its K and V are not bfloat16 values
    assert EngineArgs(enable_lora=True).resolve_kv_cache_dtype(torch.device("cpu"), torch.float32, True) \
        == torch.float32
    with pytest.raises(ValueError, match="under --dtype float16 would lose precision"):
        cpu.resolve_kv_cache_dtype(torch.device("cpu"), torch.float16, False)
    assert EngineArgs().resolve_kv_cache_dtype(torch.device("cuda"), torch.bfloat16, False) == torch.bfloat16
