"""POST /v1/responses (OpenAI's Responses API) through the real server on the tiny model, with
the openai Python package and, in Node, the Vercel AI SDK and the openai npm package: whole and
streamed answers and their event sequence, previous_response_id, function calls and their
outputs as input items, text.format through the grammar, the store (GET, DELETE, input items,
LRU), logprobs, bad input (a 400 naming the field) and a failure after the stream began."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from pageserve.runtime.engine_args import EngineArgs
from tests.live_server import InProcessServer

pytestmark = pytest.mark.server

NODE_DIR = Path(__file__).resolve().parent / "node"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lisbon", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}]


@pytest.fixture(scope="module")
def srv(tiny_model_dir):
    s = InProcessServer(EngineArgs(model=str(tiny_model_dir), dtype="float32", kv_cache_memory=0.05,
                                   max_model_len=1024, debug_checks=True), enable_auto_tool_choice=True)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)


def raw_events(srv, body: dict) -> list[tuple[str, dict]]:
    """(the `event:` line, the data) of each SSE event of a streamed response."""
    with httpx.stream("POST", f"{srv.url}/v1/responses", json={"model": srv.model, "stream": True, **body},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        text = r.read().decode()
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        assert "data" in lines, block
        out.append((lines.get("event"), json.loads(lines["data"])))
    return out


def token_count(srv, messages: list[dict]) -> int:
    r = httpx.post(f"{srv.url}/tokenize", json={"model": srv.model, "messages": messages}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_whole_and_streamed_answers_agree_and_the_events_are_as_documented(srv, client):
    whole = client.responses.create(model=srv.model, input="Tell me about cats.", temperature=0,
                                    max_output_tokens=12)
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in whole.output] == ["message"] and whole.output[0].content[0].type == "output_text"
    assert whole.usage.output_tokens == 12
    assert whole.usage.input_tokens == token_count(srv, [{"role": "user", "content": "Tell me about cats."}])
    assert whole.usage.total_tokens == whole.usage.input_tokens + 12
    chat = client.chat.completions.create(model=srv.model, temperature=0, max_tokens=12,
                                          messages=[{"role": "user", "content": "Tell me about cats."}])
    assert whole.output_text == chat.choices[0].message.content  # the same prompt, the same engine path

    events = raw_events(srv, {"input": "Tell me about cats.", "temperature": 0, "max_output_tokens": 12})
    assert all(name == data["type"] for name, data in events)  # the `event:` line names the data's type
    types = [data["type"] for _, data in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    n = types.count("response.output_text.delta")
    assert n >= 2 and types[4:4 + n] == ["response.output_text.delta"] * n
    assert types[4 + n:] == ["response.output_text.done", "response.content_part.done",
                             "response.output_item.done", "response.incomplete"]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    data = [d for _, d in events]
    assert data[0]["response"]["status"] == "in_progress" and data[0]["response"]["output"] == []
    text = "".join(d["delta"] for d in data if d["type"] == "response.output_text.delta")
    assert text == whole.output_text == data[-4]["text"] == data[-2]["item"]["content"][0]["text"]
    final = data[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == text and final["usage"]["output_tokens"] == 12
    assert final["output"][0]["status"] == "incomplete"
    # the openai package reads the same stream
    streamed = client.responses.create(model=srv.model, input="Tell me about cats.", temperature=0,
                                       max_output_tokens=12, stream=True)
    seen = [e.type for e in streamed]
    assert seen == types
    srv.wait_idle()


def test_previous_response_id_continues_the_conversation(srv, client):
    first = client.responses.create(model=srv.model, input="Hello!", instructions="Be brief.", temperature=0,
                                    max_output_tokens=5)
    assert first.usage.input_tokens == token_count(srv, [{"role": "system", "content": "Be brief."},
                                                         {"role": "user", "content": "Hello!"}])
    second = client.responses.create(model=srv.model, input="And then?", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=5)
    assert second.previous_response_id == first.id
    # the earlier turn and its answer come back; its instructions do not (as OpenAI)
    assert second.usage.input_tokens == token_count(srv, [
        {"role": "user", "content": "Hello!"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"}])
    # an output item referenced by id is the same as the item written out
    ref = httpx.post(f"{srv.url}/v1/responses", json={
        "model": srv.model, "temperature": 0, "max_output_tokens": 5,
        "input": [{"role": "user", "content": "Hello!"}, {"type": "item_reference", "id": first.output[0].id},
                  {"role": "user", "content": "And then?"}]}, timeout=60).json()
    assert ref["usage"]["input_tokens"] == second.usage.input_tokens
    assert ref["output"][0]["content"][0]["text"] == second.output_text
    srv.wait_idle()


def test_item_references_are_read_off_the_event_loop_once_per_response(srv, monkeypatch):
    """1,000 references into one stored response of 29 MB held /health for 23.6 s: each was
    read from the whole stored list, on the event loop. Now each stored response is read once,
    in a worker thread."""
    import asyncio

    from pageserve.app import response_store, responses

    turn = httpx.post(f"{srv.url}/v1/responses", timeout=60, json={
        "model": srv.model, "max_output_tokens": 2,
        "input": [{"role": "user", "content": f"item {i}"} for i in range(6)]}).json()
    listed = httpx.get(f"{srv.url}/v1/responses/{turn['id']}/input_items?order=asc").json()["data"]
    reads, on_loop = [], []
    read_items = response_store.StoredResponse.own_items.fget
    monkeypatch.setattr(response_store.StoredResponse, "own_items",
                        property(lambda stored: reads.append(1) or read_items(stored)))

    def find(references):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            pass
        return response_store.find_items(references)
    monkeypatch.setattr(responses, "find_items", find)
    refs = [{"type": "item_reference", "id": listed[i % 6]["id"]} for i in range(50)]
    r = httpx.post(f"{srv.url}/v1/responses", timeout=60, json={
        "model": srv.model, "max_output_tokens": 1, "store": False,
        "input": [*refs, {"role": "user", "content": "go on"}]})
    assert r.status_code == 200, r.text
    assert len(reads) == 1 and not on_loop
    srv.wait_idle()


def test_function_calls_whole_streamed_and_their_outputs_as_input(srv, client):
    r = client.responses.create(model=srv.model, input="What is the weather in Lisbon?", tools=TOOLS,
                                tool_choice="required", parallel_tool_calls=False, temperature=0,
                                max_output_tokens=300)
    assert r.status == "completed", r.status
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].status == "completed"
    args = json.loads(calls[0].arguments)
    assert args["city"] in ("Paris", "Lisbon", "Oslo") and 1 <= args["days"] <= 7
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")

    events = [d for _, d in raw_events(srv, {"input": "What is the weather in Lisbon?", "tools": TOOLS,
                                            "tool_choice": "required", "parallel_tool_calls": False,
                                            "temperature": 0, "max_output_tokens": 300})]
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["item"]["type"] for e in added] == ["function_call"]
    pieces = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert pieces == done["arguments"] == events[-1]["response"]["output"][0]["arguments"]
    assert json.loads(pieces) == args and done["name"] == "get_weather"
    assert events[-1]["type"] == "response.completed"

    # the call and its output, sent back as items, reach the template as a tool call and a tool message
    follow = client.responses.create(model=srv.model, temperature=0, max_output_tokens=4, input=[
        {"role": "user", "content": "What is the weather in Lisbon?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 24 C"}])
    assert follow.usage.input_tokens == token_count(srv, [
        {"role": "user", "content": "What is the weather in Lisbon?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0].call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": calls[0].arguments}}]},
        {"role": "tool", "content": "sunny, 24 C", "tool_call_id": calls[0].call_id, "name": "get_weather"}])
    srv.wait_idle()


class Weather(BaseModel):
    city: Literal["Paris", "Lisbon", "Oslo"]
    days: int = Field(ge=1, le=7)


def test_text_format_json_schema_and_parse_with_a_pydantic_model(srv, client):
    parsed = client.responses.parse(model=srv.model, input="Weather?", text_format=Weather, temperature=0,
                                    max_output_tokens=300)
    assert isinstance(parsed.output_parsed, Weather)
    obj = client.responses.create(model=srv.model, input="Weather?", temperature=0, max_output_tokens=300,
                                  text={"format": {"type": "json_schema", "name": "w", "schema": WEATHER}})
    assert Weather.model_validate_json(obj.output_text) and obj.text.format.type == "json_schema"
    srv.wait_idle()


def test_logprobs_on_output_text(srv, client):
    r = client.responses.create(model=srv.model, input="Hi", temperature=0, max_output_tokens=6, top_logprobs=2,
                                include=["message.output_text.logprobs"])
    lps = r.output[0].content[0].logprobs
    assert len(lps) == 6 and all(len(lp.top_logprobs) == 2 for lp in lps)
    assert all(lp.logprob <= lp.top_logprobs[0].logprob + 1e-5 for lp in lps)  # greedy: the top token
    # the tokens' bytes spell the text (less a character whose bytes are not all there at the end)
    assert b"".join(bytes(lp.bytes) for lp in lps).decode("utf-8", "replace").startswith(r.output_text)
    srv.wait_idle()


def test_store_get_delete_and_input_items(srv, client):
    r = client.responses.create(model=srv.model, input="Hi", max_output_tokens=3, metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"k": "v"}
    items = client.responses.input_items.list(r.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "Hi"
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(r.id)
    assert err.value.body["code"] == "response_not_found"
    # pages as OpenAI's: 20 by default; the SDK follows `after` through them
    many = [{"role": "user", "content": f"line {i}"} for i in range(45)]
    r = client.responses.create(model=srv.model, input=many, max_output_tokens=2)
    page = client.responses.input_items.list(r.id)
    assert len(page.data) == 20 and page.has_more and page.data[0].content[0].text == "line 44"
    assert [i.content[0].text for i in client.responses.input_items.list(r.id, order="asc", limit=7)] == \
        [f"line {i}" for i in range(45)]
    for query, param in (("limit=0", "limit"), ("limit=101", "limit"), ("limit=%C2%B2", "limit"),  # '²': a digit
                         ("limit=" + "9" * 5000, "limit"), ("order=up", "order"), ("after=nope", "after")):
        bad = httpx.get(f"{srv.url}/v1/responses/{r.id}/input_items?{query}")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, query
    unstored = client.responses.create(model=srv.model, input="Hi", max_output_tokens=2, store=False)
    assert httpx.get(f"{srv.url}/v1/responses/{unstored.id}").status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=srv.model, input="Hi", previous_response_id=unstored.id)
    assert httpx.delete(f"{srv.url}/v1/responses/resp_nothing").status_code == 404


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": [{"type": "item_reference", "id": "msg_unknown"}]}, "input.0.id"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "tools": TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     "text.format"),
    ({"input": "hi", "max_output_tokens": 100_000}, None),
    ({"input": []}, "input"),
    ({"input": "hi", "response_format": {"type": "json_object"}}, "response_format"),
    ({"input": "hi", "guided_regex": "[ab]+"}, "guided_regex"),
    ({"input": "hi", "structured_outputs": {"regex": "[ab]+"}}, "structured_outputs"),
    ({"input": "hi", "use_beam_search": True}, "use_beam_search"),
    ({"input": "hi", "min_tokens": 3, "allowed_token_ids": [2]}, None),
])
def test_bad_input_is_a_400_naming_the_field(srv, body, param):
    r = httpx.post(f"{srv.url}/v1/responses", json={"model": srv.model, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert (err["param"] or "").startswith(param), err
    ok = httpx.post(f"{srv.url}/v1/responses", json={"model": srv.model, "input": "hi", "max_output_tokens": 2},
                    timeout=30)
    assert ok.status_code == 200


def test_vllm_s_token_fields_bend_the_output_as_on_chat(srv):
    """allowed_token_ids, logit_bias, bad_words, stop_token_ids and min_tokens are taken, as chat
    and completions take them (they were dropped unseen)."""
    def answer(**extra) -> tuple[str, int]:
        r = httpx.post(f"{srv.url}/v1/responses", timeout=30, json={
            "model": srv.model, "input": "Say something", "max_output_tokens": 6, "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        body = r.json()
        text = "".join(part["text"] for item in body["output"] for part in item["content"])
        return text, body["usage"]["output_tokens"]

    a, b = (httpx.post(f"{srv.url}/tokenize", json={"model": srv.model, "prompt": c, "add_special_tokens": False},
                       timeout=30).json()["tokens"][-1] for c in "ab")
    text, _ = answer(allowed_token_ids=[a, b])
    assert text and set(text) <= {"a", "b"}, text
    assert answer(allowed_token_ids=[a, b], logit_bias={str(a): 100}) == ("aaaaaa", 6)
    text, n = answer(allowed_token_ids=[a, b], logit_bias={str(a): 100}, bad_words=["a"])
    assert n == 6 and set(text) == {"b"}, text
    assert answer(allowed_token_ids=[a, b], logit_bias={str(a): 100}, stop_token_ids=[a]) == ("", 1)
    text, n = answer(allowed_token_ids=[a, b], logit_bias={str(a): 100}, stop_token_ids=[a], min_tokens=4)
    assert (text, n) == ("bbbb", 5), text  # the stop token held back for 4 tokens, then taken


def test_a_failure_after_the_stream_began_is_an_error_event_then_failed(srv):
    srv.state.engine.request_timeout = 0.3
    try:
        events = [d for _, d in raw_events(srv, {"input": "Hi", "max_output_tokens": 900, "ignore_eos": True})]
    finally:
        srv.state.engine.request_timeout = None
    assert events[0]["type"] == "response.created"
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "request_timeout" and "--request-timeout" in events[-2]["message"]
    assert events[-1]["response"]["status"] == "failed" and events[-1]["response"]["error"]["code"] == "request_timeout"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    srv.wait_idle()


def test_node_clients_ai_sdk_and_openai_package(srv):
    node = shutil.which("node")
    assert node, "node is needed for this test (make test installs the npm packages)"
    assert (NODE_DIR / "node_modules" / "ai").is_dir(), "run `make test` (npm ci in tests/node)"
    proc = subprocess.run([node, str(NODE_DIR / "responses.mjs"), f"{srv.url}/v1", srv.model],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("responses", "compatible"):
        r = out[name]
        assert r["streamed"] == r["whole"] and r["streamed"]
        assert r["object"]["city"] in ("Paris", "Lisbon", "Oslo") and 1 <= r["object"]["days"] <= 7
        assert r["call"]["name"] == "get_weather"
    # both providers reach the same engine path: the same greedy text
    assert out["responses"]["streamed"] == out["compatible"]["streamed"]
    first, second = out["openai"]["first"], out["openai"]["second"]
    assert out["openai"]["streamed"] == first["text"]
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    srv.wait_idle()


INVALID_LAST_CALL = {  # a valid call, then one whose arguments are not JSON, in each format
    "hermes": '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
              '<tool_call>\n{"name": "f", "arguments": {"a": tru}}\n</tool_call>',
    "llama3_json": '{"name": "f", "parameters": {"a": 1}}; {"name": "f", "parameters": {"a": tru}}',
    "pythonic": "[f(a=1), f(a=tru)]",
    "mistral": '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "f", "arguments": {"a": tru}}]',
}


@pytest.mark.unit
@pytest.mark.parametrize("fmt", list(INVALID_LAST_CALL))
@pytest.mark.parametrize("pieces", [1, 7], ids=["whole", "streamed"])
def test_a_call_that_is_not_valid_closes_incomplete(fmt, pieces):
    """Without a grammar a model may write a call whose arguments are not JSON: its item closes
    `incomplete` (the whole chat answer leaves such a call out), the valid one `completed`."""
    from types import SimpleNamespace

    from pageserve.app.responses_protocol import ResponsesRequest
    from pageserve.app.responses import _Answer
    from pageserve.app.tools import tool_format

    text = INVALID_LAST_CALL[fmt]
    body = ResponsesRequest(model="m", input="hi", store=False)
    answer = _Answer(SimpleNamespace(), body, "resp_1", "m", 1.0, 1.0, 3, tool_format(fmt), False, None,
                     None, [], "")
    cuts = [len(text) * i // pieces for i in range(pieces)] + [len(text)]
    for i in range(pieces):
        answer.feed(SimpleNamespace(metrics=None, outputs=[SimpleNamespace(
            text=text[cuts[i]:cuts[i + 1]], token_ids=[0], logprobs=None,
            finish_reason="stop" if i == pieces - 1 else None)]))
    resp = answer.finish("stop")
    assert [(o["type"], o["status"]) for o in resp["output"]] == [("function_call", "completed"),
                                                                 ("function_call", "incomplete")]
    assert json.loads(resp["output"][0]["arguments"]) == {"a": 1} and resp["status"] == "completed"


@pytest.mark.parametrize("streamed", [False, True])
def test_logprobs_of_text_the_tool_parser_holds_back_are_kept(streamed):
    """With tools, the parser holds whitespace (and a tag's possible start) until what follows
    shows: those tokens' logprobs go with the text after them, so a streamed answer carries one
    entry per token, as the whole one does (a second reader found them dropped)."""
    from types import SimpleNamespace

    from pageserve.app.logprobs import TokenText
    from pageserve.app.responses_protocol import ResponsesRequest
    from pageserve.app.responses import _Answer
    from pageserve.app.tools import tool_format

    pieces = ["Hello", " ", "world", "\n", "\n", "<tool", "s are fun", " "]
    state = SimpleNamespace(token_text=TokenText([p.encode() for p in pieces]))
    body = ResponsesRequest(model="m", input="hi", store=False, top_logprobs=0)
    answer = _Answer(state, body, "resp_1", "m", 1.0, 1.0, 3, tool_format("hermes"), True, None, None, [], "")
    entries = [SimpleNamespace(token_id=i, logprob=-0.5, top=[]) for i in range(len(pieces))]
    groups = [[i] for i in range(len(pieces))] if streamed else [list(range(len(pieces)))]
    for n, group in enumerate(groups):
        answer.feed(SimpleNamespace(metrics=None, outputs=[SimpleNamespace(
            text="".join(pieces[i] for i in group), token_ids=group, logprobs=[entries[i] for i in group],
            finish_reason="stop" if n == len(groups) - 1 else None)]))
    part = answer.finish("stop")["output"][0]["content"][0]
    assert part["text"] == "Hello world\n\n<tools are fun"
    assert [lp["token"] for lp in part["logprobs"]] == pieces


def test_two_api_keys_each_see_only_their_own_responses(tiny_model_dir, caplog):
    """Key B gets 404 on everything of key A's (as for an id that never was), cannot pull A's
    items into its own conversation nor plant one that A's reference resolves to; A's
    conversation continues unharmed. The log shows a response id's prefix only."""
    s = InProcessServer(EngineArgs(model=str(tiny_model_dir), dtype="float32", kv_cache_memory=0.02,
                                   max_model_len=1024), api_keys=("key-a", "key-b"))
    try:
        a, b = (openai.OpenAI(base_url=f"{s.url}/v1", api_key=k, max_retries=0) for k in ("key-a", "key-b"))
        mine = {"type": "message", "role": "user", "id": "msg_mine", "content": "A's secret"}
        caplog.set_level("INFO", logger="pageserve.requests")
        first = a.responses.create(model=s.model, input=[mine, {"role": "user", "content": "more"}],
                                   max_output_tokens=3)
        own_ids = [i.id for i in a.responses.input_items.list(first.id).data]
        assert "msg_mine" in own_ids and len(own_ids) == 2
        for call in (lambda: b.responses.retrieve(first.id), lambda: b.responses.delete(first.id),
                     lambda: b.responses.input_items.list(first.id),
                     lambda: b.responses.create(model=s.model, input="go on", previous_response_id=first.id)):
            with pytest.raises(openai.NotFoundError) as err:
                call()
            assert err.value.body["code"] == "response_not_found"
        for ref in own_ids:  # A's items (its own id and the one the server made) do not resolve for B
            with pytest.raises(openai.BadRequestError) as err:
                b.responses.create(model=s.model, input=[{"type": "item_reference", "id": ref}])
            assert err.value.body["param"] == "input.0.id"
        plant = {"type": "message", "role": "user", "id": "msg_mine", "content": "B's plant"}
        b.responses.create(model=s.model, input=[plant], max_output_tokens=2)
        second = a.responses.create(model=s.model, previous_response_id=first.id, max_output_tokens=2,
                                    input=[{"type": "item_reference", "id": "msg_mine"}])
        items = a.responses.input_items.list(second.id, order="asc").data
        assert [i.content[0].text for i in items] == ["A's secret"]
        assert a.responses.retrieve(first.id).output_text == first.output_text
        no_key = httpx.get(f"{s.url}/v1/responses/{first.id}")
        assert no_key.status_code == 401
        assert first.id not in caplog.text and f"finished request {first.id[:13]}..." in caplog.text
    finally:
        s.stop()
