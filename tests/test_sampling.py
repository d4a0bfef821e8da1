"""The sampling surface: exact distributions, penalties and bias against a plain reference,
seeds that do not depend on the batch, min_tokens, n > 1 sharing blocks, and logprobs against
HF on the real model."""

from __future__ import annotations

import dataclasses

import math
import random

import pytest
import torch

from pageserve.sampling.params import RequestOutputKind, SamplingParams
from pageserve.sampling.penalties import TokenCounts
from pageserve.sampling.sampler import (NO_TOKEN, SampleRow, SamplingMetadata, draw, process_logits, sample,
                                        sync_free_rows)
from tests.conftest import assert_pool_clean

pytestmark = pytest.mark.engine

# the chi-square distribution's 0.999 quantile by degrees of freedom (1 to 24)
CHI2_999 = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26, 32.91,
            34.53, 36.12, 37.70, 39.25, 40.79, 42.31, 43.82, 45.31, 46.80, 48.27, 49.73, 51.18]


def _rows(params: list[SamplingParams], histories=None, prompts=None) -> list[SampleRow]:
    out = []
    for i, p in enumerate(params):
        prompt = prompts[i] if prompts else [0]
        out.append(SampleRow(f"r{i}", p, prompt + (histories[i] if histories else []), len(prompt), (1,)))
    return out


