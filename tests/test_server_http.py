"""The real server on the default model, checked at the HTTP level with httpx: SSE framing,
usage, Chinese text, disconnects, embeddings, tokenize, and bad requests."""

from __future__ import annotations

import base64
import json
import struct

import httpx
import pytest

pytestmark = pytest.mark.server


def _chat_body(server, content, **kw):
    return {"model": server.model, "messages": [{"role": "user", "content": content}],
            "temperature": 0, "max_tokens": 24, **kw}


def _sse_events(raw: str) -> list[str]:
    """Split a raw SSE body into its data payloads, checking the framing on the way."""
    assert raw.endswith("data: [DONE]\n\n")
    events = []
    for block in raw.split("\n\n")[:-1]:
        if block.startswith(":"):  # a keep-alive comment
            continue
        assert block.startswith("data: ") and "\n" not in block, repr(block)
        events.append(block[len("data: "):])
    return events


def test_sse_framing_role_content_finish_usage_done(server):
    body = _chat_body(server, "Name a color.", stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = _sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    for c in chunks:
        assert c["object"] == "chat.completion.chunk" and c["model"] == server.model
        assert isinstance(c["created"], int)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1 and finish[0]["choices"][0]["delta"] == {}
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] > 0
    assert all(c["usage"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    whole = httpx.post(f"{server.url}/v1/chat/completions", json=_chat_body(server, "Name a color."),
                       timeout=60).json()
    assert text == whole["choices"][0]["message"]["content"]
    # the same counts; the cached share may differ (the second request finds the first's blocks)
    details = [u.pop("prompt_tokens_details") for u in (usage_chunk["usage"], whole["usage"])]
    assert usage_chunk["usage"] == whole["usage"]
    assert all(d["cached_tokens"] % 16 == 0 and d["cached_tokens"] < whole["usage"]["prompt_tokens"]
               for d in details)
    u = whole["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    # the prompt count is the templated prompt's length, as /tokenize tells it
    tok = httpx.post(f"{server.url}/tokenize", json={"messages": body["messages"]}).json()
    assert u["prompt_tokens"] == tok["count"]


def test_no_usage_chunk_unless_asked(server):
    with httpx.stream("POST", f"{server.url}/v1/chat/completions",
                      json=_chat_body(server, "Hi", stream=True, max_tokens=4), timeout=60) as r:
        chunks = [json.loads(e) for e in _sse_events(r.read().decode())[:-1]]
    assert all("usage" not in c for c in chunks) and all(c["choices"] for c in chunks)


def test_chinese_streamed_equals_whole_without_replacement_chars(server):
    body = _chat_body(server, "请用中文写一句关于春天的话，加上一个表情符号。", max_tokens=48)
    whole = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    text = whole["choices"][0]["message"]["content"]
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True},
                      timeout=60) as r:
        chunks = [json.loads(e) for e in _sse_events(r.read().decode())[:-1]]
    pieces = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    assert "".join(pieces) == text
    assert "\ufffd" not in text and all("\ufffd" not in p for p in pieces)
    assert any(ord(ch) > 0x2E80 for ch in text), text  # the model did answer with CJK


def test_completions_stream_with_several_prompts_and_echo(server):
    body = {"model": server.model, "prompt": ["One, two,", "Red, green,"], "max_tokens": 6,
            "temperature": 0, "echo": True}
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    assert whole["choices"][0]["text"].startswith("One, two,")
    assert whole["usage"]["completion_tokens"] == 12
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True},
                      timeout=60) as r:
        chunks = [json.loads(e) for e in _sse_events(r.read().decode())[:-1]]
    texts = ["", ""]
    for c in chunks:
        texts[c["choices"][0]["index"]] += c["choices"][0]["text"]
    assert texts == [c["text"] for c in whole["choices"]]
    # token ids as the prompt give the same answer as the text they encode
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "One, two,"}).json()["tokens"]
    by_ids = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": server.model, "prompt": ids, "max_tokens": 6, "temperature": 0}).json()
    assert "One, two," + by_ids["choices"][0]["text"] == whole["choices"][0]["text"]


BREAKS = "one\u2028two\u2029three\x85four"


