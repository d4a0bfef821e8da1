"""Speculative decoding by n-gram lookup gives exactly the tokens of one token a step: greedy
requests on a tiny model over prompts that repeat themselves (drafts accepted at every position
of a run) and prompts that never do, through chunked prefill, a prefix-cache hit, preemption by
swap and by recompute, stop strings and max_tokens inside an accepted run; seeded sampling
requests, their logprobs, grammars, logit bias and min_tokens unchanged; unseeded sampling at
temperature 1 with the same distribution (a chi-square test); speculation off above
disable_by_batch_size; the config refused with its reason where it asks for what is not there."""

from __future__ import annotations

import collections
import random

import pytest
import torch

from pageserve.runtime import LLM, SamplingParams
from pageserve.runtime.config import SpeculativeConfig
from pageserve.sampling.params import StructuredOutputsParams
from tests.conftest import assert_pool_clean
from tests.test_prefix_and_swap import TINY_BLOCK_BYTES

pytestmark = pytest.mark.engine

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
GiB = 1 << 30


def prompts(seed=0) -> list[list[int]]:
    """Half repeat a segment (their outputs, and loops of a random model, accept drafts), half
    are random."""
    rng = random.Random(seed)
    out = []
    for i in range(8):
        seg = [rng.randrange(3, 380) for _ in range(rng.randrange(12, 40))]
        out.append(seg * 3 + seg[:5] if i % 2 == 0 else [rng.randrange(3, 380) for _ in range(rng.randrange(20, 150))])
    return out


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def engine(model_dir, spec=NGRAM, blocks=2000, swap_blocks=0, **kw) -> LLM:
    kw.setdefault("max_num_batched_tokens", 64)  # prompts in chunks
    return LLM(str(model_dir), dtype="float32", kv_cache_memory=blocks * TINY_BLOCK_BYTES / GiB,
               swap_space=swap_blocks * TINY_BLOCK_BYTES / GiB, max_model_len=512, debug_checks=True,
               speculative_config=spec, **kw)


def looping_model(path, lm_head_scale: float = 1.0):
    """The tiny Llama with its layers' output projections scaled by 0.1: each next token depends
    mostly on the last one (and a little on the context), so greedy outputs fall into loops,
    which n-gram drafts predict (about 30% of drafts accepted, at every position of a run).
    lm_head_scale > 1 sharpens its distributions, so that sampled tokens follow the loops too."""
    from safetensors.torch import load_file, save_file

    from pageserve.loadtest.tiny_model import build_tiny_model

    path = build_tiny_model(path)
    weights = load_file(str(path / "model.safetensors"))
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * 0.1
        elif name == "lm_head.weight":
            weights[name] = weights[name] * lm_head_scale
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def looping_model_dir(tmp_path_factory):
    return looping_model(tmp_path_factory.mktemp("looping"))


@pytest.fixture(scope="module")
def plain(looping_model_dir):
    return engine(looping_model_dir, spec=None)


@pytest.fixture(scope="module")
def speculating(looping_model_dir):
    return engine(looping_model_dir)


def test_drafts_that_are_mostly_rejected_change_nothing(tiny_model_dir):
    """The plain tiny model seldom repeats itself: most drafts are rejected, and their KV
    slots written again."""
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (100, 37, 70, 61) * 2]
    want = tokens(engine(tiny_model_dir, spec=None).generate(prompts(), params, use_tqdm=False))
    llm = engine(tiny_model_dir)
    assert tokens(llm.generate(prompts(), params, use_tqdm=False)) == want
    stats = llm.engine.spec.stats
    assert stats.num_draft_tokens > 5 * stats.num_accepted_tokens > 0, stats


