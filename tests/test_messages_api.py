"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) through the real server
and Anthropic's own Python SDK, on a scripted model that thinks and then makes a hermes tool
call: the thinking, tool_use and text blocks, whole and streamed (the SDK assembles the stream's
events into the same message), a second turn with the tool's result, stop reasons, usage, the
x-api-key header and errors in Anthropic's shape; and the Vercel AI SDK's Anthropic provider."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import anthropic
import httpx
import pytest

from tests.scripted import QWEN3_STYLE_TEMPLATE, build_scripted_model, scripted_server

pytestmark = pytest.mark.server

CALL = {"name": "note", "arguments": {"text": "the sky is blue and the grass is green"}}
SCRIPT = f"<think>I should write a note about colours</think><tool_call>\n{json.dumps(CALL)}\n</tool_call>"
NOTE = {"name": "note", "description": "Write a note",
        "input_schema": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}
ASK = [{"role": "user", "content": "Note the colours"}]
KEY = "messages-key"
NODE_DIR = Path(__file__).resolve().parent / "node"
GREEDY = {"temperature": 0}  # (the SDK has no such argument any more; the API takes it)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    path = build_scripted_model(tmp_path_factory.mktemp("messages"), SCRIPT, chat_template=QWEN3_STYLE_TEMPLATE)
    s = scripted_server(path, {"max_model_len": 1024, "kv_cache_memory": 0.02}, api_keys=(KEY,),
                        reasoning_parser="qwen3", tool_call_parser="hermes", enable_auto_tool_choice=True)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0, timeout=60)


def _blocks(message) -> list[dict]:
    return [block.model_dump(exclude_none=True) for block in message.content]


def test_a_tool_call_whole_and_streamed(srv, client):
    whole = client.messages.create(model=srv.model, max_tokens=200, extra_body=GREEDY, tools=[NOTE], messages=ASK)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    blocks = _blocks(whole)
    assert [b["type"] for b in blocks] == ["thinking", "tool_use"]
    assert blocks[0]["thinking"] == "I should write a note about colours"
    assert (blocks[1]["name"], blocks[1]["input"]) == (CALL["name"], CALL["arguments"])
    assert whole.stop_reason == "tool_use" and whole.stop_sequence is None
    assert whole.usage.output_tokens > 10 and whole.usage.input_tokens + whole.usage.cache_read_input_tokens > 3

    with client.messages.stream(model=srv.model, max_tokens=200, extra_body=GREEDY, tools=[NOTE], messages=ASK) as s:
        events = list(s)
        streamed = s.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "tool_use"]
    assert kinds.count("content_block_stop") == 2
    assert sum(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events) >= 2
    streamed_blocks = _blocks(streamed)
    assert [b["type"] for b in streamed_blocks] == ["thinking", "tool_use"]
    assert streamed_blocks[0]["thinking"] == blocks[0]["thinking"]
    assert streamed_blocks[1]["input"] == CALL["arguments"] and streamed_blocks[1]["name"] == "note"
    assert streamed.stop_reason == "tool_use"
    assert streamed.usage.output_tokens == whole.usage.output_tokens

    # the second turn: the assistant's blocks back, and the tool's result
    history = [*ASK, {"role": "assistant", "content": blocks},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": blocks[1]["id"],
                                             "content": [{"type": "text", "text": "noted: 7 words"}]}]}]
    second = client.messages.create(model=srv.model, max_tokens=200, extra_body=GREEDY, tools=[NOTE],
                                    messages=history)
    counted = client.messages.count_tokens(model=srv.model, tools=[NOTE], messages=history)
    assert counted.input_tokens == second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert counted.input_tokens > client.messages.count_tokens(model=srv.model, tools=[NOTE],
                                                               messages=ASK).input_tokens + 10
    prompt = httpx.post(f"{srv.url}/tokenize", headers={"Authorization": f"Bearer {KEY}"}, timeout=30, json={
        "messages": [{"role": "user", "content": "x"}]}).json()  # (the same key works as a Bearer token)
    assert prompt["count"] > 0
    srv.wait_idle()


def test_text_stop_sequences_and_max_tokens(srv, client):
    # no tools: the call's markup is text; a stop sequence inside the thinking ends it there
    whole = client.messages.create(model=srv.model, max_tokens=200, extra_body=GREEDY, messages=ASK)
    blocks = _blocks(whole)
    assert [b["type"] for b in blocks] == ["thinking", "text"] and "<tool_call>" in blocks[1]["text"]
    assert whole.stop_reason == "end_turn"
    text = "".join(client.messages.stream(model=srv.model, max_tokens=200, extra_body=GREEDY, messages=ASK).__enter__()
                   .text_stream)
    assert text == blocks[1]["text"]
    stopped = client.messages.create(model=srv.model, max_tokens=200, extra_body=GREEDY, messages=ASK,
                                     stop_sequences=["note about"])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "note about")
    assert _blocks(stopped) == [{"type": "thinking", "thinking": "I should write a ", "signature": ""}]
    short = client.messages.create(model=srv.model, max_tokens=3, extra_body=GREEDY,
                                   system=[{"type": "text", "text": "Be brief."}], messages=ASK)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    srv.wait_idle()


