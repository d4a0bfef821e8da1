"""Tool-call formats (app/tool_parsers/): each format's parser on hand-written outputs, whole
and streamed in every split; its forced grammar walked at random and parsed back to valid
calls; its lazy grammar (tool_choice auto) free until the call start, then held to a call; its
prompt for templates that do not render tools."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from pageserve.app.errors import APIError
from pageserve.app.protocol import ChatCompletionRequest
from pageserve.app.tool_parsers import TOOL_PARSERS, tool_format
from pageserve.app.tools import plan_tools
from pageserve.grammar.matcher import Matcher
from pageserve.grammar.regexes import python_literal_regex
from tests.test_grammar import _allowed, _walk, compiler  # noqa: F401 - compiler is a fixture

pytestmark = pytest.mark.unit

WEATHER = ("get_weather", {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]})
FLAGS = ("set_flags", {"type": "object", "properties": {
    "on": {"type": "boolean"}, "level": {"type": "integer", "minimum": 0, "maximum": 9},
    "note": {"type": ["string", "null"], "maxLength": 6},
    "tags": {"type": "array", "items": {"enum": ["a", "b", True, None]}, "maxItems": 2}},
    "required": ["on", "level"]})
FUNCTIONS = [WEATHER, FLAGS]
SCHEMAS = dict(FUNCTIONS)

# per format: an output with text (where the format allows it) and two calls, and the calls in it
TWO_CALLS = {
    "hermes": 'Let me see. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
              '\n</tool_call>\n<tool_call>\n{"name": "set_flags", "arguments": {"on": true, "level": 3, '
              '"tags": ["a", {"x": "}]"}]}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                   '{"name": "set_flags", "parameters": {"on": true, "level": 3, "tags": ["a", {"x": "}]"}]}}',
    "mistral": 'Let me see. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
               '{"name": "set_flags", "arguments": {"on": true, "level": 3, "tags": ["a", {"x": "}]"}]}}]',
    "pythonic": '[get_weather(city="Paris", unit=\'celsius\'), set_flags(on=True, level=3, '
                'tags=["a", {"x": "}]"}])]',
}
EXPECTED = [("get_weather", {"city": "Paris", "unit": "celsius"}),
            ("set_flags", {"on": True, "level": 3, "tags": ["a", {"x": "}]"}]})]
MARKUP = ("<tool_call", "tool_call>", "TOOL_CALLS", "python_tag", "[get_weather", '"name"')


def stream(fmt, pieces: list[str], cut_short: bool = False) -> tuple[str, list[tuple[str, str, str]]]:
    """Content and calls (id, name, arguments) from streaming `pieces`; checks the delta shapes."""
    parser, content, calls = fmt.stream_parser(), "", {}
    deltas = [d for p in pieces for d in parser.feed(p)] + parser.finish(cut_short)
    for d in deltas:
        assert set(d) in ({"content"}, {"tool_calls"}), d
        content += d.get("content", "")
        for c in d.get("tool_calls", []):
            if c["index"] not in calls:  # the first piece: index, id, type and name
                assert c["index"] == len(calls) and c["type"] == "function" and c["id"] and c["function"]["name"]
                calls[c["index"]] = [c["id"], c["function"]["name"], ""]
            else:
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}, c
            calls[c["index"]][2] += c["function"].get("arguments", "")
    assert parser.num_calls == len(calls)
    return content, [tuple(c) for c in calls.values()]


def splits(text: str, rng: random.Random):
    yield [text]
    yield list(text)  # one character at a time
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("name", TOOL_PARSERS)
def test_two_calls_whole_and_streamed_in_every_split(name):
    fmt, text = tool_format(name), TWO_CALLS[name]
    content, calls = fmt.parse(text)
    assert content == ("Let me see." if fmt.starts.keys().isdisjoint("{[") else None)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == EXPECTED
    assert len({c["id"] for c in calls}) == 2
    if name == "mistral":
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c["id"]) for c in calls)
    for cut in range(1, len(text)):  # every split in two
        got_content, got = stream(fmt, [text[:cut], text[cut:]])
        assert got_content.strip() == (content or "") and not any(m in got_content for m in MARKUP), cut
        assert [(n, json.loads(a)) for _, n, a in got] == EXPECTED, (cut, got)
    for pieces in splits(text, random.Random(name)):
        got_content, got = stream(fmt, pieces)
        assert got_content.strip() == (content or "")
        assert [(n, json.loads(a)) for _, n, a in got] == EXPECTED


@pytest.mark.parametrize("name, text, cut_short, content, names", [
    # text, and a stray closing tag, around a call; a lone "<" is text
    ("hermes", 'a < b </tool_call><tool_call>{"name": "f", "arguments": {}}</tool_call> bye', False, "a < b bye",
     ["f"]),
    ("hermes", 'ok <tool_call>\n{"name": "f", "arguments": {"a": [1', True, "ok", []),  # cut inside a call
    ("hermes", "x <tool_ca", True, "x", []),  # cut inside the tag
    ("hermes", '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', False, None, ["f"]),  # name last
    ("hermes", "<tool_call>not json</tool_call> after", False, "after", []),
    ("llama3_json", '<|python_tag|>{"name": "f", "arguments": {"a": 1}}', False, None, ["f"]),
    ("llama3_json", 'Paris is sunny. {"name": "f", "parameters": {}}', False, 'Paris is sunny. {"name": "f", '
                                                                             '"parameters": {}}', []),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "param', True, None, ["f"]),
    ("llama3_json", "<|python_t", True, None, []),
    ("llama3_json", "<|python_t", False, "<|python_t", []),
    ("mistral", "Sure [TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}}]", False, "Sure", ["f"]),
    ("mistral", "Sure [TOOL_CA", True, "Sure", []),
    ("mistral", "[TOOL_CALLS] no list", False, None, []),
    ("pythonic", "Paris [is] sunny", False, "Paris [is] sunny", []),
    ("pythonic", '[f(a=1), g(b="x', True, None, ["f"]),
    ("pythonic", "[f(1)]", False, None, []),  # positional arguments are not a call
    ("pythonic", '[f(a=g(1))]', False, None, []),  # nor are values that are not literals
])
def test_markup_never_reaches_content(name, text, cut_short, content, names):
    """Whole or streamed one character at a time: the content holds no markup, a call cut short
    (max_tokens) or not valid is left out of the whole parse."""
    fmt = tool_format(name)
    got_content, calls = fmt.parse(text, cut_short)
    assert (got_content and " ".join(got_content.split())) == content, got_content
    assert [c["function"]["name"] for c in calls] == names, calls
    streamed, announced = stream(fmt, list(text), cut_short)
    assert streamed == (got_content or "")  # exactly the whole parse's, whitespace too
    assert [n for _, n, _ in announced][:len(names)] == names


def _calls_of(fmt, text: str) -> list[tuple[str, dict]]:
    content, calls = fmt.parse(text)
    assert content is None, text
    streamed_content, streamed = stream(fmt, list(text))
    assert not streamed_content.strip()
    assert [(n, json.loads(a)) for _, n, a in streamed] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


FORCED_START = {"hermes": r'<tool_call>\n?\{ ?"name"', "llama3_json": r'\{ ?"name" ?: ?"\w+" ?, ?"parameters"',
                "mistral": r'\[TOOL_CALLS\] ?\[\{ ?"name"', "pythonic": r"\[\w+\("}


@pytest.mark.parametrize("name", TOOL_PARSERS)
def test_forced_grammar_walks_parse_to_valid_calls(compiler, name):
    """tool_choice required (parallel) and a named tool: random walks through the grammar always
    parse back to calls of the tools, with arguments that match their schemas."""
    fmt, rng, stop = tool_format(name), random.Random(1), compiler.tokenizer.eos_token_id
    ended = 0
    for _ in range(12):
        text, done = _walk(compiler, fmt.forced_regex(FUNCTIONS, True), rng, stop, max_steps=600)
        if not done:
            continue
        ended += 1
        assert re.match(FORCED_START[name], text), text
        calls = _calls_of(fmt, text)
        assert calls, text
        for fn, arguments in calls:
            jsonschema.validate(arguments, SCHEMAS[fn])
    assert ended >= 6
    for _ in range(4):
        text, done = _walk(compiler, fmt.forced_regex([FLAGS], False), rng, stop, max_steps=600)
        assert done
        [(fn, arguments)] = _calls_of(fmt, text)
        assert fn == "set_flags"
        jsonschema.validate(arguments, FLAGS[1])


def _held_to_a_call(fmt, allowed: set[str]) -> None:
    """Inside a call: only what a call of one of the tools can go on with."""
    if fmt.name == "pythonic":
        assert allowed and all(re.fullmatch(r"[gs]\w*", a) for a in allowed), allowed
    else:
        assert allowed and all(set(a) <= set('{"name: gt_wehrsfl') for a in allowed), allowed


# per format: free text then the start of a call, under tool_choice auto
LAZY = {"hermes": ("Let me check. ", "<tool_call>\n"), "mistral": ("Let me check. ", "[TOOL_CALLS] ["),
        "llama3_json": ("", '{"name": "'), "pythonic": ("", "[")}


@pytest.mark.parametrize("name", TOOL_PARSERS)
def test_lazy_grammar_is_free_until_a_call_starts(compiler, name):
    fmt, tok = tool_format(name), compiler.tokenizer
    index = compiler.submit(fmt.lazy_regex(FUNCTIONS, True)).result()
    words = -(-compiler.vocab_len // 32)
    free, start = LAZY[name]
    m = Matcher(index, (tok.eos_token_id,))
    assert all(m.advance(t) for t in tok.encode(free + start, add_special_tokens=False))
    allowed = {tok.decode([t]) for t in _allowed(m, words)}
    _held_to_a_call(fmt, allowed)
    assert tok.decode([tok.eos_token_id]) not in allowed
    # plain text is free, with the format's brackets later on, and may end at any point
    m = Matcher(index, (tok.eos_token_id,))
    text = "Hello there, {1} [2] < 3 and some more"
    assert all(m.advance(t) for t in tok.encode(text, add_special_tokens=False))
    assert tok.eos_token_id in _allowed(m, words)
    assert fmt.parse(text) == (text, [])
    if fmt.at_start_only:  # the call start, first, is a call: text may not start so
        m = Matcher(index, (tok.eos_token_id,))
        bad = tok.encode(start + "x", add_special_tokens=False)
        assert not all(m.advance(t) for t in bad)


@pytest.mark.parametrize("name", TOOL_PARSERS)
def test_calls_after_leading_whitespace(compiler, name):
    """A model often writes a newline or two before its calls (as after "</think>\n\n"): the
    parser still reads them, whole and streamed, and the auto grammar still holds them to calls."""
    fmt, tok = tool_format(name), compiler.tokenizer
    calls = TWO_CALLS[name].removeprefix("Let me see. ")
    for space in ("\n\n", " \n\t "):
        content, got = fmt.parse(space + calls)
        assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                    for c in got] == EXPECTED
        for pieces in splits(space + calls, random.Random(name)):
            streamed_content, streamed = stream(fmt, pieces)
            assert not streamed_content.strip()
            assert [(n, json.loads(a)) for _, n, a in streamed] == EXPECTED
    assert stream(fmt, list("\n\nHi [x] {y} ")) == ("\n\nHi [x] {y}", [])  # text keeps its whitespace, but
    assert stream(fmt, ["\n", "\n"]) == ("", []) and fmt.parse("\n\n") == (None, [])  # at the end (as whole)
    index = compiler.submit(fmt.lazy_regex(FUNCTIONS, True)).result()
    words, stop = -(-compiler.vocab_len // 32), tok.eos_token_id
    m = Matcher(index, (stop,))
    prefix = "\n\n" + LAZY[name][1]
    assert all(m.advance(t) for t in tok.encode(prefix, add_special_tokens=False))
    _held_to_a_call(fmt, {tok.decode([t]) for t in _allowed(m, words)})
    rng, out = random.Random(3), []
    for _ in range(800):  # on to the end of the call: it parses back to a valid one
        token = int(rng.choice(_allowed(m, words)))
        if token == stop:
            break
        assert m.advance(token)
        out.append(token)
        if m.is_terminated() or fmt.parse(prefix + tok.decode(out), True)[1]:
            break
    [call, *_] = fmt.parse(prefix + tok.decode(out), True)[1]
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    m = Matcher(index, (stop,))  # whitespace alone, or before text, is text
    assert all(m.advance(t) for t in tok.encode("\n\n", add_special_tokens=False)) and stop in _allowed(m, words)
    assert all(m.advance(t) for t in tok.encode("Hi {1}", add_special_tokens=False)) and stop in _allowed(m, words)


# per format: calls whose arguments are not written as json.dumps would write them
RAW = {"hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Par\\u00eds" ,  "unit": "celsius"}}\n'
                 '</tool_call><tool_call>{"arguments": {"a":  [1,2]}, "name": "f"}</tool_call>',
       "llama3_json": '{"name": "get_weather", "parameters": {"city":"Par\\u00eds" ,  "unit": "celsius"}};'
                      '{"parameters": {"a":  [1,2]}, "name": "f"}',
       "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city":"Par\\u00eds" ,  "unit": "celsius"}},'
                  '{"arguments": {"a":  [1,2]}, "name": "f"}]',
       "pythonic": "[get_weather(città='Parí', unit=\"celsius\"), f(a=[1,2])]"}
RAW_ARGUMENTS = {"pythonic": ['{"città": "Parí", "unit": "celsius"}', '{"a": [1, 2]}']}


@pytest.mark.parametrize("name", TOOL_PARSERS)
def test_whole_arguments_are_the_streamed_ones(name):
    """A call's whole `function.arguments` is exactly the concatenation of its streamed pieces:
    the text the model wrote (JSON formats, when the name comes first), not a re-serialisation."""
    fmt, text = tool_format(name), RAW[name]
    _, calls = fmt.parse(text)
    whole = [c["function"]["arguments"] for c in calls]
    assert whole == RAW_ARGUMENTS.get(name, ['{"city":"Par\\u00eds" ,  "unit": "celsius"}', '{"a": [1, 2]}'])
    for pieces in splits(text, random.Random(name)):
        assert [a for _, _, a in stream(fmt, pieces)[1]] == whole


def test_python_literals_follow_the_schema():
    rx = re.compile(python_literal_regex(FLAGS[1]["properties"]["tags"]))
    assert rx.fullmatch('["a", True]') and rx.fullmatch("[None]") and not rx.fullmatch("[true]")
    rx = re.compile(python_literal_regex({"type": "object"}))  # any object: Python's words inside
    assert rx.fullmatch('{"a": [True, None, 1.5]}') and not rx.fullmatch('{"a": null}')
    rx = re.compile(python_literal_regex({"enum": ["true", False, None]}))
    assert rx.fullmatch('"true"') and rx.fullmatch("False") and rx.fullmatch("None") and not rx.fullmatch("false")


def test_plan_refuses_what_a_format_cannot_write():
    pythonic = tool_format("pythonic")
    for tool, words in (({"name": "get.weather"}, "not a Python identifier"),
                        ({"name": "f", "parameters": {"type": "object", "properties": {"class": {}}}},
                         "'class' of 'f' is not a Python identifier"),
                        ({"name": "f", "parameters": {"anyOf": [{"type": "object"}]}}, "object with properties"),
                        # a TypeError (a 500) before
                        ({"name": "f", "parameters": {"type": "object", "required": 5}}, "'required' as an array"),
                        ({"name": "f", "parameters": {"type": "object", "properties": True}}, "'properties' as an")):
        body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                     "tools": [{"type": "function", "function": tool}]})
        with pytest.raises(APIError, match=words) as e:
            plan_tools(body.tools, "required", True, False, pythonic)
        assert e.value.status == 400 and e.value.param == "tools"
    plan = plan_tools(body.tools, "none", True, False, pythonic)  # shown, never constrained
    assert plan.grammar is None and not plan.parse


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_abcdef123456", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_abcdef123456", "content": "21 C, sunny"}]
WRITTEN = {  # the earlier call and its result, as each format writes them for a plain template
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
               "<tool_response>\n21 C, sunny\n</tool_response>", "<tools>"),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
                    '{"output": "21 C, sunny"}', '"parameters"'),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}, '
                '"id": "def123456"}]', '[TOOL_RESULTS]{"content": "21 C, sunny", "call_id": "def123456"}'
                '[/TOOL_RESULTS]', "[AVAILABLE_TOOLS]"),
    "pythonic": ('[get_weather(city="Paris", unit="celsius")]', '{"output": "21 C, sunny"}', "Python list"),
}


@pytest.mark.parametrize("name", TOOL_PARSERS)
def test_prompt_for_a_template_without_tools(name):
    body = ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": [
        {"type": "function", "function": {"name": n, "parameters": p}} for n, p in FUNCTIONS]})
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    dicts, tools = tool_format(name).chat_dicts(body.messages, body.tools, plain)
    call, result, hint = WRITTEN[name]
    assert tools is None and dicts[0]["role"] == "system"
    assert hint in dicts[0]["content"] and '"set_flags"' in dicts[0]["content"]
    assert dicts[2] == {"role": "assistant", "content": call}
    assert dicts[3] == {"role": "user", "content": result}
    assert tool_format(name).parse(call)[1][0]["function"]["name"] == "get_weather"  # it reads its own writing
    # a template that renders tools gets them, and the calls with their arguments as objects
    dicts, tools = tool_format(name).chat_dicts(body.messages, body.tools, "{{ tools }} {{ m.tool_calls }}")
    assert [t["function"]["name"] for t in tools] == ["get_weather", "set_flags"]
    assert dicts[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "unit": "celsius"}
    assert dicts[2]["name"] == "get_weather"
    assert dicts[2]["tool_call_id"] == dicts[1]["tool_calls"][0]["id"] == (
        "def123456" if name == "mistral" else "call_abcdef123456")


@pytest.mark.parametrize("name", TOOL_PARSERS)
def test_auto_grammar_writes_one_call_without_parallel_tool_calls(compiler, name):
    """parallel_tool_calls false: the auto grammar stops after one call (hermes' let a second
    block follow)."""
    fmt, tok = tool_format(name), compiler.tokenizer
    calls = TWO_CALLS[name].replace(', "tags": ["a", {"x": "}]"}]', "").replace(', tags=["a", {"x": "}]"}]', "")
    calls = calls.replace("'celsius'", '"celsius"')  # the grammar writes double quotes
    ids = tok.encode(calls, add_special_tokens=False)
    for parallel in (True, False):
        m = Matcher(compiler.submit(fmt.lazy_regex(FUNCTIONS, parallel)).result(), (tok.eos_token_id,))
        assert all(m.advance(t) for t in ids) == parallel, parallel


def test_a_pythonic_number_json_cannot_write_makes_no_call():
    """1e400 is a float Python reads as inf, which JSON has no way to write: not a call (its
    arguments would be `Infinity`, which JSON.parse refuses)."""
    fmt = tool_format("pythonic")
    for text in ("[f(x=1e400)]", "[f(x=[1, -1e400])]"):
        assert fmt.parse(text)[1] == [], text
        assert all("Infinity" not in a for _, _, a in stream(fmt, list(text))[1])
    assert json.loads(fmt.parse("[f(x=1e300)]")[1][0]["function"]["arguments"]) == {"x": 1e300}


def test_an_anthropic_tool_use_keeps_the_call_s_numbers_as_written():
    """A number past a double's range or an integer past 64 bits: Messages' whole answer gives
    the call's JSON as written (it was `{}`, and the integer lost its last digits)."""
    from pageserve.app.json_out import dumps
    from pageserve.app.messages import _tool_use

    written = '{"a": 1e+400, "id": 123456789012345678901234}'
    out = json.loads(dumps(_tool_use("t", "f", written)))
    assert out["input"]["id"] == 123456789012345678901234 and out["input"]["a"] == float("inf")
    assert json.loads(dumps(_tool_use("t", "f", '{"a": NaN}')))["input"] == {}  # not JSON: no input