def test_greedy_tokens_are_those_of_one_token_a_step(plain, speculating):
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (120, 37, 90, 61) * 2]
    want = tokens(plain.generate(prompts(), params, use_tqdm=False))
    got = tokens(speculating.generate(prompts(), params, use_tqdm=False))
    assert got == want
    stats = speculating.engine.spec.stats
    assert stats.num_accepted_tokens > 50 and min(stats.accepted_per_position) > 0, stats
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # rejections happened, and were rolled back
    assert speculating.engine.stats().generation_tokens == plain.engine.stats().generation_tokens
    # a prefix-cache hit: the same prompts again find their blocks, and give the same tokens
    again = speculating.generate(prompts(), params, use_tqdm=False)
    assert tokens(again) == want and all(o.metrics.num_cached_tokens > 0 for o in again)
    assert_pool_clean(speculating.engine)


@pytest.mark.parametrize("mode,swap_blocks", [("swap", 14), ("recompute", 0)])
def test_preemption_keeps_the_tokens(looping_model_dir, plain, mode, swap_blocks):
    params = [SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)] * 8
    want = tokens(plain.generate(prompts(1), params, use_tqdm=False))
    tight = engine(looping_model_dir, blocks=40, swap_blocks=swap_blocks, preemption_mode=mode,
                   max_num_batched_tokens=128)
    assert tokens(tight.generate(prompts(1), params, use_tqdm=False)) == want
    assert tight.engine.scheduler.num_preemptions > 0 and tight.engine.spec.stats.num_accepted_tokens > 0
    assert_pool_clean(tight.engine)


def test_stops_and_sampling_requests_in_the_same_batch(plain, speculating):
    """A stop string and a max_tokens that fall inside accepted runs end the output where one
    token a step ends it; seeded sampling requests beside them (never speculative) are unchanged."""
    greedy = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    looping = prompts()[0]
    text = plain.generate([looping], greedy, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    batch = [looping, looping, looping, prompts()[1], prompts()[3]]
    params = [SamplingParams(temperature=0, max_tokens=150, ignore_eos=True, stop=[stop]),
              SamplingParams(temperature=0, max_tokens=53, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=150, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
              SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=8, max_tokens=40, ignore_eos=True)]
    want = [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason)
            for o in plain.generate(batch, params, use_tqdm=False)]
    got = [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason)
           for o in speculating.generate(batch, params, use_tqdm=False)]
    assert got == want
    assert want[0][2] == "stop" and len(want[1][1]) == 53


def test_speculation_stops_above_the_batch_size(looping_model_dir):
    llm = engine(looping_model_dir, spec={**NGRAM, "disable_by_batch_size": 2})
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm.generate(prompts()[:4:2] * 2, params, use_tqdm=False)  # four looping requests at once
    drafts_with_four = llm.engine.spec.stats.num_drafts
    llm.generate(prompts()[:1], SamplingParams(temperature=0, max_tokens=120, ignore_eos=True), use_tqdm=False)
    assert drafts_with_four == 0 and llm.engine.spec.stats.num_drafts > 0


@pytest.mark.unit
def test_config_as_vllm_takes_it():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (3, 4, 4)
    assert SpeculativeConfig.parse(None) is None
    for bad, words in (('{"method": "eagle"}', "not supported"), ('{"num_speculative_tokens": 0}', ">= 1"),
                       ('{"prompt_lookup_min": 5, "prompt_lookup_max": 2}', "must be <="),
                       ('{"draft_tensor_parallel_size": 1}', "not supported"), ("[1]", "JSON object"),
                       ("{nope", "not JSON")):
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.parse(bad)


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)],
                         ids=["tp2", "pp2-two-batches-in-flight"])
def test_parallel_ranks_verify_the_same_drafts(looping_model_dir, plain, layout):
    params = [SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)] * 4
    want = tokens(plain.generate(prompts()[:4], params, use_tqdm=False))
    llm = engine(looping_model_dir, **layout)
    try:
        assert tokens(llm.generate(prompts()[:4], params, use_tqdm=False)) == want
        stats = llm.engine.stats().spec
        assert stats.num_accepted_tokens > 0 and stats.mean_acceptance_length > 1
    finally:
        llm.engine.shutdown()


