"""vLLM's request extras beyond OpenAI's fields: allowed_token_ids, bad_words and
truncate_prompt_tokens, in the sampler, the engine and through the API (the default model, so
that words and spaces tokenize as they do in use)."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from pageserve.sampling.params import SamplingParams

MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.mark.unit
def test_bad_words_tokenized_with_and_without_a_space_and_matched_on_the_output_s_tail():
    vocab = {"cat": [1], " cat": [2], "big dog": [3, 4], " big dog": [5, 4], "ox": [6], " ox": [7, 6],
             "rainbow": [10, 11], " rainbow": [12]}
    given = SamplingParams(bad_words=["cat", " big dog", "ox", "rainbow"])
    p = given.with_bad_words(lambda text: vocab[text])
    # a copy: the caller's params may go to another engine with another tokenizer
    assert p is not given and not given.bad_words_token_ids
    assert given.with_bad_words(lambda text: [7]).bad_words_token_ids == ((7,),) * 4
    # " ox" is a space's token and then "ox"'s: banning "ox" covers it
    assert p.bad_words_token_ids == ((1,), (2,), (3, 4), (5, 4), (6,), (10, 11), (12,)) and p.bans_by_context
    prompt = [9, 3]  # a word's first token in the prompt does not count
    assert sorted(p.banned_after(prompt, 2)) == [1, 2, 6, 12]
    assert sorted(p.banned_after(prompt + [8, 5], 2)) == [1, 2, 4, 6, 12]
    assert sorted(p.banned_after(prompt + [10], 2)) == [1, 2, 6, 11, 12]
    assert not p.plain_greedy and not SamplingParams(temperature=0).bad_words_token_ids


@pytest.mark.unit
@pytest.mark.parametrize("kw, message", [
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
    (dict(allowed_token_ids=5), "allowed_token_ids"), (dict(bad_words=["  "]), "bad_words"),
])
def test_bad_values_are_refused_by_name(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)


@pytest.mark.unit
def test_the_last_tokens_of_a_long_text_are_read_from_its_tail():
    """A text far longer than the context: its last tokens, the tokenizer's BOS first as a
    tokenizer truncating on the left keeps it, read from a tail a fraction of the text."""
    from pageserve.runtime.input_processor import InputProcessor

    inputs = InputProcessor(None, 1000, 2048, 8, None)
    text = " ".join(f"w{i}" for i in range(10_000))
    read = []

    def encode(t: str) -> list[int]:  # a BOS, then one token a word
        read.append(len(t))
        return [0] + [int(w[1:]) + 1 if w[1:].isdigit() else 10**6 for w in t.split(" ") if w]
    assert inputs.last_tokens(text, 100, encode) == [0] + list(range(9902, 10_001))
    assert max(read) < len(text) / 10
    assert inputs.last_tokens("w1 w2", 100, encode) == [0, 2, 3]
    assert inputs.last_tokens("w1 w2 w3", 5, encode) == [0, 2, 3, 4]  # fewer than N: all of them
    assert inputs.last_tokens(text, 100, lambda t: encode(t)[1:]) == list(range(9901, 10_001))  # no BOS
    assert inputs.last_tokens(text.replace(" ", "\n"), 100, lambda t: encode(t.replace("\n", " "))) == \
        [0] + list(range(9902, 10_001))  # lines cut as well as spaces
    # specials on both ends (BERT's [CLS] ... [SEP]) both kept
    assert inputs.last_tokens(text, 100, lambda t: encode(t) + [-1]) == [0] + list(range(9903, 10_001)) + [-1]
    with pytest.raises(ValueError, match="no whitespace"):  # one run longer than a tail may be
        inputs.last_tokens("x " + "=" * (2 << 20), 100, encode)


@pytest.mark.unit
def test_the_last_tokens_of_a_run_without_spaces_are_the_whole_text_s(server):
    """A run BPE merges from its start ('=' x 20,001 on SmolLM2's tokenizer, or 1,000 line
    breaks): no tail cut inside it gives its tokens, so it is read from before it."""
    engine = server.engine
    for text in ("=" * 20_001, "a" * 20_001, "say " + "=" * 5001 + " then 12345678901234567890 " * 50,
                 "start " + "\n" * 1000 + " tail words", "start" + " " * 1001 + "tail"):  # cut before a run
        whole = engine.tokenize(text)
        assert engine.tokenize(text, keep_last=10) == whole[-10:], text[:20]


@pytest.mark.server
def test_allowed_token_ids_bound_every_sampled_token(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    allowed = server.engine.tokenize(" red green blue", add_special_tokens=False)
    assert len(allowed) == 3
    for temperature in (0.0, 1.0):
        r = client.completions.create(model=server.model, prompt="Colours:", max_tokens=12, temperature=temperature,
                                      seed=3, extra_body={"allowed_token_ids": allowed})
        assert r.usage.completion_tokens == 12 and re.fullmatch("( red| green| blue)+", r.choices[0].text), r


@pytest.mark.server
def test_masks_that_forbid_every_token_are_a_400_and_the_server_serves_on(server):
    """allowed_token_ids that bad_words ban: a 400 naming allowed_token_ids (an error event when
    streamed), and the next request is answered."""
    url = f"{server.url}/v1/completions"
    allowed = server.engine.tokenize(" red", add_special_tokens=False)
    body = {"model": server.model, "prompt": "Colours:", "max_tokens": 5, "allowed_token_ids": allowed,
            "bad_words": ["red"]}
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "allowed_token_ids" and "bad_words" in error["message"], error
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["param"] == "allowed_token_ids", lines
    ok = httpx.post(url, json={**body, "bad_words": []}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == " red" * 5


@pytest.mark.server
def test_bad_words_are_never_written_and_change_nothing_before_them(server):
    """The greedy answer without the word, then with it banned: the same tokens up to where the
    word would have been finished, and the word nowhere."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)

    def ask(**extra):
        r = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=40, temperature=0,
                                           logprobs=True, extra_body=extra)
        return r.choices[0].message.content, [e.token for e in r.choices[0].logprobs.content]
    text, tokens = ask()
    word = next(w.strip(".,") for w in text.split() if len(w.strip(".,")) > 3)  # a word the model writes
    banned, banned_tokens = ask(bad_words=[word])
    assert word not in banned, (word, banned)
    at = text.index(word)
    same = 0
    while same < len(tokens) and len("".join(tokens[:same + 1])) <= at:
        same += 1
    assert banned_tokens[:same] == tokens[:same]


