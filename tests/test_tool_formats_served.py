"""--tool-call-parser hermes|llama3_json|mistral|pythonic through the real server and the openai
client, on a tiny random-weight model whose chat template is the format's real one
(tests/templates/): the prompt shows the tools and earlier calls in the format, and a grammar
forcing calls gives valid tool_calls, whole and streamed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import jsonschema
import pytest
from openai import OpenAI

from pageserve.loadtest.tiny_model import build_tiny_model
from pageserve.runtime.engine_args import EngineArgs
from tests.live_server import InProcessServer

pytestmark = pytest.mark.server

TEMPLATES = Path(__file__).parent / "templates"
FORMATS = {"hermes": "qwen2.5_hermes.jinja", "llama3_json": "llama3.1_json.jinja", "mistral": "mistral.jinja",
           "pythonic": "llama3.2_pythonic.jinja"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                                    "b": {"type": "integer", "minimum": -99, "maximum": 99},
                                                    "exact": {"type": "boolean"}},
                   "required": ["a", "b"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_abcdef123456", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_abcdef123456", "content": "21 C, sunny"}]
# what each real template makes of the tools, the earlier call and its result
RENDERED = {
    "hermes": ['<tools>\n{"type": "function", "function": {"name": "get_weather"',
               '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
               '"unit": "celsius"}}\n</tool_call><|im_end|>',
               "<|im_start|>user\n<tool_response>\n21 C, sunny\n</tool_response><|im_end|>"],
    "llama3_json": ['Respond in the format {"name": function name, "parameters": dictionary of argument name',
                    '    "function": {\n        "name": "get_weather"',
                    '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": '
                    '{"city": "Paris", "unit": "celsius"}}<|eot_id|>',
                    '<|start_header_id|>ipython<|end_header_id|>\n\n{"output": "21 C, sunny"}<|eot_id|>'],
    "mistral": ['[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather"',
                '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}, '
                '"id": "def123456"}]',
                '[TOOL_RESULTS] {"content": 21 C, sunny, "call_id": "def123456"}[/TOOL_RESULTS]'],
    "pythonic": ["please respond with a python list of the calls",
                 '    "function": {\n        "name": "get_weather"',
                 "<|start_header_id|>assistant<|end_header_id|>\n\n[get_weather(city=Paris, unit=celsius)]<|eot_id|>",
                 '<|start_header_id|>ipython<|end_header_id|>\n\n{"output": "21 C, sunny"}<|eot_id|>'],
}
MARKUP = re.compile(r"tool_call|TOOL_CALLS|python_tag|get_weather|\"name\"")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tools"), max_position_embeddings=4096)


@pytest.fixture(scope="module", params=list(FORMATS))
def tool_server(request, model_dir):
    srv = InProcessServer(EngineArgs(model=str(model_dir), dtype="float32", kv_cache_memory=0.02,
                                     max_model_len=4096, swap_space=0),
                          chat_template=(TEMPLATES / FORMATS[request.param]).read_text(),
                          tool_call_parser=request.param, enable_auto_tool_choice=True)
    srv.format = request.param
    yield srv
    srv.stop()


def client(srv) -> OpenAI:
    return OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)


def check_call(srv, name: str, arguments: str, call_id: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    assert re.fullmatch(r"[A-Za-z0-9]{9}" if srv.format == "mistral" else r"call_[0-9a-f]{24}", call_id), call_id


def streamed(srv, **body) -> tuple[str, list[dict], str]:
    """Content, calls and finish reason of a streamed request, checking the delta shapes."""
    content, calls, finish = "", {}, None
    for chunk in client(srv).chat.completions.create(stream=True, **body):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish = choice.finish_reason or finish
        for c in choice.delta.tool_calls or ():
            if c.index not in calls:  # the first piece names the call
                assert c.index == len(calls) and c.id and c.type == "function" and c.function.name
                calls[c.index] = {"id": c.id, "name": c.function.name, "arguments": c.function.arguments or ""}
            else:
                assert c.id is None and not c.function.name
                calls[c.index]["arguments"] += c.function.arguments or ""
    return content, list(calls.values()), finish


def test_the_prompt_shows_tools_and_history_in_the_format(tool_server):
    r = httpx.post(f"{tool_server.url}/tokenize", timeout=60,
                   json={"model": tool_server.model, "messages": HISTORY, "tools": [WEATHER, ADD]})
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    prompt = httpx.post(f"{tool_server.url}/detokenize", json={"model": tool_server.model, "tokens": tokens},
                        timeout=60).json()["prompt"]
    for piece in RENDERED[tool_server.format]:
        assert piece in prompt, (piece, prompt)
    assert '"name": "add"' in prompt


def test_forced_calls_whole_and_streamed(tool_server):
    """tool_choice required (one call) and a named tool: the same seeded output parsed whole and
    streamed gives the same call, with the same arguments text, matching the schema, and no content.
    A named tool's reply finishes with "stop", as OpenAI's API and vLLM say."""
    for seed, choice in ((0, "required"), (1, "required"), (2, {"type": "function", "function": {"name": "add"}})):
        body = dict(model=tool_server.model, messages=ASK, tools=[WEATHER, ADD], tool_choice=choice,
                    parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=300)
        r = client(tool_server).chat.completions.create(**body)
        choice_out = r.choices[0]
        finish_reason = "stop" if isinstance(choice, dict) else "tool_calls"
        assert choice_out.finish_reason == finish_reason, choice_out
        assert not choice_out.message.content
        [call] = choice_out.message.tool_calls
        check_call(tool_server, call.function.name, call.function.arguments, call.id)
        if seed == 2:
            assert call.function.name == "add"
        content, calls, finish = streamed(tool_server, **body)
        assert finish == finish_reason and content == ""
        # the very text the model wrote, whole and streamed alike
        assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]
        check_call(tool_server, calls[0]["name"], calls[0]["arguments"], calls[0]["id"])
    tool_server.wait_idle()


def test_parallel_calls_and_the_next_turn(tool_server):
    """Several forced calls in one output, each valid; sent back with a result, the real template
    takes them (Mistral's checks its 9-character ids)."""
    r = client(tool_server).chat.completions.create(
        model=tool_server.model, messages=ASK, tools=[WEATHER, ADD], tool_choice="required", temperature=1.0,
        seed=5, max_tokens=600)
    calls = r.choices[0].message.tool_calls or []
    assert calls and r.choices[0].finish_reason in ("tool_calls", "length")
    for call in calls:
        check_call(tool_server, call.function.name, call.function.arguments, call.id)
    first = calls[0]
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [first.model_dump()]},
                      {"role": "tool", "tool_call_id": first.id, "content": "42"}]
    r = client(tool_server).chat.completions.create(model=tool_server.model, messages=messages, tools=[WEATHER, ADD],
                                               tool_choice="none", max_tokens=5, temperature=0)
    assert r.choices[0].message.tool_calls in (None, [])
    tool_server.wait_idle()