def chi_square_p(a: collections.Counter, b: collections.Counter) -> float:
    """p-value of a chi-square test that two samples come from one distribution: outcomes seen
    fewer than 10 times in both together are pooled into one (so that expected counts are large
    enough for the chi-square approximation)."""
    common = [k for k in a.keys() | b.keys() if a[k] + b[k] >= 10]
    rare = (sum(a.values()) - sum(a[k] for k in common), sum(b.values()) - sum(b[k] for k in common))
    table = torch.tensor([[a[k], b[k]] for k in common] + ([list(rare)] if sum(rare) else []), dtype=torch.float64)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    return torch.special.gammaincc(torch.tensor((len(table) - 1) / 2, dtype=torch.float64), stat / 2).item()


def test_sampling_keeps_the_distribution(tmp_path):
    """Unseeded requests at temperature 1: the first three tokens' joint distribution is the same
    with drafts as without (two-sample chi-square, p > 0.001: a false alarm at most once in a
    thousand seeds of this test; with these seeds the test is deterministic). The same test
    tells temperature 1 from 1.25, and drafts are accepted in a good share of the draws (the
    loops are the likely tokens of a sharpened looping model)."""
    path = looping_model(tmp_path / "sharp", lm_head_scale=4.0)
    kw = dict(max_num_seqs=256, max_num_batched_tokens=512, seed=1)
    plain = engine(path, spec=None, blocks=800, **kw)
    spec = engine(path, spec={**NGRAM, "disable_by_batch_size": None}, blocks=800, **{**kw, "seed": 2})
    # the prompt ends in the model's own greedy loop, so drafts follow it from the first step
    prompt = prompts()[0]
    prompt = prompt + plain.generate([prompt], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                                     use_tqdm=False)[0].outputs[0].token_ids

    def draws(llm, temperature, count=3000):
        outs = llm.generate([prompt] * count, SamplingParams(temperature=temperature, max_tokens=5, ignore_eos=True),
                            use_tqdm=False)
        return collections.Counter(tuple(o.outputs[0].token_ids[:3]) for o in outs)

    without, hotter = draws(plain, 1.0), draws(plain, 1.25)
    with_drafts = draws(spec, 1.0)
    stats = spec.engine.spec.stats
    assert stats.num_accepted_tokens > 300 and stats.accepted_per_position[1] > 50, stats
    assert chi_square_p(without, with_drafts) > 1e-3
    assert chi_square_p(with_drafts, hotter) < 1e-6  # the test can tell a wrong distribution


def test_seeded_sampling_logprobs_grammar_and_bias_are_unchanged(tmp_path):
    """Seeded sampling requests (the runner rewinds their generators to the draws of the kept
    tokens), their logprobs, a grammar (drafts cut where it refuses them), logit bias and
    min_tokens: the same tokens as one token a step, with drafts accepted."""
    path = looping_model(tmp_path / "sharp", lm_head_scale=4.0)
    plain, spec = engine(path, spec=None), engine(path)
    looping = prompts()[0]
    batch = [looping, prompts()[2], looping, prompts()[4], looping, prompts()[1]]
    params = [SamplingParams(temperature=0.8, seed=11, max_tokens=80, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=1.0, seed=12, top_k=5, max_tokens=80, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=13, max_tokens=80, structured_outputs=StructuredOutputsParams(
                  regex="[a-z ]{20,60}")),
              SamplingParams(temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(
                  regex="([a-z]+ ){5,40}")),
              SamplingParams(temperature=0, max_tokens=80, ignore_eos=True, logit_bias={7: 3.0, 9: -100}),
              SamplingParams(temperature=0.9, seed=14, min_tokens=30, max_tokens=60, logprobs=0)]

    def run(llm):
        return [(c.token_ids, c.text, c.finish_reason, [sorted(lp.items()) for lp in c.logprobs or []])
                for o in llm.generate(batch, params, use_tqdm=False) for c in o.outputs]

    want, got = run(plain), run(spec)
    for w, g in zip(want, got):
        assert g[:3] == w[:3]
        for lw, lg in zip(w[3], g[3]):  # the same tokens and ranks; values to float32 rounding
            assert [(t, x.rank) for t, x in lw] == [(t, x.rank) for t, x in lg]
            assert [x.logprob for _, x in lw] == pytest.approx([x.logprob for _, x in lg], abs=1e-4)
    assert len(want[0][3]) == 80 and len(want[5][0]) >= 30
    assert spec.engine.spec.stats.num_accepted_tokens > 10, spec.engine.spec.stats
    assert_pool_clean(spec.engine)