@pytest.mark.server
def test_truncate_prompt_tokens_keeps_the_prompt_s_end(server):
    long_text = "The story so far: " + "and then nothing happened " * 2000 + "The end is"  # ~10k tokens
    url = f"{server.url}/v1"

    def post(route: str, **body) -> httpx.Response:
        return httpx.post(f"{url}/{route}", json={"temperature": 0, **body}, timeout=60)
    r = post("completions", prompt=long_text, max_tokens=4)
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    whole = server.engine.tokenize(long_text)
    r = post("completions", prompt=long_text, max_tokens=4, truncate_prompt_tokens=50, echo=True)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 50, r.text
    same = post("completions", prompt=whole[-50:], max_tokens=4).json()["choices"][0]["text"]
    assert r.json()["choices"][0]["text"] == server.state.detokenize(whole[-50:]) + same  # echoed: what it read
    r = post("completions", prompt=[whole[-300:], whole[-20:]], max_tokens=4, truncate_prompt_tokens=49)
    assert r.json()["usage"]["prompt_tokens"] == 49 + 20, r.text
    message = {"messages": [{"role": "user", "content": long_text}], "max_tokens": 2}
    r = post("chat/completions", **message, truncate_prompt_tokens=-1)
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]  # no room left
    r = post("chat/completions", **message, truncate_prompt_tokens=64)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 64, r.text
    r = post("embeddings", input=[long_text, "short"], truncate_prompt_tokens=32)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 32 + 1, r.text
    for bad in (0, 4096, -2):
        r = post("completions", prompt="hi", truncate_prompt_tokens=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


@pytest.mark.server
@pytest.mark.parametrize("route, field, value", [
    ("completions", "use_beam_search", True), ("chat/completions", "use_beam_search", True),
    ("completions", "logits_processors", ["my.module:Processor"]),
    ("chat/completions", "chat_template", "{{ messages }}"),
    ("completions", "guided_grammar", "root ::= 'a'"), ("chat/completions", "guided_grammar", "root ::= 'a'"),
])
def test_what_would_change_the_output_unseen_is_refused_by_name(server, route, field, value):
    body = {"prompt": "hi"} if route == "completions" else {"messages": MESSAGES}
    r = httpx.post(f"{server.url}/v1/{route}", json={**body, "max_tokens": 2, field: value}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    unset = False if value is True else None
    assert httpx.post(f"{server.url}/v1/{route}", json={**body, "max_tokens": 2, field: unset},
                      timeout=60).status_code == 200


@pytest.mark.server
@pytest.mark.parametrize("key", ["grammar", "structural_tag"])
def test_grammars_and_structural_tags_are_refused_by_name(server, key):
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "prompt": "hi", "max_tokens": 2, "structured_outputs": {key: "root ::= 'a'"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == f"structured_outputs.{key}", r.text


@pytest.mark.unit
def test_documents_reach_the_template(server):
    import copy

    from pageserve.app.chat import render_chat, template_kwargs
    from pageserve.app.protocol import ChatCompletionRequest

    tokenizer = copy.copy(server.state.tokenizer)
    tokenizer.chat_template = ("{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
                               "{% for m in messages %}{{ m.content }}{% endfor %}")
    body = ChatCompletionRequest.model_validate({"messages": MESSAGES, "documents": [
        {"title": "Spectrum", "text": "seven colours"}], "chat_template_kwargs": {"other": 1}})
    assert render_chat(tokenizer, body.messages, template_kwargs=template_kwargs(body)).startswith(
        "[Spectrum: seven colours]Name three")


@pytest.mark.unit
def test_developer_messages_are_system_messages_where_the_template_knows_no_developer(server):
    """OpenAI's `developer` role (newer models' system role; Codex and the AI SDK send it) goes
    to a template as `system`, unless the template has a role of that name itself."""
    import copy

    from pageserve.app.chat import render_chat
    from pageserve.app.protocol import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate({"messages": [{"role": "developer", "content": "Be brief."},
                                                              *MESSAGES]})
    tokenizer = copy.copy(server.state.tokenizer)  # SmolLM2's: its own system prompt where none is given
    assert render_chat(tokenizer, body.messages).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    tokenizer.chat_template = ("{% for m in messages %}{% if m.role == 'developer' %}[dev]{% endif %}"
                               "<{{ m.role }}>{{ m.content }}{% endfor %}")
    assert render_chat(tokenizer, body.messages).startswith("[dev]<developer>Be brief.<user>")


def _events(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.server
def test_return_token_ids_whole_and_streamed(server):
    """The prompt's token ids and each choice's, where vLLM puts them: completions' on the choice,
    chat's prompt ids on the response (the first chunk when streamed); streamed pieces' ids add up
    to the whole answer's."""
    url = f"{server.url}/v1"
    body = {"prompt": "Colours of the rainbow:", "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    whole = httpx.post(f"{url}/completions", json=body, timeout=60).json()
    choice = whole["choices"][0]
    assert choice["prompt_token_ids"] == server.engine.tokenize(body["prompt"])
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"] == 12
    assert server.state.detokenize(choice["token_ids"]) == choice["text"]
    events = _events(f"{url}/completions", body)
    assert events[0]["choices"][0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert [t for e in events for c in e["choices"] for t in c["token_ids"]] == choice["token_ids"]
    assert all("prompt_token_ids" not in c for e in events[1:] for c in e["choices"])

    chat = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    whole = httpx.post(f"{url}/chat/completions", json=chat, timeout=60).json()
    rendered = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}, timeout=60).json()["tokens"]
    assert whole["prompt_token_ids"] == rendered and len(whole["choices"][0]["token_ids"]) == 12
    events = _events(f"{url}/chat/completions", chat)
    assert events[0]["prompt_token_ids"] == rendered and all("prompt_token_ids" not in e for e in events[1:])
    assert [t for e in events for c in e["choices"] for t in c["token_ids"]] == whole["choices"][0]["token_ids"]
    plain = httpx.post(f"{url}/chat/completions", json={**chat, "return_token_ids": None}, timeout=60).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


@pytest.mark.server
def test_return_tokens_as_token_ids_names_logprob_entries_by_id(server):
    url = f"{server.url}/v1"
    body = {"max_tokens": 6, "temperature": 0, "return_token_ids": True, "return_tokens_as_token_ids": True}
    r = httpx.post(f"{url}/completions", json={**body, "prompt": "Hello", "logprobs": 2}, timeout=60).json()
    lp, ids = r["choices"][0]["logprobs"], r["choices"][0]["token_ids"]
    assert lp["tokens"] == [f"token_id:{t}" for t in ids]
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"] for k in top)
    assert lp["text_offset"][-1] == len(server.state.detokenize(ids[:-1]))  # offsets still count the text
    r = httpx.post(f"{url}/chat/completions", json={**body, "messages": MESSAGES, "logprobs": True,
                                                     "top_logprobs": 2}, timeout=60).json()
    content, ids = r["choices"][0]["logprobs"]["content"], r["choices"][0]["token_ids"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in ids]
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    assert all(t["token"].startswith("token_id:") for e in content for t in e["top_logprobs"])