def _expected(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution by the definitions, one step after another, in float64."""
    x = logits.double() / p.temperature
    probs = x.softmax(-1)
    keep = probs >= p.min_p * probs.max()
    if p.top_k > 0:  # every token tied with the k-th is kept (vLLM, HF)
        keep &= probs >= probs.topk(min(p.top_k, len(probs))).values[-1]
    x = x.masked_fill(~keep, -math.inf)
    probs = x.softmax(-1)
    order = probs.argsort(descending=True)
    covered = 0.0
    for t in order.tolist():  # keep tokens until the ones above cover top_p: the fewest holding it
        if p.top_p < 1 and covered >= p.top_p:
            x[t] = -math.inf
        covered += probs[t].item()
    return x.softmax(-1)


def _logits(vocab: int, gen: torch.Generator) -> torch.Tensor:
    if vocab == 12:
        return torch.randn(vocab, generator=gen) * 0.8
    if vocab == 600:  # a head of 12 likely tokens and a long flat tail
        logits = torch.randn(vocab, generator=gen) * 0.3 - 1.5
        logits[:12] = torch.randn(12, generator=gen) * 0.8 + 3
        return logits
    # a slow geometric decay: the top 128 hold ~96% at temperature 1.3, top-p 0.9 ends near 90
    return (-torch.arange(vocab, dtype=torch.float32) / 30)[torch.randperm(vocab, generator=gen)]


@pytest.mark.parametrize("vocab", [12, 600, 1000], ids=["v12", "v600", "v1000"])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=6),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.3, top_p=0.9),
    SamplingParams(temperature=1.3, top_p=0.995),  # at 600: past the candidates, a full sort
    SamplingParams(temperature=0.9, min_p=0.08),
    SamplingParams(temperature=0.8, top_k=8, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=1.0, top_k=300, min_p=0.001),  # top-k past the candidates
    SamplingParams(temperature=1.3, top_p=0.9, min_p=0.0005),  # top-p bounds, min-p does not
], ids=["plain", "top_k", "top_p", "top_p_90", "top_p_wide", "min_p", "all", "top_k_300", "top_p_min_p"])
def test_empirical_frequencies_match_exact_probabilities(params, vocab):
    gen = torch.Generator().manual_seed(1234)
    logits = _logits(vocab, gen)
    n = 20_000
    meta = SamplingMetadata(_rows([params] * n), torch.device("cpu"), vocab)
    ids, _ = sample(logits.repeat(n, 1), meta, torch.Generator().manual_seed(7))
    counts = torch.bincount(ids, minlength=vocab).double()
    p = _expected(logits, params)
    assert counts[p == 0].sum() == 0  # masked tokens are never drawn
    # bins by rank: the 12 likeliest tokens one by one, then ranks in groups of 16, then the rest
    order = p.argsort(descending=True)
    edges = list(range(13)) + list(range(28, min(vocab, 160), 16)) + [vocab]
    groups = [order[lo:hi] for lo, hi in zip(edges, edges[1:]) if hi > lo]
    counts = torch.stack([counts[g].sum() for g in groups])
    p = torch.stack([p[g].sum() for g in groups])
    support = p > 1e-9
    assert counts[~support].sum() == 0
    expected = p[support] * n
    stat = ((counts[support] - expected) ** 2 / expected).sum().item()
    df = int(support.sum()) - 1
    assert 2 <= df <= len(CHI2_999) and stat < CHI2_999[df - 1], (stat, df)


def test_top_k_and_top_p_at_ties_and_at_one():
    """Where vLLM and HF draw their lines: top-k keeps every token tied with the k-th, top-p the
    fewest tokens holding at least top_p, and top_p 1 masks nothing (a float32 sum of 32,000
    probabilities passes 1 before the tail, which masked tail tokens of untruncated rows sorted
    beside a truncated one: a seeded row's token then depended on its batch)."""
    from pageserve.sampling.sampler import apply_top_k_top_p

    def kept(logits, top_k=-1, top_p=1.0) -> tuple[list[int], list[int]]:
        """The tokens kept by the full sort's way, and those drawn by the candidates' way (every
        uniform of 64 lands on a kept token)."""
        rows = torch.tensor([logits], dtype=torch.float32)
        full = apply_top_k_top_p(rows, torch.tensor([top_k]), torch.tensor([top_p]))
        meta = SamplingMetadata(_rows([SamplingParams(top_k=top_k, top_p=top_p)] * 64), torch.device("cpu"),
                                len(logits))
        drawn = draw(rows.repeat(64, 1), meta, torch.linspace(0, 0.999, 64)).unique().tolist()
        return torch.isfinite(full[0]).nonzero()[:, 0].tolist(), drawn

    assert kept([1.0, 3.0, 3.0, 0.0], top_k=1) == ([1, 2], [1, 2])
    assert kept([3.0, 2.0, 1.0, 2.0, 0.0], top_k=2) == ([0, 1, 3], [0, 1, 3])
    assert [len(way) for way in kept([0.0] * 4, top_p=0.5)] == [2, 2]  # which two of the tied four: either
    half, quarter = math.log(0.5), math.log(0.25)
    assert kept([half, quarter, quarter], top_p=0.5) == ([0], [0])
    assert [len(way) for way in kept([half, quarter, quarter], top_p=0.75)] == [2, 2]
    assert kept([half, quarter, quarter], top_p=1e-300) == ([0], [0])  # 0 in float32: the top token stays
    logits = torch.randn(1, 32_000, generator=torch.Generator().manual_seed(3)) * 2  # one the old sum masked
    assert torch.equal(apply_top_k_top_p(logits, torch.tensor([-1]), torch.tensor([1.0])), logits)


@pytest.mark.parametrize("vocab", [12, 600, 1000], ids=["v12", "v600", "v1000"])
def test_the_draw_without_a_sync_takes_the_same_tokens(vocab):
    """On a GPU the draw reads nothing back to the host (every truncated row drawn among its
    candidates, every row not provably bounded by them over the whole vocabulary, each row
    keeping the draw its own data chooses): the tokens of the draw that asks the device which
    rows go which way, row for row, over every kind of row in one batch."""
    kinds = [SamplingParams(temperature=0), SamplingParams(temperature=1.0),
             SamplingParams(temperature=0.7, top_k=6), SamplingParams(temperature=1.3, top_p=0.8),
             SamplingParams(temperature=1.3, top_p=0.995), SamplingParams(temperature=0.9, min_p=0.08),
             SamplingParams(temperature=0.8, top_k=8, top_p=0.9, min_p=0.02),
             SamplingParams(temperature=1.0, top_k=300, min_p=0.001),
             SamplingParams(temperature=1.3, top_p=0.9, min_p=0.0005)]
    gen = torch.Generator().manual_seed(4321)
    params = [kinds[i % len(kinds)] for i in range(90)]
    logits = torch.stack([_logits(vocab, gen) * (0.5 + (i % 7) / 3) for i in range(len(params))])
    for trial in range(20):
        u = torch.rand(len(params), generator=gen)
        got = {}
        for sync_free in (False, True):
            meta = SamplingMetadata(_rows(params), torch.device("cpu"), vocab)
            got[sync_free] = draw(logits / meta.temperature[:, None], meta, u, sync_free=sync_free)
        assert torch.equal(got[True], got[False]), (trial, (got[True] != got[False]).nonzero().tolist())
    # the rows a GPU's metadata uploads are those draw() finds on the device when forced
    truncated = [not p.greedy and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0) for p in params]
    assert sync_free_rows(params, truncated, vocab) == (meta.cut_rows.tolist(), meta.maybe_full_rows.tolist())


def _reference_process(logits, params, prompts, histories, eos=None):
    """Straightforward per-row, per-token loops."""
    out = logits.clone()
    for i, p in enumerate(params):
        for t, b in p.logit_bias.items():
            out[i, t] += b
        if len(histories[i]) < p.min_tokens:
            for t in ((() if p.ignore_eos else eos[i]) if eos else (1,)) + tuple(p.stop_token_ids):  # 1: _rows' EOS
                out[i, t] = -math.inf
        seen = set(prompts[i]) | set(histories[i])
        for t in range(out.shape[1]):
            count = histories[i].count(t)
            if t in seen:
                v = out[i, t]
                out[i, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
            out[i, t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


def test_penalties_and_logit_bias_match_a_plain_reference():
    rng = random.Random(0)
    vocab, batch = 50, 12
    params, prompts, histories = [], [], []
    for i in range(batch):
        params.append(SamplingParams(
            presence_penalty=rng.uniform(-2, 2) if i % 3 else 0.0,
            frequency_penalty=rng.uniform(-2, 2) if i % 4 else 0.0,
            repetition_penalty=rng.uniform(0.5, 2.0) if i % 2 else 1.0,
            logit_bias={rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(rng.randint(0, 4))},
            min_tokens=rng.choice([0, 3, 10]) if i % 5 else 20, ignore_eos=i % 5 == 0, max_tokens=20,
            stop_token_ids=[rng.randrange(2, vocab) for _ in range(i % 3)]))
        prompts.append([rng.randrange(vocab) for _ in range(rng.randint(1, 10))])
        histories.append([rng.randrange(vocab) for _ in range(rng.randint(0, 15))])
    logits = torch.randn(batch, vocab)
    counts = TokenCounts(vocab, torch.device("cpu"), capacity=2)  # grows on the way
    eos = [((), (1,), (1, 2))[i % 3] for i in range(batch)]  # a model may name none, one or several
    rows = [SampleRow(f"r{i}", p, prompts[i] + histories[i], len(prompts[i]), eos[i])
            for i, p in enumerate(params)]
    meta = SamplingMetadata(rows, torch.device("cpu"), vocab, counts=counts)
    ours = process_logits(logits.clone(), meta)
    ref = _reference_process(logits, params, prompts, histories, eos)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    finite = ~torch.isinf(ref)
    assert torch.allclose(ours[finite], ref[finite], atol=1e-4)
    # counts are kept up to date in place: after a sample, a second step sees the new token
    ids, _ = sample(logits.clone(), meta, torch.Generator().manual_seed(0))
    for i, p in enumerate(params):
        if p.has_penalties:
            histories[i].append(ids[i].item())
    rows = [SampleRow(f"r{i}", p, prompts[i] + histories[i], len(prompts[i]), (1,))
            for i, p in enumerate(params)]
    meta = SamplingMetadata(rows, torch.device("cpu"), vocab, counts=counts)
    again = process_logits(logits.clone(), meta)
    ref = _reference_process(logits, params, prompts, histories)
    finite = ~torch.isinf(ref)
    assert torch.allclose(again[finite], ref[finite], atol=1e-4)


@pytest.mark.parametrize("feature", [{"logit_bias": {3: 50.0, 7: -50.0}}, {"min_tokens": 5}, {"presence_penalty": 1.5},
                                     {"frequency_penalty": -1.0}, {"repetition_penalty": 1.7}, {"logprobs": 2}])
def test_a_greedy_batch_with_one_processor_applies_it(feature):
    """Greedy rows skip the sampler's tensors only where nothing but an argmax is asked for."""
    vocab, rng = 20, random.Random(1)
    params = [SamplingParams(temperature=0, stop_token_ids=[5], max_tokens=20, **feature) for _ in range(4)]
    prompts = [[rng.randrange(vocab) for _ in range(6)] for _ in params]
    histories = [[rng.randrange(vocab) for _ in range(3)] for _ in params]
    rows = [SampleRow(f"r{i}", p, prompts[i] + histories[i], len(prompts[i]), (1,)) for i, p in enumerate(params)]
    meta = SamplingMetadata(rows, torch.device("cpu"), vocab, counts=TokenCounts(vocab, torch.device("cpu")))
    logits = torch.randn(len(params), vocab)
    logits[:, 3] = logits[:, 5] = logits[:, 1] = 10.0  # the biased, the stop and the EOS token lead
    ours, ref = process_logits(logits.clone(), meta), _reference_process(logits, params, prompts, histories)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    assert torch.allclose(ours[~torch.isinf(ref)], ref[~torch.isinf(ref)], atol=1e-4)
    assert meta.logprob_rows == ([0, 1, 2, 3] if "logprobs" in feature else [])
    assert not torch.equal(ours, logits) or "logprobs" in feature
    plain = SamplingMetadata(_rows([SamplingParams(temperature=0)] * 4), torch.device("cpu"), vocab)
    assert torch.equal(process_logits(logits.clone(), plain), logits)


def test_a_row_whose_masks_forbid_every_token_samples_no_token():
    """allowed_token_ids [EOS] with min_tokens (which holds EOS back), and allowed tokens that
    bad_words ban: NO_TOKEN for those rows, greedy or drawn, with logprobs or not; the other
    rows draw what they draw beside plain rows in the same places, with the same uniforms."""
    vocab = 40
    dead = [SamplingParams(temperature=0, allowed_token_ids=[1], min_tokens=2, logprobs=2),
            SamplingParams(temperature=1.0, top_k=5, allowed_token_ids=[1], min_tokens=1),
            SamplingParams(temperature=0.8, allowed_token_ids=[7, 8], bad_words=["a", "b"]).with_bad_words(
                lambda word: [7] if "a" in word else [8])]
    alive = [SamplingParams(temperature=0.9, top_p=0.8), SamplingParams(temperature=0, allowed_token_ids=[7, 9]),
             SamplingParams(temperature=1.2, logprobs=1, min_tokens=1)]
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(8))
    got = {}
    for name, first in (("dead", dead), ("plain", [SamplingParams(temperature=1.0)] * 3)):
        params = [first[0], alive[0], first[1], alive[1], first[2], alive[2]]
        cpu = torch.device("cpu")
        meta = SamplingMetadata(_rows(params), cpu, vocab, counts=TokenCounts(vocab, cpu))
        assert meta.may_mask_all
        ids, logprobs = sample(logits.clone(), meta, torch.Generator().manual_seed(1))
        got[name] = ids.tolist()
        assert len(logprobs) == (2 if name == "dead" else 1)
    assert [got["dead"][i] for i in (0, 2, 4)] == [NO_TOKEN] * 3
    assert [got["dead"][i] for i in (1, 3, 5)] == [got["plain"][i] for i in (1, 3, 5)]
    assert got["dead"][3] in (7, 9) and got["dead"][5] != 1
    plain = SamplingMetadata(_rows(alive), torch.device("cpu"), vocab)
    assert not SamplingMetadata(_rows([SamplingParams(temperature=0.5)]), torch.device("cpu"), vocab).may_mask_all
    assert plain.may_mask_all  # allowed tokens: the check runs, and finds no row dead
    assert NO_TOKEN not in sample(logits[:3].clone(), plain, torch.Generator().manual_seed(1))[0].tolist()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_request_whose_masks_forbid_every_token_fails_alone(tiny_model_dir, async_scheduling):
    """A request that no token can continue (allowed_token_ids that bad_words ban, EOS alone while
    min_tokens holds it back, at once or after some tokens, n = 2) ends with an error naming the
    fields; the requests beside it write what they write alone, and every block comes back."""
    from pageserve.runtime import LLM
    from pageserve.runtime.input_processor import InvalidRequest

    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=0.001, max_num_batched_tokens=32,
              debug_checks=True, async_scheduling=async_scheduling)
    engine = llm.engine
    eos = engine.config.model.eos_token_ids[0]
    word = engine.tokenizer.decode([300]).strip()
    assert engine.tokenizer.encode(word * 2, add_special_tokens=False) == [300, 300]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    fine = {f"ok{i}": ([5 + i, 6, 7], greedy) for i in range(3)}
    bad = {"banned": ([9, 9], SamplingParams(temperature=0, max_tokens=5, allowed_token_ids=[300],
                                             bad_words=[word])),
           "held": ([9, 8], SamplingParams(temperature=1.0, max_tokens=5, allowed_token_ids=[eos], min_tokens=1,
                                           n=2)),
           "later": ([9, 7], SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=[300],
                                            bad_words=[word * 2]))}  # "TheThe": [300, 300]
    for rid, (prompt, params) in {**fine, **bad}.items():
        engine.add_request(prompt, params, request_id=rid)
    done, failed = {}, {}
    for _ in range(100):
        outs = engine.step()
        failed.update(engine.take_failures())
        done.update({o.request_id: o.outputs[0].token_ids for o in outs if o.finished})
        if not engine.has_unfinished_requests():
            break
    engine.collect_in_flight()
    assert sorted(failed) == sorted(bad) and not set(done) & set(bad)
    assert all(isinstance(e, InvalidRequest) for e in failed.values())
    assert failed["banned"].param == "allowed_token_ids" and "bad_words" in str(failed["banned"])
    assert "min_tokens" in str(failed["held"]) and "output token 1:" in str(failed["held"])
    assert failed["held"].param == "allowed_token_ids"
    assert "output token 2:" in str(failed["later"])  # it wrote 300 first; then 300 again is banned
    alone = llm.generate([p for p, _ in fine.values()], greedy, use_tqdm=False)
    assert [done[rid] for rid in fine] == [o.outputs[0].token_ids for o in alone]
    assert_pool_clean(engine)


