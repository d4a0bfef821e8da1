"""Tool-call formats at their limits: long outputs fed a character at a time keep no growing
string (text is held as pieces, joined once, so parsing stays linear), and tools too large to
make into a grammar are refused with a 400 naming `tools`."""

from __future__ import annotations

import json

import pytest

from pageserve.app.errors import APIError
from pageserve.app.protocol import ChatCompletionRequest
from pageserve.app.tool_parsers import TOOL_PARSERS, tool_format
from pageserve.app.tools import plan_tools
from pageserve.grammar import regexes
from pageserve.grammar.regexes import MAX_TOOL_REGEX_CHARS, MAX_TOOLS_SCHEMA_CHARS

pytestmark = pytest.mark.unit

# per format: the start of a call whose argument "a" is a string, and what closes it
OPEN_CALL = {"hermes": ('<tool_call>{"name": "f", "arguments": {"a": "', '"}}</tool_call>'),
             "llama3_json": ('{"name": "f", "parameters": {"a": "', '"}}'),
             "mistral": ('[TOOL_CALLS][{"name": "f", "arguments": {"a": "', '"}}]'),
             "pythonic": ('[f(a="', '")]')}


def longest_text(obj, seen: set | None = None) -> int:
    """The length of the longest string held anywhere in `obj`: attributes, lists, dicts."""
    seen = set() if seen is None else seen
    if isinstance(obj, str):
        return len(obj)
    if id(obj) in seen or isinstance(obj, (int, float, bool, type(None))):
        return 0
    seen.add(id(obj))
    if isinstance(obj, dict):
        items = [*obj.keys(), *obj.values()]
    elif isinstance(obj, (list, tuple, set)):
        items = list(obj)
    else:
        items = list(getattr(obj, "__dict__", {}).values())
    return max((longest_text(i, seen) for i in items), default=0)


def fed_by_character(parser, text: str) -> list[dict]:
    deltas = []
    for c in text:
        deltas += parser.feed(c)
    return deltas


def streamed_arguments(deltas: list[dict]) -> str:
    return "".join(c["function"].get("arguments", "") for d in deltas for c in d.get("tool_calls", ()))


@pytest.mark.parametrize("name", TOOL_PARSERS)
def test_a_long_argument_fed_by_character_keeps_no_growing_string(name):
    fmt, (start, end) = tool_format(name), OPEN_CALL[name]
    long = "x" * 20_000
    parser = fmt.stream_parser()
    deltas = fed_by_character(parser, start + long)
    assert longest_text(parser) < 100  # mid-call: the argument so far is pieces, not one string
    deltas += fed_by_character(parser, end) + parser.finish()
    assert json.loads(streamed_arguments(deltas)) == {"a": long}
    assert not "".join(d.get("content", "") for d in deltas)


@pytest.mark.parametrize("name", TOOL_PARSERS)
def test_long_content_fed_by_character_keeps_no_growing_string(name):
    fmt, text = tool_format(name), "Some words, then more. " * 1_000
    parser = fmt.stream_parser()
    deltas = fed_by_character(parser, text)
    assert longest_text(parser) < 100
    deltas += parser.finish()
    assert "".join(d.get("content", "") for d in deltas) == text.rstrip() and parser.num_calls == 0  # as whole


@pytest.mark.parametrize("name", TOOL_PARSERS)
def test_a_200k_character_argument_parses_whole_and_streamed(name):
    fmt, (start, end) = tool_format(name), OPEN_CALL[name]
    long = "y" * 200_000
    content, [call] = fmt.parse(start + long + end)
    assert content is None and json.loads(call["function"]["arguments"]) == {"a": long}
    parser = fmt.stream_parser()
    deltas = [d for piece in (start, long[:100_000], long[100_000:], end) for d in parser.feed(piece)]
    assert streamed_arguments(deltas + parser.finish()) == call["function"]["arguments"]


def _tools(functions: list[tuple[str, dict]]):
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": n, "parameters": p}} for n, p in functions]}).tools


def _refused(tools, choice: str, name: str) -> APIError:
    with pytest.raises(APIError) as e:
        plan_tools(tools, choice, True, True, tool_format(name))
    assert e.value.status == 400 and e.value.param == "tools"
    return e.value


@pytest.mark.parametrize("name", TOOL_PARSERS)
def test_too_many_tools_are_a_400(name):
    params = {"type": "object", "required": ["city"],
              "properties": {"city": {"type": "string", "description": "d" * (MAX_TOOLS_SCHEMA_CHARS // 100)}}}
    many = _tools([(f"tool_{i}", params) for i in range(128)])  # the request's limit on tools
    for choice in ("auto", "required"):
        assert str(MAX_TOOLS_SCHEMA_CHARS) in str(_refused(many, choice, name))
    assert plan_tools(many[:20], "auto", True, True, tool_format(name)).grammar.regex  # a few are fine


@pytest.mark.parametrize("name", TOOL_PARSERS)
def test_a_schema_whose_regex_is_too_large_is_a_400(name):
    """Optional properties grow the regex as their square: small JSON, a huge grammar."""
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(300)}}
    assert len(json.dumps(wide)) < MAX_TOOLS_SCHEMA_CHARS
    error = _refused(_tools([("f", wide)]), "required", name)
    assert str(MAX_TOOL_REGEX_CHARS) in str(error) and "optional" in str(error)
    wide["required"] = list(wide["properties"])  # all required: linear, and accepted
    assert plan_tools(_tools([("f", wide)]), "required", True, True, tool_format(name)).grammar.regex


@pytest.mark.parametrize("name", TOOL_PARSERS)
def test_a_schema_surely_too_large_is_never_built(name, monkeypatch):
    """60 untyped optional properties: under 1 KB of JSON, tens of MB of regex. Refused from an
    estimate, before outlines-core is asked to build it."""
    built = []
    monkeypatch.setattr(regexes, "schema_to_regex", lambda schema: built.append(schema) or "x")
    wide = {"type": "object", "properties": {f"p{i}": {} for i in range(60)}}
    assert len(json.dumps(wide)) < 1_000
    assert str(MAX_TOOL_REGEX_CHARS) in str(_refused(_tools([("f", wide)]), "auto", name))
    assert not built
    plan_tools(_tools([("g", {"type": "object", "properties": {"a": {}}})]), "auto", True, True, tool_format(name))
    assert built  # a small one is built as before