def test_auto_leaves_no_markup_in_content(tool_server):
    """tool_choice auto: whatever the random model writes, no markup reaches the content and
    every call is valid, whole and streamed alike."""
    for seed in range(3):
        body = dict(model=tool_server.model, messages=ASK, tools=[WEATHER, ADD], tool_choice="auto",
                    temperature=1.0, seed=seed, max_tokens=60)
        msg = client(tool_server).chat.completions.create(**body).choices[0].message
        assert not MARKUP.search(msg.content or ""), msg.content
        for call in msg.tool_calls or ():
            check_call(tool_server, call.function.name, call.function.arguments, call.id)
        content, calls, _ = streamed(tool_server, **body)
        assert content.strip() == (msg.content or "").strip()
        assert [c["name"] for c in calls][:len(msg.tool_calls or ())] == [c.function.name for c in msg.tool_calls or ()]
    start = {"llama3_json": "{", "pythonic": "["}.get(tool_server.format)
    if start is not None:  # calls open the output: pushed to start one, the model is held to calls
        [token] = httpx.post(f"{tool_server.url}/tokenize", json={"prompt": start, "add_special_tokens": False},
                             timeout=60).json()["tokens"]
        r = client(tool_server).chat.completions.create(
            model=tool_server.model, messages=ASK, tools=[WEATHER, ADD], tool_choice="auto", temperature=1.0, seed=0,
            max_tokens=400, logit_bias={str(token): 100})
        assert r.choices[0].message.tool_calls and not r.choices[0].message.content
        for call in r.choices[0].message.tool_calls:
            check_call(tool_server, call.function.name, call.function.arguments, call.id)
    tool_server.wait_idle()


def test_tools_too_large_for_a_grammar_are_a_400(tool_server):
    """Optional properties grow a call's regex as their square: refused up front, in the OpenAI
    error envelope naming `tools`, instead of compiled for minutes."""
    wide = {"type": "function", "function": {"name": "wide", "parameters": {
        "type": "object", "properties": {f"p{i}": {} for i in range(16)}}}}
    r = httpx.post(f"{tool_server.url}/v1/chat/completions", timeout=60, json={
        "model": tool_server.model, "messages": ASK, "tools": [WEATHER, wide], "tool_choice": "auto"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tools" and "regex characters" in error["message"], error