def test_same_seed_same_text_alone_and_in_a_mixed_batch_of_16(tiny_llm):
    target = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, ignore_eos=True, seed=4242,
                            presence_penalty=0.5)
    prompt = [5, 9, 13, 17, 21]
    alone = tiny_llm.generate(prompt, target, use_tqdm=False)[0].outputs[0].token_ids
    rng = random.Random(1)
    prompts, params = [], []
    for i in range(15):
        prompts.append([rng.randrange(3, 380) for _ in range(rng.randint(2, 60))])
        params.append(SamplingParams(temperature=rng.uniform(0.5, 1.5), max_tokens=rng.randint(5, 30),
                                     seed=rng.randrange(10 ** 6) if i % 2 else None, ignore_eos=True))
    outs = tiny_llm.generate(prompts[:7] + [prompt] + prompts[7:], params[:7] + [target] + params[7:],
                             use_tqdm=False)
    assert outs[7].outputs[0].token_ids == alone
    # an unseeded request does vary
    free = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    assert len({tuple(o.outputs[0].token_ids) for o in tiny_llm.generate([prompt] * 4, free, use_tqdm=False)}) > 1


def test_min_tokens_holds_back_eos_and_logit_bias_pushes_it(tiny_llm):
    eos = tiny_llm.engine.config.model.eos_token_ids[0]
    push = SamplingParams(temperature=0, max_tokens=20, logit_bias={eos: 100.0})
    out = tiny_llm.generate([5, 6, 7], push, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"
    held = SamplingParams(temperature=0, max_tokens=20, logit_bias={eos: 100.0}, min_tokens=5)
    out = tiny_llm.generate([5, 6, 7], held, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.token_ids[-1] == eos and eos not in out.token_ids[:5]
    banned = SamplingParams(temperature=0, max_tokens=20, logit_bias={eos: -100.0}, min_tokens=1)
    out = tiny_llm.generate([5, 6, 7], banned, use_tqdm=False)[0].outputs[0]
    assert eos not in out.token_ids and out.finish_reason == "length"


def _peak_blocks(engine, prompts, params) -> int:
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    peak = 0
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
        free, cached, in_use = engine.kv.pool.counts()
        peak = max(peak, in_use)
    return peak, outs


def test_n_sequences_share_the_prompt_blocks(tiny_model_dir):
    from pageserve.runtime import LLM

    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=0.01, enable_prefix_caching=False,
              debug_checks=True)
    prompt = list(range(3, 3 + 101))  # 6 full blocks and a partial one
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=7,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    forked, outs = _peak_blocks(llm.engine, [prompt], [SamplingParams(**{**_fields(params), "n": 4})])
    assert len(outs) == 1 and [c.index for c in outs[0].outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 10 for c in outs[0].outputs)
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1
    separate, _ = _peak_blocks(llm.engine, [prompt] * 4, [params] * 4)
    assert forked < separate, (forked, separate)
    assert forked == 6 + 4  # the full blocks once, a copied partial block each
    assert_pool_clean(llm.engine)
    # greedy n=2: both sequences equal the n=1 answer (the forked copy holds the right KV)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    two = llm.generate(prompt, SamplingParams(**{**_fields(greedy), "n": 2}), use_tqdm=False)[0]
    assert [c.token_ids for c in two.outputs] == [one, one]


def _fields(p: SamplingParams) -> dict:
    return {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.init}


def test_logprobs_match_hf_log_softmax_on_the_default_model():
    """Tolerance: 2e-3 in log-probability, both sides in float32."""
    from transformers import AutoModelForCausalLM

    from pageserve.runtime import LLM
    from pageserve.runtime.models.gguf_file import dense_copy
    from pageserve.runtime.models.loader import resolve_model

    path = resolve_model(None)
    llm = LLM(dtype="float32", kv_cache_memory=0.1, max_model_len=512)
    prompt = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog because")
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    ids = prompt + out.outputs[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(dense_copy(path), torch_dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    # vLLM's shape: per position {token id: Logprob}, the prompt / sampled token first
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        d = out.prompt_logprobs[pos]
        assert next(iter(d)) == prompt[pos]
        assert abs(d[prompt[pos]].logprob - ref[pos - 1, prompt[pos]].item()) < 2e-3
        top3 = ref[pos - 1].topk(3).indices.tolist()
        assert {t: d[t].rank for t in top3} == {t: r for r, t in enumerate(top3, 1)}
    for j, d in enumerate(out.outputs[0].logprobs):
        row = ref[len(prompt) - 1 + j]
        token = ids[len(prompt) + j]
        assert next(iter(d)) == token and d[token].rank == 1  # greedy: the top token
        assert abs(d[token].logprob - row[token].item()) < 2e-3
        top = row.topk(5)
        assert len(d) == 5 and {t: d[t].rank for t in top.indices.tolist()} == {
            t: r for r, t in enumerate(top.indices.tolist(), 1)}
        assert max(abs(d[t].logprob - r) for t, r in zip(top.indices.tolist(), top.values.tolist())) < 2e-3


def test_seeded_row_draws_the_same_beside_any_batch():
    gen = torch.Generator().manual_seed(3)
    seeded = SamplingParams(temperature=1.0, min_p=0.001, seed=99)
    other = SamplingParams(temperature=1.0, top_k=300)
    for trial in range(20):
        logits = torch.randn(1, 2000, generator=gen) * 2
        draws = []
        for batch in ([seeded], [seeded, other], [other, other, seeded]):
            rows = _rows(batch)
            i = batch.index(seeded)
            own = {i: torch.Generator().manual_seed(1000 + trial)}
            meta = SamplingMetadata(rows, torch.device("cpu"), 2000, own)
            ids, _ = sample(logits.repeat(len(batch), 1), meta, torch.Generator().manual_seed(trial))
            draws.append(ids[i].item())
        assert len(set(draws)) == 1, draws


def test_forked_sequences_stay_right_under_preemption(tiny_model_dir):
    """n = 3 requests in a pool far too small: children are preempted (swapped or recomputed)
    right after their fork; every greedy sequence still equals the n = 1 answer."""
    from pageserve.runtime import LLM

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randint(20, 40))] for _ in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    big = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=0.01, max_model_len=128)
    expected = [o.outputs[0].token_ids for o in big.generate(prompts, greedy, use_tqdm=False)]
    for mode in ("swap", "recompute"):
        small = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=0.00019, max_model_len=128,
                    swap_space=0.0001, preemption_mode=mode, enable_prefix_caching=False, debug_checks=True)
        outs = small.generate(prompts, SamplingParams(**{**_fields(greedy), "n": 3}), use_tqdm=False)
        assert small.engine.scheduler.num_preemptions > 0
        for out, want in zip(outs, expected):
            assert [c.token_ids for c in out.outputs] == [want] * 3
        assert_pool_clean(small.engine)