def test_a_thinking_budget_ends_the_thinking(srv, client):
    """thinking.budget_tokens bounds the thinking (the engine writes `</think>` after so many
    tokens); adaptive thinking has no budget."""
    script = srv.engine.runner.script
    budget = {"type": "enabled", "budget_tokens": 3}
    whole = client.messages.create(model=srv.model, max_tokens=60, extra_body=GREEDY, messages=ASK, thinking=budget)
    blocks = _blocks(whole)
    assert blocks[0] == {"type": "thinking", "thinking": srv.engine.tokenizer.decode(script[1:4]), "signature": ""}
    assert [b["type"] for b in blocks] == ["thinking", "text"]
    with client.messages.stream(model=srv.model, max_tokens=60, extra_body=GREEDY, messages=ASK, thinking=budget) as s:
        events = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in s
                  if e.type.startswith(("message_", "content_block_"))]  # the SDK's own events left out
        assert _blocks(s.get_final_message()) == blocks
    # the thinking block's signature, as Anthropic sends it: last, before the block stops
    first_stop = events.index(("content_block_stop", None))
    assert events[first_stop - 1] == ("content_block_delta", "signature_delta"), events
    free = client.messages.create(model=srv.model, max_tokens=200, extra_body=GREEDY, messages=ASK,
                                  thinking={"type": "adaptive"})
    assert _blocks(free)[0]["thinking"] == "I should write a note about colours"
    srv.wait_idle()


def test_output_config_format_is_structured_output(srv, client):
    """output_config.format's JSON schema governs the answer after the thinking (the script's
    tool call is not JSON of that shape, so the grammar shows); effort is taken; with tool calls
    it is a 400."""
    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "blue"]}},
              "required": ["colour"], "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "schema": schema}, "effort": "low"}
    whole = client.messages.create(model=srv.model, max_tokens=100, extra_body=GREEDY, messages=ASK,
                                   output_config=fmt)
    blocks = _blocks(whole)
    assert blocks[0]["thinking"] == "I should write a note about colours"
    assert json.loads(blocks[1]["text"])["colour"] in ("red", "blue") and whole.stop_reason == "end_turn"
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=srv.model, max_tokens=100, messages=ASK, tools=[NOTE], output_config=fmt)
    assert "output_config.format" in err.value.body["error"]["message"]
    srv.wait_idle()


