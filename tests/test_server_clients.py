"""The real server on the default model, driven by the official clients: the `openai` Python
package (sync and async) and the `openai` npm package under Node."""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import openai
import pytest

from tests.live_server import ROOT

pytestmark = pytest.mark.server

QUESTIONS = [f"In one sentence, what is {topic}?" for topic in (
    "the sun", "a cat", "rain", "music", "a river", "bread", "a computer", "winter",
    "the moon", "a tree", "coffee", "a bicycle", "the ocean", "a library", "snow", "a bridge")]


def _client(server, cls=openai.OpenAI):
    return cls(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client, server, question, **kw):
    return client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": question}],
        temperature=0, max_tokens=24, **kw)


def test_sync_chat_streamed_equals_whole(server):
    client = _client(server)
    whole = _chat(client, server, QUESTIONS[0])
    text = whole.choices[0].message.content
    assert text and whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens > 0 and whole.usage.prompt_tokens > 10
    assert whole.model == server.model and whole.id.startswith("chatcmpl-")
    pieces, finish = [], None
    for chunk in _chat(client, server, QUESTIONS[0], stream=True):
        assert chunk.object == "chat.completion.chunk" and chunk.model == server.model
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == text
    assert finish == whole.choices[0].finish_reason
    server.wait_idle()


def test_sync_completions_streamed_and_whole(server):
    client = _client(server)
    whole = client.completions.create(model=server.model, prompt="The three primary colors are",
                                      max_tokens=16, temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].text
    assert whole.usage.completion_tokens == 16 and whole.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=server.model, prompt="The three primary colors are", max_tokens=16, temperature=0,
        stream=True) if c.choices)
    assert streamed == whole.choices[0].text
    server.wait_idle()


def test_async_16_concurrent_streams_get_the_right_text(server):
    alone = [_chat(_client(server), server, q).choices[0].message.content for q in QUESTIONS]

    async def run():
        client = _client(server, openai.AsyncOpenAI)

        async def one(q):
            stream = await client.chat.completions.create(
                model=server.model, messages=[{"role": "user", "content": q}], temperature=0,
                max_tokens=24, stream=True, stream_options={"include_usage": True})
            text, usage = [], None
            async for chunk in stream:
                if chunk.choices:
                    text.append(chunk.choices[0].delta.content or "")
                if chunk.usage is not None:
                    usage = chunk.usage
            return "".join(text), usage

        results = await asyncio.gather(*(one(q) for q in QUESTIONS))
        await client.close()
        return results

    results = asyncio.run(run())
    for (text, usage), expected in zip(results, alone):
        assert text == expected
        assert usage is not None and usage.completion_tokens > 0
    server.wait_idle()


def test_async_client_whole_answers(server):
    async def run():
        client = _client(server, openai.AsyncOpenAI)
        outs = await asyncio.gather(*(client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": q}], temperature=0, max_tokens=8)
            for q in QUESTIONS[:4]))
        await client.close()
        return outs

    outs = asyncio.run(run())
    assert all(o.choices[0].message.content for o in outs)
    assert all(o.model == "default" for o in outs)  # answered under the name it was asked by


def test_openai_errors_surface_as_sdk_exceptions(server):
    client = _client(server)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=10 ** 6)
    assert "maximum context length is 2048 tokens" in str(err.value)
    assert _chat(client, server, "hi").choices[0].message.content


NODE_DIR = ROOT / "tests" / "node"


def test_node_openai_sdk(server):
    node = shutil.which("node")
    assert node, "node is needed for this test (make test installs the npm package)"
    assert (NODE_DIR / "node_modules" / "openai").is_dir(), "run `make test` (npm install in tests/node)"
    proc = subprocess.run([node, str(NODE_DIR / "client.mjs"), f"{server.url}/v1", server.model],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "streamed: " in proc.stdout and "whole: " in proc.stdout
    server.wait_idle()