def test_the_c_argmax_is_torchs(native_kernels):
    """The CPU backend's greedy pick (cpu_kernels.c's argmax; torch's took 4 ms over 64 rows of
    49k logits): torch's index for ties across lanes and in the tail, all -inf rows, rows
    shorter than a vector, strided rows, batches below the threaded size; a NaN anywhere
    (first, mid-vector, in the tail) leaves the answer to torch."""
    from pageserve.runtime.kernels import TorchKernels

    lib = native_kernels
    gen = torch.Generator().manual_seed(0)
    for vocab in (1, 5, 8, 13, 49152, 49155):
        x = torch.randn(9, vocab, generator=gen)
        x[1] = float("-inf")
        x[2, vocab // 2:] = x[2].max() + 1  # equal maxima: the first wins
        x[3, -1] = x[3].max() + 1  # the tail past the last full vector
        x[4] = 0.0
        x[5, ::3] = 7.0
        assert torch.equal(lib.argmax(x), x.argmax(dim=-1)), vocab
        wide = torch.randn(4, vocab + 3, generator=gen)
        assert torch.equal(lib.argmax(wide[:, :vocab]), wide[:, :vocab].argmax(dim=-1))
        assert torch.equal(lib.argmax(x[:2]), x[:2].argmax(dim=-1))  # one thread
        for at in {0, vocab // 2, vocab - 1}:
            y = x[:2].clone()
            y[1, at] = float("nan")
            assert lib.argmax(y) is None, at
        x[6, vocab - 1] = float("nan")
        assert lib.argmax(x) is None
        backend = TorchKernels(16, 4, 4)
        backend.cpu_lib = lib
        assert torch.equal(backend.argmax(x), x.argmax(dim=-1))  # torch's NaN answer
