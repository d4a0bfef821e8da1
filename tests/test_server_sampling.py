"""The sampling surface through the API, read with the official openai client: n choices
(streamed with their index), chat and completions logprobs, echo, seeds, penalties."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

pytestmark = pytest.mark.server


def _client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


MESSAGES = [{"role": "user", "content": "Give me a name for a cat."}]


def test_n_choices_whole_and_streamed(server):
    client = _client(server)
    whole = client.chat.completions.create(model=server.model, messages=MESSAGES, n=4, max_tokens=12,
                                           temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    texts = [c.message.content for c in whole.choices]
    assert len(set(texts)) > 1
    assert whole.usage.completion_tokens == 4 * 12
    streamed = ["", "", "", ""]
    finished = set()
    for chunk in client.chat.completions.create(model=server.model, messages=MESSAGES, n=4, max_tokens=12,
                                                temperature=1.0, seed=11, stream=True,
                                                extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2, 3}
    assert streamed == texts  # the same seed: the same four answers
    server.wait_idle()


def test_chat_logprobs_shape_and_values(server):
    client = _client(server)
    r = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content).startswith(r.choices[0].message.content[:3])
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob == t.logprob  # greedy: the chosen token is the top one
        assert bytes(t.bytes).decode("utf-8", errors="replace") == t.token
        assert sum(math.exp(x.logprob) for x in t.top_logprobs) <= 1.0001
    streamed = []
    for chunk in client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=6,
                                                temperature=0, logprobs=True, top_logprobs=3, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(t.token, round(t.logprob, 4)) for t in content]


def test_completion_logprobs_with_echo(server):
    client = _client(server)
    prompt = "The capital of France is"
    r = client.completions.create(model=server.model, prompt=prompt, max_tokens=4, temperature=0,
                                  logprobs=2, echo=True)
    lp = r.choices[0].logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 4 == len(lp.token_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == r.choices[0].text and r.choices[0].text.startswith(prompt)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert all(len(top) >= 2 for top in lp.top_logprobs[n_prompt:])


def test_prompt_logprobs_as_vllm_gives_them(server):
    """vLLM's prompt_logprobs on completions: None for the first prompt token, then a map of
    token id -> logprob, rank and text, the prompt's own token first; the same values echo's
    logprobs give, whole and on each choice's first streamed piece."""
    client = _client(server)
    prompt = "The capital of France is"
    r = client.completions.create(model=server.model, prompt=prompt, max_tokens=3, temperature=0, n=2,
                                  extra_body={"prompt_logprobs": 2})
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    echo = client.completions.create(model=server.model, prompt=prompt, max_tokens=1, temperature=0, logprobs=2,
                                     echo=True).choices[0].logprobs
    for choice in r.choices:
        plp = choice.model_extra["prompt_logprobs"]
        assert len(plp) == len(ids) and plp[0] is None
        for i, (tid, entry) in enumerate(zip(ids[1:], plp[1:]), 1):
            own = entry[str(tid)]
            assert next(iter(entry)) == str(tid) and len(entry) == (2 if own["rank"] <= 2 else 3)
            assert {1, 2} <= {e["rank"] for e in entry.values()}
            assert own["logprob"] == pytest.approx(echo.token_logprobs[i], abs=1e-5)
            assert own["decoded_token"] == echo.tokens[i]
    # asked for beside echo's logprobs, prompt_logprobs' own count wins (as in vLLM)
    both = client.completions.create(model=server.model, prompt=prompt, max_tokens=1, temperature=0, logprobs=1,
                                     echo=True, extra_body={"prompt_logprobs": 3}).choices[0].model_extra
    assert all(len(e) in (3, 4) for e in both["prompt_logprobs"][1:])
    # streamed: on the first piece sent, also where a stop string holds the first text back
    forced = ids[-1]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": [forced]}).json()["prompt"]
    for stop in (None, [text * 3 + "\u00a7"]):
        chunks = list(client.completions.create(model=server.model, prompt=prompt, max_tokens=3, temperature=0,
                                                stream=True, stop=stop, logit_bias={str(forced): 100},
                                                extra_body={"prompt_logprobs": 1}))
        firsts = [c.choices[0].model_extra.get("prompt_logprobs") for c in chunks if c.choices]
        assert firsts[0] is not None and len(firsts[0]) == len(ids) and all(f is None for f in firsts[1:]), stop


def test_seed_penalties_and_bias_through_the_api(server):
    client = _client(server)

    def ask(**kw):
        return client.completions.create(model=server.model, prompt="List some fruits:", max_tokens=24,
                                         **kw).choices[0].text
    assert ask(temperature=1.0, seed=5) == ask(temperature=1.0, seed=5)
    plain = ask(temperature=0)
    penalized = ask(temperature=0, frequency_penalty=2.0, presence_penalty=2.0)
    assert plain != penalized
    comma = httpx.post(f"{server.url}/tokenize", json={"prompt": ",", "add_special_tokens": False}).json()["tokens"][0]
    assert "," not in ask(temperature=0, logit_bias={str(comma): -100})
    extra = ask(temperature=0, extra_body={"top_k": 1, "min_p": 0.1, "repetition_penalty": 1.3,
                                           "min_tokens": 24, "ignore_eos": False})
    assert extra
    server.wait_idle()