def test_grammar_requests_accept_drafts(tmp_path):
    """A request under a grammar proposes only drafts its grammar allows, and keeps some; with
    tensor parallelism too (the ranks get the grammar's mask rows for every draft)."""
    path = looping_model(tmp_path / "sharp", lm_head_scale=4.0)
    params = SamplingParams(temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(
        regex="([a-z]+ ){5,40}"))
    texts = []
    for tp in (1, 2):
        llm = engine(path, tensor_parallel_size=tp)
        try:
            texts.append(llm.generate([prompts()[0]], params, use_tqdm=False)[0].outputs[0].text)
            assert llm.engine.spec.stats.num_accepted_tokens > 0, (llm.engine.spec.stats, texts[-1])
        finally:
            llm.engine.shutdown()
    assert texts[0] == texts[1]


# ---- the draft_model method ----

def draft_config(path, k=4, **kw):
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k, **kw}


@pytest.fixture(scope="module")
def half_draft_dir(looping_model_dir, tmp_path_factory):
    """The looping model's first layer of two, as a draft: it agrees with the model often, not
    always."""
    from pageserve.loadtest.truncated_copy import truncated_copy

    return truncated_copy(looping_model_dir, tmp_path_factory.mktemp("draft"), layers=1)


def test_draft_model_that_is_the_model_accepts_every_draft(looping_model_dir, plain):
    """The model as its own draft: every draft kept (float32 rows give the same bits in any
    batch), which holds only while the draft's KV keeps pace with the model's, through runs kept
    whole (catch_up), chunked prefill and a prefix-cache hit."""
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (100, 37, 70, 61) * 2]
    want = tokens(plain.generate(prompts(), params, use_tqdm=False))
    llm = engine(looping_model_dir, spec=draft_config(looping_model_dir))
    assert tokens(llm.generate(prompts(), params, use_tqdm=False)) == want
    again = llm.generate(prompts(), params, use_tqdm=False)
    assert tokens(again) == want and all(o.metrics.num_cached_tokens > 0 for o in again)
    stats = llm.engine.spec.stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 400, stats
    # a stop token inside a run: the run's tokens past it are not counted as generated
    stops = [SamplingParams(temperature=0, max_tokens=120, ignore_eos=True, stop_token_ids=[w[9]]) for w in want]
    counted = [e.engine.stats().generation_tokens for e in (plain, llm)]
    got = tokens(llm.generate(prompts(), stops, use_tqdm=False))
    assert got == tokens(plain.generate(prompts(), stops, use_tqdm=False))
    assert [e.engine.stats().generation_tokens - c for e, c in zip((plain, llm), counted)] == [sum(map(len, got))] * 2
    assert_pool_clean(llm.engine)


@pytest.mark.parametrize("mode,swap_blocks", [("swap", 14), ("recompute", 0)])
def test_draft_model_tokens_are_those_of_one_token_a_step(looping_model_dir, half_draft_dir, plain, mode,
                                                          swap_blocks):
    """A one-layer draft (some drafts kept, some not), under preemption by swap and by
    recompute (the draft's blocks are swapped and recomputed with the model's), seeded
    sampling and logprobs beside greedy requests."""
    params = [SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)] * 6 + [
        SamplingParams(temperature=0.8, seed=5, max_tokens=80, ignore_eos=True, logprobs=2)] * 2
    want = plain.generate(prompts(1), params, use_tqdm=False)
    # the draft's layer takes half as much again of each block's bytes: 40 blocks as above
    tight = engine(looping_model_dir, spec=draft_config(half_draft_dir), blocks=60, swap_blocks=swap_blocks * 3 // 2,
                   preemption_mode=mode, max_num_batched_tokens=128)
    got = tight.generate(prompts(1), params, use_tqdm=False)
    assert tokens(got) == tokens(want)
    for w, g in zip(want[6:], got[6:]):
        assert [sorted(lp) for lp in w.outputs[0].logprobs] == [sorted(lp) for lp in g.outputs[0].logprobs]
    stats = tight.engine.spec.stats
    assert tight.engine.scheduler.num_preemptions > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert_pool_clean(tight.engine)


