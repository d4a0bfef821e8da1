"""The offline API's log-probabilities in vLLM's shape: per position a dict token id -> Logprob
(logprob, rank, decoded_token), the sampled or prompt token first, then the top ones ranked
1, 2, ...; prompt_logprobs starts with None. Checked against the server's logprobs for the same
greedy request on the tiny model, and a token's rank against its place in the model's own
distribution."""

from __future__ import annotations

import httpx
import pytest

from pageserve.runtime.outputs import Logprob
from pageserve.sampling.params import SamplingParams

pytestmark = pytest.mark.server

PROMPT = "Paged attention keeps the KV cache in fixed-size blocks."


def by_rank(position: dict[int, Logprob]) -> list[int]:
    return sorted(position, key=lambda t: position[t].rank)


def test_greedy_logprobs_have_vllms_shape_and_match_the_server(tiny_llm, tiny_server):
    ids = tiny_llm.tokenizer.encode(PROMPT)
    n, k = len(ids), 3
    out = tiny_llm.generate(ids, SamplingParams(temperature=0, max_tokens=6, logprobs=k, prompt_logprobs=k,
                                                ignore_eos=True), use_tqdm=False)[0]
    r = httpx.post(f"{tiny_server.url}/v1/completions", timeout=60, json={
        "model": tiny_server.model, "prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
        "logprobs": k, "echo": True})
    assert r.status_code == 200, r.text
    server = r.json()["choices"][0]["logprobs"]
    tokens = ids + out.outputs[0].token_ids
    positions = out.prompt_logprobs + out.outputs[0].logprobs
    assert len(out.prompt_logprobs) == n and len(positions) == len(server["tokens"]) == n + 6
    assert positions[0] is None and server["token_logprobs"][0] is None  # nothing before the first
    injected = 0
    for i in range(1, n + 6):
        position, token = positions[i], tokens[i]
        assert isinstance(position, dict) and all(isinstance(e, Logprob) for e in position.values())
        assert next(iter(position)) == token  # the prompt / sampled token first, as vLLM
        chosen = position[token]
        assert chosen.decoded_token == server["tokens"][i]
        assert chosen.logprob == pytest.approx(server["token_logprobs"][i], abs=1e-4)
        top = [t for t in by_rank(position) if position[t].rank <= k]
        assert [position[t].rank for t in top] == [1, 2, 3]
        assert all(position[a].logprob >= position[b].logprob for a, b in zip(top, top[1:]))
        if token in top:
            assert len(position) == k
        else:  # injected beside the top k, with its rank in the whole vocabulary
            injected += 1
            assert len(position) == k + 1 and chosen.rank > k
            assert chosen.logprob <= position[top[-1]].logprob
        expected = {position[t].decoded_token: position[t].logprob for t in top}
        expected.setdefault(chosen.decoded_token, chosen.logprob)  # OpenAI's map holds the chosen one
        assert server["top_logprobs"][i].keys() == expected.keys()
        assert all(server["top_logprobs"][i][text] == pytest.approx(lp, abs=1e-4) for text, lp in expected.items())
        if i >= n:
            assert chosen.rank == 1  # greedy
    assert injected > 0  # the random model ranks most prompt tokens low: the injected path ran


def test_a_prompt_tokens_rank_is_its_place_in_the_whole_distribution(tiny_llm):
    ids = tiny_llm.tokenizer.encode(PROMPT)
    few = tiny_llm.generate(ids, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    many = tiny_llm.generate(ids, SamplingParams(max_tokens=1, prompt_logprobs=20), use_tqdm=False)[0]
    checked = 0
    for i in range(1, len(ids)):
        rank = few.prompt_logprobs[i][ids[i]].rank
        ranked = by_rank(many.prompt_logprobs[i])
        ranked = [t for t in ranked if many.prompt_logprobs[i][t].rank <= 20]
        if rank <= 20:
            assert ranked[rank - 1] == ids[i]
            checked += 1
        else:
            assert ids[i] not in ranked
    assert checked > 0


def test_a_forced_tokens_rank_and_logprob_are_the_models_own(tiny_llm):
    """logit_bias picks the fifth most likely token; its log-probability and rank are those of the
    model's distribution before the bias (vLLM's default raw log-probabilities)."""
    ids = tiny_llm.tokenizer.encode("The quick brown fox")
    first = tiny_llm.generate(ids, SamplingParams(temperature=0, max_tokens=1, logprobs=10),
                              use_tqdm=False)[0].outputs[0].logprobs[0]
    ranked = by_rank(first)
    assert [first[t].rank for t in ranked[:10]] == list(range(1, 11))
    fifth = ranked[4]
    forced = tiny_llm.generate(ids, SamplingParams(temperature=0, max_tokens=1, logprobs=2,
                                                   logit_bias={fifth: 100.0}), use_tqdm=False)[0].outputs[0]
    assert forced.token_ids == [fifth]
    position = forced.logprobs[0]
    assert list(position) == [fifth, ranked[0], ranked[1]]
    assert [position[t].rank for t in position] == [5, 1, 2]
    assert position[fifth].logprob == pytest.approx(first[fifth].logprob, abs=1e-5)
    assert position[fifth].decoded_token == first[fifth].decoded_token != ""


def test_every_sequence_of_n_gets_the_shape(tiny_llm):
    out = tiny_llm.generate(tiny_llm.tokenizer.encode(PROMPT), SamplingParams(
        n=2, temperature=1.0, seed=7, max_tokens=4, logprobs=1, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_logprobs is None and len(out.outputs) == 2
    for c in out.outputs:
        assert [next(iter(p)) for p in c.logprobs] == c.token_ids
        assert all(1 <= len(p) <= 2 and min(e.rank for e in p.values()) == 1 for p in c.logprobs)
