"""usage.prompt_tokens_details.cached_tokens (prompt tokens the prefix cache served) on chat
and completions, whole and streamed, and stream_options.continuous_usage_stats (usage on every
chunk), through the real server on the tiny model."""

from __future__ import annotations

import json

import httpx
import pytest

from pageserve.runtime.engine_args import EngineArgs
from tests.live_server import InProcessServer

pytestmark = pytest.mark.server

PROMPT = list(range(3, 60))  # 57 tokens: three full 16-token blocks can be reused


@pytest.fixture(scope="module")
def srv(tiny_model_dir):
    s = InProcessServer(EngineArgs(model=str(tiny_model_dir), dtype="float32", kv_cache_memory=0.01,
                                   max_model_len=512, debug_checks=True))
    yield s
    s.stop()


def post(srv, path, body):
    r = httpx.post(f"{srv.url}/v1/{path}", json={"model": srv.model, "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream(srv, path, body):
    body = {"model": srv.model, "temperature": 0, "stream": True, **body}
    with httpx.stream("POST", f"{srv.url}/v1/{path}", json=body, timeout=60) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    return [json.loads(e[len("data: "):]) for e in raw.split("\n\n") if e.startswith("data: {")]


def test_cached_tokens_on_completions_whole_and_streamed(srv):
    first = post(srv, "completions", {"prompt": PROMPT, "max_tokens": 3})
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    again = post(srv, "completions", {"prompt": PROMPT, "max_tokens": 3})
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
    assert again["usage"]["prompt_tokens"] == 57
    # two prompts in one request: the cached tokens of both are counted
    both = post(srv, "completions", {"prompt": [PROMPT, PROMPT[:20]], "max_tokens": 2})
    assert both["usage"]["prompt_tokens_details"]["cached_tokens"] == 48 + 16
    chunks = stream(srv, "completions", {"prompt": PROMPT, "max_tokens": 3,
                                         "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
    assert all(c["usage"] is None for c in chunks[:-1])
    srv.wait_idle()


def test_cached_tokens_and_continuous_usage_on_chat(srv):
    messages = [{"role": "user", "content": "paged attention " * 30}]
    post(srv, "chat/completions", {"messages": messages, "max_tokens": 2})
    whole = post(srv, "chat/completions", {"messages": messages, "max_tokens": 2})
    cached = whole["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % 16 == 0 and cached < whole["usage"]["prompt_tokens"]
    chunks = stream(srv, "chat/completions", {"messages": messages, "max_tokens": 6,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "ignore_eos": True})
    body = [c for c in chunks if c["choices"]]
    counts = [c["usage"]["completion_tokens"] for c in body]
    assert all(c["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"] for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 6 and counts[0] == 0  # the role chunk
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}
    # continuous_usage_stats without include_usage: no usage anywhere
    plain = stream(srv, "chat/completions", {"messages": messages, "max_tokens": 2,
                                             "stream_options": {"continuous_usage_stats": True}})
    assert all("usage" not in c for c in plain)
    srv.wait_idle()