def test_draft_model_keeps_the_distribution(tmp_path):
    """Unseeded sampling at temperature 1 with a draft model (the sharpened looping model as
    its own draft): the first three tokens' joint distribution as without drafts (chi-square,
    p > 0.001)."""
    path = looping_model(tmp_path / "sharp", lm_head_scale=4.0)
    kw = dict(max_num_seqs=256, max_num_batched_tokens=512, blocks=800)
    plain = engine(path, spec=None, seed=1, **kw)
    spec = engine(path, spec=draft_config(path, disable_by_batch_size=None), seed=2, **kw)
    prompt = prompts()[0]
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)

    def draws(llm):
        return collections.Counter(tuple(o.outputs[0].token_ids[:3])
                                   for o in llm.generate([prompt] * 3000, params, use_tqdm=False))

    without, with_drafts = draws(plain), draws(spec)
    stats = spec.engine.spec.stats
    assert stats.num_accepted_tokens > 1000, stats
    assert chi_square_p(without, with_drafts) > 1e-3


def test_draft_model_refusals(tmp_path, looping_model_dir, tiny_model_dir):
    from pageserve.loadtest.tiny_model import build_tiny_model

    other = build_tiny_model(tmp_path / "other", vocab_size=300)
    with pytest.raises(ValueError, match="share the model's tokenizer"):
        engine(looping_model_dir, spec=draft_config(other))
    with pytest.raises(ValueError, match="tensor-parallel-size > 1 is not supported"):
        engine(looping_model_dir, spec=draft_config(looping_model_dir), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="needs \"model\""):
        SpeculativeConfig.parse('{"method": "draft_model"}')
    with pytest.raises(ValueError, match="prompt_lookup_min not supported with method draft_model"):
        SpeculativeConfig.parse({"model": "x", "prompt_lookup_min": 2})
    assert SpeculativeConfig.parse({"model": "x"}).method == "draft_model"


@pytest.mark.slow
def test_default_model_greedy_tokens_with_ngram_drafts():
    """SmolLM2-135M in float32: a request repeating a pasted file (most drafts kept) and one on
    random tokens give the tokens of one token a step."""
    from pageserve.loadtest.bench_spec import grounded_prompts, random_prompts

    kw = dict(dtype="float32", kv_cache_memory=0.2, swap_space=0, max_model_len=2048, max_num_batched_tokens=256)
    plain = LLM(None, **kw)
    batch = [grounded_prompts(plain, 1)[0][0]] + random_prompts(1, plain.engine.config.model.vocab_size)
    params = [SamplingParams(temperature=0, max_tokens=64), SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)]
    want = tokens(plain.generate(batch, params, use_tqdm=False))
    del plain
    spec = LLM(None, speculative_config=NGRAM, **kw)
    assert tokens(spec.generate(batch, params, use_tqdm=False)) == want
    assert spec.engine.spec.stats.num_accepted_tokens > 20, spec.engine.spec.stats


def test_a_thinking_budget_gives_the_same_tokens_with_drafts(plain, speculating):
    """Drafts wait for the end of a bounded thinking (the budget's end is written a token a
    step), then resume: the same greedy tokens as one token a step."""
    from pageserve.sampling.params import ThinkingBudget

    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True,
                             thinking_budget=ThinkingBudget(b, (381, 382))) for m, b in ((90, 20), (60, 5)) * 4]
    want = tokens(plain.generate(prompts(), params, use_tqdm=False))
    assert all(any(tuple(t[i:i + 2]) == (381, 382) for i in range(len(t) - 1)) for t in want)
    before = speculating.engine.spec.stats.num_accepted_tokens
    assert tokens(speculating.generate(prompts(), params, use_tqdm=False)) == want
    assert speculating.engine.spec.stats.num_accepted_tokens > before
    assert_pool_clean(speculating.engine)