def test_errors_in_anthropics_shape(srv, client):
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0).messages.create(
            model=srv.model, max_tokens=5, messages=ASK)
    assert refused.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=5, messages=ASK)
    assert missing.value.body["error"]["type"] == "not_found_error"
    for body, words in (({"messages": ASK}, "'max_tokens' is a required field"),
                        ({"messages": ASK, "max_tokens": 5, "tool_choice": {"type": "tool"}}, "needs the tool's 'name'"),
                        ({"messages": [{"role": "assistant", "content": [
                            {"type": "tool_result", "tool_use_id": "x", "content": "y"}]}], "max_tokens": 5},
                         "tool_result blocks belong to user messages"),
                        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}],
                          "max_tokens": 5}, "document"),
                        # an image goes to the image loader, which knows this model takes none
                        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
                            "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}],
                          "max_tokens": 5}, "takes no images"),
                        ({"messages": ASK, "max_tokens": 5, "tools": [{"name": "has space"}]},
                         "tools.0.name: String should match pattern")):  # not pydantic's raw text
        r = httpx.post(f"{srv.url}/v1/messages", headers={"x-api-key": KEY}, json=body, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
        assert words in err["error"]["message"], err
    with pytest.raises(anthropic.BadRequestError, match="is not a valid regex"):
        client.messages.create(model=srv.model, max_tokens=5, tools=[{"name": "bad", "input_schema": {
            "type": "object", "properties": {"x": {"type": "string", "pattern": "(a|"}}}}], messages=ASK)
    srv.wait_idle()


def test_the_vercel_ai_sdks_anthropic_provider(srv):
    """What a TypeScript front end sees through `@ai-sdk/anthropic`, streamed and whole."""
    node = shutil.which("node")
    assert node, "node is needed for this test (make test installs the npm packages)"
    assert (NODE_DIR / "node_modules" / "@ai-sdk" / "anthropic").is_dir(), "run `make test` (npm ci in tests/node)"
    proc = subprocess.run([node, str(NODE_DIR / "anthropic.mjs"), srv.url, srv.model, KEY],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    for answer in (got["streamed"], got["whole"]):
        assert answer["reasoning"] == "I should write a note about colours"
        assert answer["calls"] == [{"name": CALL["name"], "input": CALL["arguments"]}]
        assert answer["finish"] == "tool-calls" and answer["text"] == ""
    assert got["streamed"]["outputTokens"] == got["whole"]["outputTokens"] > 10
    srv.wait_idle()


def test_what_claude_code_sends(srv, client):
    """Prefill, adaptive thinking, system blocks, a tool result with an image, server tools,
    counting with a tool choice the server could not plan, and usage of a cached prompt, streamed."""
    prefill = [*ASK, {"role": "assistant", "content": "The colours"}]
    counted = client.messages.count_tokens(model=srv.model, messages=prefill).input_tokens
    rendered = httpx.post(f"{srv.url}/tokenize", headers={"x-api-key": KEY}, timeout=30, json={
        "messages": prefill, "add_generation_prompt": False, "continue_final_message": True}).json()["count"]
    assert counted == rendered  # the answer goes on from the assistant's words
    assert client.messages.count_tokens(model=srv.model, messages=ASK, tools=[NOTE],
                                        tool_choice={"type": "tool", "name": "elsewhere"}).input_tokens > 0
    answer = client.messages.create(model=srv.model, max_tokens=200, messages=ASK, thinking={"type": "adaptive"},
                                    system=[{"type": "text", "text": "You are terse.",
                                             "cache_control": {"type": "ephemeral"}}])
    assert answer.content[0].type == "thinking"
    # routed to the image loader; the error names where the client put the image
    where = r"messages\.2\.content\.0\.content\.1: .*takes no images"
    with pytest.raises(anthropic.BadRequestError, match=where):
        client.messages.create(model=srv.model, max_tokens=5, system="Be brief.", messages=[*ASK, {
            "role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "note", "input": {"text": "x"}}]}, {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [
                    {"type": "text", "text": "a picture"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}])
    with pytest.raises(anthropic.BadRequestError, match="server tools"):
        client.messages.create(model=srv.model, max_tokens=5, messages=ASK,
                               tools=[{"type": "web_search_20250305", "name": "web_search"}])
    # the second time, the prompt is in the prefix cache: streamed usage splits it as whole usage does
    client.messages.create(model=srv.model, max_tokens=200, extra_body=GREEDY, messages=ASK)
    with client.messages.stream(model=srv.model, max_tokens=200, extra_body=GREEDY, messages=ASK) as s:
        usage = s.get_final_message().usage
    assert usage.cache_read_input_tokens > 0
    assert usage.input_tokens + usage.cache_read_input_tokens == client.messages.count_tokens(
        model=srv.model, messages=ASK).input_tokens
    # an MCP tool's name runs past OpenAI's 64 characters, up to Anthropic's 128
    mcp = {**NOTE, "name": "mcp__" + "a-server" * 6 + "__" + "a_tool" * 10}
    assert len(mcp["name"]) == 115
    called = client.messages.create(model=srv.model, max_tokens=200, extra_body=GREEDY, messages=ASK,
                                    tools=[mcp, NOTE])
    assert [b.name for b in called.content if b.type == "tool_use"] == ["note"]
    with pytest.raises(anthropic.BadRequestError, match="tools.0.name"):
        client.messages.create(model=srv.model, max_tokens=5, messages=ASK, tools=[{**NOTE, "name": "n" * 129}])
    srv.wait_idle()


def test_a_stop_sequence_inside_a_call_is_not_a_tool_use(srv, client):
    request = dict(model=srv.model, max_tokens=200, extra_body=GREEDY, tools=[NOTE], messages=ASK,
                   stop_sequences=["blue"])
    whole = client.messages.create(**request)
    assert (whole.stop_reason, whole.stop_sequence) == ("stop_sequence", "blue")
    assert [b.type for b in whole.content] == ["thinking"]
    with client.messages.stream(**request) as s:
        streamed = s.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", "blue")
    # chat completions, streamed: the same finish reason as whole
    chat = {"model": srv.model, "max_tokens": 200, "temperature": 0, "stop": ["blue"], "messages": ASK,
            "tools": [{"type": "function", "function": {"name": "note", "parameters": NOTE["input_schema"]}}]}
    headers = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(f"{srv.url}/v1/chat/completions", json=chat, headers=headers,
                      timeout=60).json()["choices"][0]["finish_reason"] == "stop"
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json={**chat, "stream": True}, headers=headers,
                      timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.read().decode().splitlines() if line.startswith("data: {")]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    srv.wait_idle()