def test_unicode_line_breaks_are_escaped_in_every_json(server):
    """U+2028, U+2029 and U+0085 are legal raw in JSON, but a client that splits the stream
    the way str.splitlines does (httpx's iter_lines) would cut the event in two: echoed, they
    come back escaped, streamed or whole, and decode to the same text."""
    body = {"model": server.model, "prompt": BREAKS, "max_tokens": 3, "temperature": 0, "echo": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1])
    assert text.startswith(BREAKS)
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    for raw in ("\u2028", "\u2029", "\x85"):
        assert raw.encode() not in whole.content
    assert whole.json()["choices"][0]["text"] == text
    error = httpx.post(f"{server.url}/v1/completions", json={**body, "model": BREAKS}, timeout=60)
    assert error.status_code == 404 and b"\xe2\x80\xa8" not in error.content
    assert BREAKS in error.json()["error"]["message"]


def test_stop_string_never_leaks_into_the_stream(server):
    prompt = "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"
    base = {"model": server.model, "prompt": prompt, "max_tokens": 30, "temperature": 0}
    free = httpx.post(f"{server.url}/v1/completions", json=base, timeout=60).json()["choices"][0]["text"]
    assert " 15," in free, free  # the stop string below does occur when nothing stops it
    for include in (False, True):
        body = {**base, "stop": [" 15,"], "include_stop_str_in_output": include, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            chunks = [json.loads(e) for e in _sse_events(r.read().decode())[:-1]]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        expected = free[:free.index(" 15,")] + (" 15," if include else "")
        assert text == expected
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        assert chunks[-1]["choices"][0]["stop_reason"] == " 15,"


def test_stream_disconnect_aborts_and_frees_blocks(server):
    engine = server.engine
    server.wait_idle()
    body = _chat_body(server, "Tell me a long story.", stream=True, max_tokens=1000, ignore_eos=True)
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(5):
                next(l for l in lines if l.startswith("data: "))
            assert engine.requests  # running
            generated_before = engine.counters.generation_tokens
    # the connection is closed: the request is aborted and its blocks are back in the pool
    server.wait_idle(timeout=5)
    assert engine.counters.generation_tokens - generated_before < 500
    free, cached, in_use = engine.kv.pool.counts()
    assert in_use == 0
    engine.kv.check_integrity()


def test_whole_answer_disconnect_aborts(server, caplog):
    engine = server.engine
    server.wait_idle()
    body = _chat_body(server, "Tell me a long story.", max_tokens=1000, ignore_eos=True)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=1.5))
    server.wait_idle(timeout=5)
    assert engine.kv.pool.counts()[2] == 0
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text


def test_embeddings_float_and_base64(server):
    inputs = ["The cat sat on the mat.", "A cat was sitting on a rug.", "Stock markets fell today."]
    r = httpx.post(f"{server.url}/v1/embeddings", json={"model": server.model, "input": inputs}, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    vecs = [d["embedding"] for d in data]
    assert [d["index"] for d in data] == [0, 1, 2]
    assert all(abs(sum(x * x for x in v) - 1) < 1e-4 for v in vecs)

    def cos(a, b):
        return sum(x * y for x, y in zip(a, b))
    assert cos(vecs[0], vecs[1]) > cos(vecs[0], vecs[2])
    b64 = httpx.post(f"{server.url}/v1/embeddings", timeout=60, json={
        "model": server.model, "input": inputs[0], "encoding_format": "base64"}).json()
    raw = base64.b64decode(b64["data"][0]["embedding"])
    decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert max(abs(a - b) for a, b in zip(decoded, vecs[0])) < 1e-6
    assert b64["usage"]["prompt_tokens"] > 0
    server.wait_idle()


def test_models_health_version_tokenize_openapi(server):
    models = httpx.get(f"{server.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct", "default"]
    assert models["data"][0]["max_model_len"] == 2048
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "Hello world"
    doc = httpx.get(f"{server.url}/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/tokenize",
            "/detokenize", "/v1/models", "/health", "/version"} <= set(doc["paths"])
    schema = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert schema["$ref"].split("/")[-1] in doc["components"]["schemas"]
