"""Structured output and tool calling on the real default model, through the real server, with
the official openai clients (Python and, for a streamed tool call, Node)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess

import httpx
import jsonschema
import pydantic
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.live_server import ROOT
from pageserve.loadtest.schemas import fifty_schemas

pytestmark = pytest.mark.server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                                    "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                   "required": ["a", "b"]}}}
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Quito", "Rome", "Seoul", "Dakar", "Perth"]


def _schema_of(name: str) -> dict:
    return next(t for t in (WEATHER, ADD) if t["function"]["name"] == name)["function"]["parameters"]


def test_fifty_json_schemas_all_validate(server):
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    limit = asyncio.Semaphore(16)

    async def one(what: str, schema: dict):
        async with limit:
            r = await client.chat.completions.create(
                model=server.model, messages=[{"role": "user", "content": f"Describe {what} as a JSON object."}],
                response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}},
                max_tokens=300, temperature=0)
            return r.choices[0]

    async def run_all():
        async with client:
            return await asyncio.gather(*(one(what, schema) for what, schema in fifty_schemas()))

    choices = asyncio.run(run_all())
    for (what, schema), choice in zip(fifty_schemas(), choices):
        assert choice.finish_reason == "stop", (what, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)
    server.wait_idle()


def test_json_object_and_chinese_text(server):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    for prompt in ("Give the name and the capital of France as a JSON object.",
                   "Return a JSON object with the keys city and country, for Tokyo."):
        r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": prompt}],
                                           response_format={"type": "json_object"}, max_tokens=200, temperature=0)
        assert isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0].message.content
    # multi-byte characters inside a JSON string, split over tokens
    schema = {"type": "object", "properties": {"greeting": {"type": "string", "pattern": "^[\u4e00-\u9fff]{2,6}$"},
                                               "language": {"const": "中文"}},
              "required": ["greeting", "language"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Say hello in Chinese, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "hello", "schema": schema}},
        max_tokens=100, temperature=0)
    out = json.loads(r.choices[0].message.content)
    jsonschema.validate(out, schema)
    assert out["language"] == "中文"


def test_guided_fields_and_completions(server):
    body = {"model": server.model, "max_tokens": 30, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        **body, "prompt": "Is the sky blue? Answer:", "guided_choice": ["yes", "no", "maybe"]})
    assert r.json()["choices"][0]["text"] in ("yes", "no", "maybe")
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        **body, "messages": [{"role": "user", "content": "When was the first moon landing?"}],
        "structured_outputs": {"regex": r"\d{4}-\d{2}-\d{2}"}})
    text = r.json()["choices"][0]["message"]["content"]
    assert len(text) == 10 and text[4] == "-" and text.replace("-", "").isascii(), text
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        **body, "messages": [{"role": "user", "content": "A number please"}],
        "guided_json": {"type": "integer", "minimum": 10, "maximum": 20}})
    assert 10 <= json.loads(r.json()["choices"][0]["message"]["content"]) <= 20


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format", "'uniqueItems'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema",
     "json_schema.schema"),
    ({"guided_json": {"type": "string", "format": "ipv6"}}, "guided_json", "format 'ipv6'"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "not a valid regex"),
    ({"guided_regex": "(?m)^word"}, "guided_regex", "anchored"),  # fails in the grammar worker, not before
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "not several"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope'"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "cannot be combined"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}],
      "tool_choice": "required"}, "tools", "'not'"),
    # under 1 KB, but tens of MB of regex: refused at once, the grammar worker never sees it
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"p{i}": {} for i in range(60)}}}}}, "response_format",
     "optional properties"),
])
def test_what_cannot_be_enforced_is_a_400(server, body, param, words):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_tool_choice_required_twenty_of_twenty(server):
    client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(i: int):
        return await client.chat.completions.create(
            model=server.model, tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=False,
            messages=[{"role": "user", "content": f"What is the weather in {CITIES[i % 10]}?" if i % 2 else
                       f"What is {i} plus {3 * i}?"}],
            max_tokens=120, temperature=0.8, seed=i)

    async def run_all():
        async with client:
            return await asyncio.gather(*(one(i) for i in range(20)))

    for r in asyncio.run(run_all()):
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        call = choice.message.tool_calls[0]
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), _schema_of(call.function.name))
        assert not choice.message.content


def test_named_tool_and_parallel_calls(server):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    for i in range(4):
        r = client.chat.completions.create(
            model=server.model, tools=[WEATHER, ADD], messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
            tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=80, temperature=0.9, seed=i)
        calls = r.choices[0].message.tool_calls
        assert [c.function.name for c in calls] == ["add"]
        assert r.choices[0].finish_reason == "stop"  # a named function's, as OpenAI's API says
        jsonschema.validate(json.loads(calls[0].function.arguments), _schema_of("add"))
    r = client.chat.completions.create(
        model=server.model, tools=[WEATHER], tool_choice="required", max_tokens=200, temperature=0,
        messages=[{"role": "user", "content": "Get the weather for two cities: Paris, then Rome. Make two calls."}])
    assert r.choices[0].finish_reason == "tool_calls"
    calls = r.choices[0].message.tool_calls
    assert len(calls) >= 2 and len({c.id for c in calls}) == len(calls), calls
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments), _schema_of("get_weather"))


def test_a_call_cut_short_leaks_no_markup(server):
    """tool_choice required with max_tokens ending inside the call: finish_reason length, no
    call, and no piece of <tool_call> in the content, whole or streamed."""
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    args = dict(model=server.model, tools=[WEATHER], tool_choice="required", temperature=0,
                messages=[{"role": "user", "content": "What is the weather in Oslo?"}])
    for max_tokens in (3, 6, 12):
        r = client.chat.completions.create(max_tokens=max_tokens, **args)
        choice = r.choices[0]
        assert choice.finish_reason == "length" and not choice.message.tool_calls
        assert choice.message.content is None, choice.message.content
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            max_tokens=max_tokens, stream=True, **args) if c.choices)
        assert "<" not in streamed and "tool_call" not in streamed, streamed


def test_tool_history_round_trip(server):
    """An assistant turn with tool_calls and the tool's answer go back into the prompt (as
    Hermes tags for a template that does not render tools) and the model answers in text."""
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "sunny"}'}]
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": server.model, "messages": messages, "tools": [WEATHER], "tool_choice": "none",
        "max_tokens": 30, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert r.json()["choices"][0]["message"]["tool_calls"] == []
    from pageserve.app.chat import render_chat
    from pageserve.app.protocol import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate({"messages": messages, "tools": [WEATHER]})
    text = render_chat(server.state.tokenizer, body.messages, tools=body.tools)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temperature": 21, "sky": "sunny"}\n</tool_response>' in text
    assert '"name": "get_weather"' in text.split("<|im_end|>")[0]  # the tools, in the system prompt


def test_openai_python_parse_with_pydantic(server):
    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=30)
        country: str = pydantic.Field(max_length=30)
        population_millions: float

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    r = client.chat.completions.parse(model=server.model, response_format=City, max_tokens=200, temperature=0,
                                      messages=[{"role": "user", "content": "Describe the city of Paris."}])
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.name, r.choices[0].message.content


def test_node_openai_streams_a_tool_call(server):
    node = shutil.which("node")
    assert node, "node is needed for this test (make test installs the npm package)"
    proc = subprocess.run([node, str(ROOT / "tests" / "node" / "tools.mjs"), f"{server.url}/v1", server.model],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["finish"] == "tool_calls" and out["content"] == ""
    assert [c["name"] for c in out["calls"]] == ["get_weather"] and out["calls"][0]["id"].startswith("call_")
    jsonschema.validate(out["calls"][0]["arguments"], _schema_of("get_weather"))
    server.wait_idle()


def test_tool_choice_auto(server):
    """With --enable-auto-tool-choice: free text or a call; whatever the model does, a call
    that comes out is valid and no tag is left in the content, whole or streamed."""
    import dataclasses

    settings = server.state.settings
    server.state.settings = dataclasses.replace(settings, enable_auto_tool_choice=True)
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
        kinds = set()
        for i, question in enumerate(["What is the weather in Paris right now? Use the tool.",
                                      "Say hello.", "What is 2 plus 40? Call add."]):
            r = client.chat.completions.create(model=server.model, tools=[WEATHER, ADD], tool_choice="auto",
                                               max_tokens=60, temperature=0,
                                               messages=[{"role": "user", "content": question}])
            msg = r.choices[0].message
            assert "<tool_call>" not in (msg.content or "") or r.choices[0].finish_reason == "length"
            for call in msg.tool_calls or []:
                jsonschema.validate(json.loads(call.function.arguments), _schema_of(call.function.name))
            kinds.add("call" if msg.tool_calls else "text")
            stream = client.chat.completions.create(model=server.model, tools=[WEATHER, ADD], tool_choice="auto",
                                                    max_tokens=60, temperature=0, stream=True,
                                                    messages=[{"role": "user", "content": question}])
            content, names = "", []
            for chunk in stream:
                delta = chunk.choices[0].delta if chunk.choices else None
                content += (delta.content or "") if delta else ""
                names += [c.function.name for c in (delta.tool_calls or []) if delta and c.function and c.function.name]
            assert content.strip() == (msg.content or "").strip()
            assert names == [c.function.name for c in msg.tool_calls or []]
        assert "text" in kinds  # "Say hello." is answered in text
    finally:
        server.state.settings = settings
