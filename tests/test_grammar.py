"""grammar/: schema -> regex (ranges, refusals), the compiled automaton, the matcher and its
bitmask, the tool-call parsers, and grammar-constrained requests in the engine (tiny model)."""

from __future__ import annotations

import itertools
import json
import random
import re
import sys
import time
from concurrent.futures import Future
from decimal import Decimal

import jsonschema
import numpy as np
import pytest

from pageserve.app.tool_parsers import tool_format
from pageserve.grammar import json_schema, numeric_ranges
from pageserve.grammar.compiler import GrammarCompiler
from pageserve.grammar.json_schema import UnsupportedSchema, ascii_digits, schema_to_regex
from pageserve.grammar.matcher import Matcher
from pageserve.grammar.regexes import avoiding
from pageserve.sampling.params import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.unit
HERMES = tool_format("hermes")

RANGES = [
    {"type": "integer", "minimum": -15, "maximum": 120},
    {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 7},
    {"type": "integer", "minimum": 10},
    {"type": "integer", "maximum": -10},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "number", "minimum": -2.5, "maximum": 3.7},
    {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
    {"type": "number", "maximum": -0.5},
]


@pytest.mark.parametrize("schema", RANGES + [
    {"type": "number", "minimum": 0.1, "maximum": 0.9}, {"type": "number", "exclusiveMinimum": 0.25},
    {"type": "number", "minimum": 0.05, "exclusiveMaximum": 0.3}, {"type": "number", "minimum": -7.05, "maximum": -0.125},
    {"type": "number", "minimum": 3}, {"type": "number", "minimum": 0}, {"type": "number", "exclusiveMinimum": 3}])
def test_numeric_bounds_are_exact(schema):
    """The range regex accepts exactly the numbers the schema allows (fractional ends too)."""
    rx = re.compile(f"(?:{schema_to_regex(schema)})")
    texts = {str(i) for i in range(-300, 300)} | {f"{i / 100:.{d}f}" for i in range(-1200, 1200) for d in (1, 2, 3)} | \
            {"1.0", "1.00", "0.5", "10.0", "3.7", "3.70", "-2.5", "0.000", "0.2500", "-0.1250"}
    valid = jsonschema.Draft202012Validator(schema)
    for t in texts:
        if t.startswith("-0") and float(t) == 0 or schema["type"] == "integer" and "." in t:
            assert not rx.fullmatch(t) or valid.is_valid(json.loads(t)), t  # "-0", "3.0": need not be writable
        else:
            assert bool(rx.fullmatch(t)) == valid.is_valid(json.loads(t)), t


def test_fine_bounds_are_exact_and_grow_with_their_runs_of_digits(compiler):
    """A bound's fraction is written a run of equal digits at a time: 1.2e-301 (a run of 300
    zeros) is a regex of about 100 characters, not one of 49 KB, and bounds either side of a long
    run are exact (checked against exact decimals on digit strings around each bound) and
    compile (-1.2e-301 and [1e-300, 2e-300] failed to, nested 300 deep). Large bounds whose least
    integer has few significant digits compile too."""
    rng = random.Random(0)
    fractions = ["", "1", "5", "05", "005", "1005", "125", "9", "99", "0099", "000012", "5001", "0009",
                 "0" * 40 + "12"]
    for a, b in itertools.product(fractions, repeat=2):
        lo, hi = Decimal(f"0.{a or 0}"), Decimal(f"0.{b or 0}")
        texts = {base[:rng.randint(0, len(base))] + "".join(rng.choices("0123456789", k=rng.randint(0, 3)))
                 for base in (a, b) for _ in range(60)} | {a + "0", b + "00", "0", "1", "9"}
        texts.discard("")
        for lo_excl, hi_excl in itertools.product((False, True), repeat=2):
            cases = [(numeric_ranges._frac_at_least(a, lo_excl), lambda v: v > lo if lo_excl else v >= lo),
                     (numeric_ranges._frac_at_most(a, hi_excl), lambda v: v < lo if hi_excl else v <= lo)]
            if lo <= hi:
                cases.append((numeric_ranges._frac_between(a, b, lo_excl, hi_excl),
                              lambda v: (v > lo if lo_excl else v >= lo) and (v < hi if hi_excl else v <= hi)))
            for alternatives, allowed in cases:
                rx = re.compile("|".join(f"(?:{x})" for x in alternatives)) if alternatives else None
                for t in texts:
                    assert bool(rx and rx.fullmatch(t)) == allowed(Decimal(f"0.{t}")), (a, b, lo_excl, hi_excl, t)
    # a least integer of few significant digits (or below a maximum, or after a minus sign) is cheap
    for schema, yes, no in (({"type": "number", "minimum": 1e12}, "1000000000000.5", "999999999999.9"),
                            ({"type": "integer", "minimum": 1.7e12, "maximum": 1.8e12}, "1750000000000", "1800000000001"),
                            ({"type": "integer", "maximum": -123456789}, "-123456789", "-123456788")):
        rx = schema_to_regex(schema)
        assert re.fullmatch(rx, yes) and not re.fullmatch(rx, no), schema
        compiler.submit(rx).result(timeout=30)
    tiny = schema_to_regex({"type": "number", "minimum": 1.2e-301})
    assert len(tiny) < 200
    assert re.fullmatch(tiny, "0." + "0" * 300 + "12") and not re.fullmatch(tiny, "0." + "0" * 300 + "11")
    for schema in ({"type": "number", "minimum": -1.2e-301}, {"type": "number", "minimum": 1e-300, "maximum": 2e-300}):
        compiler.submit(schema_to_regex(schema)).result(timeout=30)


def test_bounds_with_enum_and_unused_defs():
    assert schema_to_regex({"type": "integer", "minimum": 1, "enum": [0, 1, 5, 999], "maximum": 10}) == "(1|5)"
    regex = schema_to_regex({"$defs": {"n": {"type": "integer", "minimum": 0}}, "type": "object",
                             "properties": {"a": {"type": "boolean"}}, "required": ["a"]})
    assert re.fullmatch(regex, '{"a": true}')
    with pytest.raises(UnsupportedSchema, match="type 'integer' or 'number'"):
        schema_to_regex({"minimum": 3})


@pytest.mark.parametrize("regex, result", [
    (r"^\d{4}$", "[0-9]{4}"), (r"\Ayes|no\z", "yes|no"), (r"a\$", r"a\$"),
    ("(abc)*", "matches the empty string"), ("(yes|no)?", "matches the empty string"),
    ("a(?=b)", "look-around"), ("(unclosed", "not a valid regex"),
    ("a{10000}", "a{10000}"), ("(ab|cd){500}x+", "(ab|cd){500}x+"), ("[0-9]{1,9000}", "[0-9]{1,9000}"),
    ("x" * 30_000, "x" * 30_000), ("|".join(f"w{i}" for i in range(5000)), "|".join(f"w{i}" for i in range(5000))),
    ("a{10001}", "more than 10,000 characters' worth"), ("a{1,99999}", "too large"),
    ("((a{1,30}){1,30}){1,30}", "too large"), ("(?:x|(y{100}){101})z*", "too large"),
    (".{1,626}", "too large"), ('[^"]{1,626}', "too large"), ("[a-z]{1,2501}", "too large"),
    (r"(?P<x>a)(?P=x)", "back-references"), ("(a)?(?(1)a{30000}|b)", "back-references"),
])
def test_client_regexes(regex, result):
    """Counted repetitions that spell out more than the bound are refused at once (nested counts
    multiply, a broad class weighs 16, a class of up to 64 characters 4), not after the compile's
    time limit; a long regex without them is not; back-references are refused by name."""
    from pageserve.grammar.compiler import regex_for

    if result in ("too large", "back-references") or any(
            word in result for word in ("empty", "look", "valid", "worth")):
        with pytest.raises(UnsupportedSchema, match=result):
            regex_for(StructuredOutputsParams(regex=regex))
    else:
        assert regex_for(StructuredOutputsParams(regex=regex)) == result


def _nested(schema: dict, key: str, levels: int) -> dict:
    for _ in range(levels):
        schema = {"type": "array" if key == "items" else "object", key: schema}
    return schema


@pytest.mark.parametrize("schema, words", [
    ({"type": "integer", "multipleOf": 3}, "'multipleOf'"),
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "'uniqueItems'"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "'not' (at #/properties/a)"),
    ({"type": "string", "format": "hostname"}, "format 'hostname'"),
    ({"type": "string", "pattern": "(?=x)y"}, "look-around"),
    ({"type": "string", "pattern": "a{99999}"}, "the pattern at # ('a{99999}') is too large to compile"),
    ({"type": "integer", "minimum": 5, "maximum": 4}, "leave no integer"),
    ({"type": "integer", "minimum": 1234567891}, "integers that may end at 1234567891"),
    ({"type": "number", "exclusiveMinimum": 1e12}, "integers that may end at 1000000000001"),
    ({"type": "integer", "minimum": 0, "maximum": 9.87e29}, "may end at 98700000000000002328"),
    ({"type": "number", "minimum": -1.7e308, "maximum": 1.7e308}, "up to 10**15"),
    ({"type": "number", "maximum": 1e30}, "up to 10**15"),
    ("{not json", "not valid JSON"),
    # malformed values outlines-core ignored (a 200 with nothing enforced)
    ({"type": "array", "items": {"type": "string"}, "maxItems": "x"}, "'maxItems' (at #) must be an integer >= 0"),
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": -1}}},
     "'minLength' (at #/properties/a) must be an integer >= 0, got -1"),
    ({"type": "string", "maxLength": True}, "'maxLength' (at #) must be an integer >= 0, got True"),
    ({"type": "array", "minItems": 3, "maxItems": 1}, "'minItems' 3 is above 'maxItems' 1"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": "a"}, "'required' (at #) must be"),
    ({"anyOf": []}, "'anyOf' (at #) must be a non-empty array"),
    # outlines-core kept the lengths and dropped the pattern; wrote allOf's objects back to back
    ({"type": "string", "pattern": "^[A-Z]{3}$", "maxLength": 3}, "a pattern with minLength or maxLength (at #)"),
    ({"allOf": [{"$ref": "#/$defs/A"}, {"type": "object"}], "$defs": {"A": {"type": "object"}}},
     "allOf with several subschemas (at #)"),
    ({"allOf": [{"properties": {"a": {"type": "string"}}}, {"properties": {"a": {"type": "integer"}}}]},
     "gives the property 'a' two schemas"),
    ({"allOf": [{"properties": {"a": {"type": "string"}}, "required": "a"}, {"type": "object"}]},
     "'required' (at #/allOf/0) must be"),
    ({"type": "string", "maxLength": 1, "enum": ["bb"]}, "exclude every value of its enum or const"),
    # values of the wrong kind were a TypeError (a 500)
    ({"type": "string", "enum": None}, "'enum' (at #) must be a non-empty array of values, got None"),
    ({"enum": []}, "'enum' (at #) must be a non-empty array"),
    ({"type": [[]], "enum": [1]}, "'type' (at #) must be a type name or a non-empty array of them"),
    ({"type": "string", "format": {}}, "'format' (at #) must be a string"),
    # Python's re took minutes on it, on the event loop (each more "a" doubles the time)
    ({"type": "string", "pattern": "^(a|a)+$", "enum": ["a" * 40 + "!"]}, "take more than 0.1 s to check"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "zz"],
      "additionalProperties": False}, "names 'zz', which 'properties' does not name"),
    # each level of arrays (or of additionalProperties' schema) doubles outlines-core's regex, and
    # the bound missed it: 25 levels of arrays (718 characters) asked for 2.4 GB and aborted the
    # server. Refused before it is built (at these depths the old bound let it be built, then refused)
    (_nested({"type": "string"}, "items", 16), "would make a regex of more than"),
    (_nested({"type": "string"}, "additionalProperties", 14), "would make a regex of more than"),
])
def test_what_cannot_be_enforced_is_named(schema, words):
    with pytest.raises(UnsupportedSchema, match=re.escape(words)):
        schema_to_regex(schema)


def test_the_pattern_checks_share_one_budget_a_schema(monkeypatch):
    """0.1 s for all of a schema's enums against their patterns, not 0.1 s each (80 properties
    each just under a budget of their own held the event loop 1.5 s): here every check takes
    0.03 s of a fake clock, and the fifth finds the budget spent."""
    from pageserve.grammar import json_schema

    ticks = itertools.count()
    monkeypatch.setattr(json_schema.time, "thread_time", lambda: next(ticks) * 0.03)  # a check reads it twice
    one = {"type": "string", "pattern": "^a", "enum": ["ab"]}
    schema_to_regex({"type": "object", "properties": {f"p{i}": one for i in range(3)}})
    with pytest.raises(UnsupportedSchema, match=r"the patterns of the schema take more than 0.1 s .*at #/properties/p4"):
        schema_to_regex({"type": "object", "properties": {f"p{i}": one for i in range(6)}})


def test_zod_int_bounds_are_no_bound():
    """zod writes .int() as +-(2**53 - 1), JavaScript's safe integers (every AI SDK tool with an
    integer parameter): no bound, not a 400 for their 16-digit ends; another bound beside them holds."""
    safe = {"minimum": -(2 ** 53 - 1), "maximum": 2 ** 53 - 1}
    regex = schema_to_regex({"type": "integer", **safe})
    assert re.fullmatch(regex, "-12") and re.fullmatch(regex, "123456789012") and not re.fullmatch(regex, "1.5")
    regex = schema_to_regex({"type": "integer", **safe, "maximum": 100})
    assert re.fullmatch(regex, "100") and re.fullmatch(regex, "-7") and not re.fullmatch(regex, "101")
    with pytest.raises(UnsupportedSchema, match="may end at"):  # one past them is a bound as any other
        schema_to_regex({"type": "integer", "maximum": 2 ** 53})


def test_all_of_object_schemas_are_merged_into_one_object():
    regex = schema_to_regex({"type": "object", "description": "both", "allOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"properties": {"b": {"type": "string", "enum": ["x"]}}, "required": ["b"]}]})
    assert re.fullmatch(regex, '{"a": 1, "b": "x"}') and not re.fullmatch(regex, '{"a": 1}{"b": "x"}')
    assert not re.fullmatch(regex, '{"a": 1}')


def test_an_enum_keeps_the_values_its_type_length_and_pattern_allow():
    """outlines-core writes an enum's values and ignores what stands beside them."""
    regex = schema_to_regex({"type": "integer", "enum": [1, "x", 2.0, True]})
    assert re.fullmatch(regex, "1") and not re.fullmatch(regex, '"x"') and not re.fullmatch(regex, "true")
    regex = schema_to_regex({"type": "string", "enum": ["ab", "abc", "b"], "pattern": "^a", "maxLength": 2})
    assert re.fullmatch(regex, '"ab"') and not re.fullmatch(regex, '"abc"') and not re.fullmatch(regex, '"b"')


def test_a_required_property_properties_does_not_name_is_written():
    regex = schema_to_regex({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "zz"]})
    assert re.fullmatch(regex, '{"a": 1, "zz": "any"}') and not re.fullmatch(regex, '{"a": 1}')
    # named behind a $ref: its own schema holds, not "any value"
    regex = schema_to_regex({"$defs": {"A": {"type": "object", "properties": {"x": {"type": "integer"}}}},
                             "$ref": "#/$defs/A", "required": ["x"]})
    assert re.fullmatch(regex, '{"x": 1}') and not re.fullmatch(regex, '{"x": "s"}')


def test_a_property_of_any_value_holds_one_json_value():
    """outlines-core's regex for a value of any kind is an alternation without its group: as a
    property's it let `null` alone be the whole output, and a description alone was refused."""
    for value in ({}, {"description": "anything"}):
        regex = schema_to_regex({"type": "object", "properties": {"x": value}, "required": ["x"]})
        assert re.fullmatch(regex, '{"x": [1, {"k": null}]}') and not re.fullmatch(regex, "null")


def test_counts_written_as_floats_and_draft3_required_are_taken():
    assert schema_to_regex({"type": "string", "maxLength": 3.0}).endswith("{0,3}\"")
    assert schema_to_regex({"type": "object", "properties": {"a": {"type": "string", "required": True}}})
    assert len(schema_to_regex(_nested({"type": "string"}, "items", 10))) > 70_000  # still built below the bound
    assert len(schema_to_regex(_nested({"type": "string"}, "additionalProperties", 10))) > 170_000


def test_ascii_digits():
    assert ascii_digits(r"\d{4}-[\d.]+\\d\D") == r"[0-9]{4}-[0-9.]+\\d[^0-9]"


def test_avoiding_a_word():
    chunk, tail = avoiding("<tool_call>")
    rx = re.compile(f"(?:{chunk}*{tail}?)", re.S)
    rng = random.Random(0)
    for _ in range(20_000):
        s = "".join(rng.choice("<tool_call>x\n") for _ in range(rng.randint(0, 14)))
        if rng.random() < 0.1:
            s = s[:5] + "<tool_call>" + s[5:]
        assert bool(rx.fullmatch(s)) == ("<tool_call>" not in s), s


@pytest.fixture(scope="module")
def compiler(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    c = GrammarCompiler(tok)
    yield c
    c.shutdown()


def _allowed(matcher: Matcher, words: int) -> np.ndarray:
    mask = np.zeros((1, words), dtype=np.int32)
    matcher.fill_bitmask(mask, 0)
    return np.nonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))[0]


def _walk(compiler, regex: str, rng: random.Random, stop: int, max_steps: int = 400) -> tuple[str, bool]:
    """Random allowed tokens until the grammar ends; returns the text and whether it did."""
    index = compiler.submit(regex).result()
    words = -(-compiler.vocab_len // 32)
    m, out = Matcher(index, (stop,)), []
    for _ in range(max_steps):
        allowed = _allowed(m, words)
        token = int(rng.choice(allowed))
        if token == stop:
            return compiler.tokenizer.decode(out), True
        assert m.advance(token)
        out.append(token)
        if m.is_terminated():
            return compiler.tokenizer.decode(out), True
    return compiler.tokenizer.decode(out), False


def test_random_walks_through_a_schema_always_validate(compiler):
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "n": {"type": "integer", "minimum": -5, "maximum": 300},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "你好"]}, "minItems": 1, "maxItems": 3},
        "ok": {"type": ["boolean", "null"]}}, "required": ["name", "n", "tags"], "additionalProperties": False}
    regex = schema_to_regex(schema)
    rng = random.Random(0)
    stop = compiler.tokenizer.eos_token_id
    for _ in range(30):
        text, ended = _walk(compiler, regex, rng, stop)
        assert ended, text
        jsonschema.validate(json.loads(text), schema)


def test_a_state_that_could_end_keeps_its_continuations(compiler):
    """Regression: unanchored, outlines-core dropped the tokens that go on from a state where
    the regex could end (`ab(xab)?` never wrote the x; a second tool call never came)."""
    tok = compiler.tokenizer
    index = compiler.submit("ab(xab)?").result()
    m = Matcher(index, (tok.eos_token_id,))
    for t in tok.encode("ab", add_special_tokens=False):
        assert m.advance(t)
    words = -(-compiler.vocab_len // 32)
    allowed = {tok.decode([t]) for t in _allowed(m, words)}
    assert any(a.startswith("x") for a in allowed) and tok.decode([tok.eos_token_id]) in allowed
    assert not m.is_terminated()
    two = ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
           '<tool_call>\n{"name": "f", "arguments": {"a": 2}}\n</tool_call>')
    index = compiler.submit(HERMES.forced_regex([("f", {"type": "object", "properties": {"a": {"type": "integer"}},
                                                         "required": ["a"]})], True)).result()
    m = Matcher(index, (tok.eos_token_id,))
    assert all(m.advance(t) for t in tok.encode(two, add_special_tokens=False))


def test_matcher_rollback_and_fork(compiler):
    tok = compiler.tokenizer
    index = compiler.submit(schema_to_regex({"enum": ["alpha", "beta"]})).result()
    m = Matcher(index, (tok.eos_token_id,))
    child = m.fork()
    ids = tok.encode('"alpha"', add_special_tokens=False)
    assert all(m.advance(t) for t in ids) and m.is_terminated()
    m.rollback(len(ids))
    assert not m.is_terminated()
    assert not m.advance(tok.encode("x", add_special_tokens=False)[0])  # not allowed
    assert all(child.advance(t) for t in tok.encode('"beta"', add_special_tokens=False)) and child.is_terminated()


def test_lazy_tool_grammar_holds_a_started_call_to_the_schema(compiler):
    tok = compiler.tokenizer
    regex = HERMES.lazy_regex([("f", {"type": "object", "properties": {"a": {"type": "integer"}},
                                      "required": ["a"]})], True)
    index = compiler.submit(regex).result()
    m = Matcher(index, (tok.eos_token_id,))
    assert all(m.advance(t) for t in tok.encode("Free text, then <tool_call>\n", add_special_tokens=False))
    # inside the call only the schema's text is allowed
    words = -(-compiler.vocab_len // 32)
    allowed = "".join(tok.decode([t]) for t in _allowed(m, words))
    assert set(allowed) <= set('{"name: ') and tok.eos_token_id not in _allowed(m, words)


def test_a_grammar_that_compiles_too_long_is_stopped(tiny_model_dir):
    """An automaton that grows exponentially is cut off by the time limit (the child process
    is killed), the failure is remembered, and the compiler goes on serving other grammars,
    also while that one compiles (in the second child)."""
    from transformers import AutoTokenizer

    c = GrammarCompiler(AutoTokenizer.from_pretrained(tiny_model_dir), timeout=4)
    try:
        slow = c.submit("[ab]*a[ab]{40}")
        t = time.perf_counter()
        assert c.submit("(one|two)").result(timeout=30) is not None
        assert not slow.done(), f"the other grammar waited {time.perf_counter() - t:.1f} s"
        with pytest.raises(UnsupportedSchema, match="longer than 4 s"):
            slow.result(timeout=30)
        assert c.submit("(yes|no)").result(timeout=30) is not None
        with pytest.raises(UnsupportedSchema, match="longer than 4 s"):
            c.submit("[ab]*a[ab]{40}").result(timeout=0.1)  # known, not compiled again
    finally:
        c.shutdown()


def test_the_compiler_process_runs_below_the_server(compiler):
    """A compile beside serving gets a smaller share of a busy core than the model's threads."""
    import os

    from pageserve.grammar import worker

    compiler.submit("(low|priority)").result(timeout=60)
    child = compiler._workers[0]._proc
    assert child.poll() is None
    assert os.getpriority(os.PRIO_PROCESS, child.pid) == os.getpriority(os.PRIO_PROCESS, 0) + worker.NICE


def test_a_compile_cut_short_by_shutdown_blames_no_grammar(tiny_model_dir, caplog):
    """shutdown() kills the child mid-compile (a server that failed to bind its port, say):
    the compile ends saying so, not as "ran out of memory", and the grammar is not remembered
    as failing."""
    from transformers import AutoTokenizer

    c = GrammarCompiler(AutoTokenizer.from_pretrained(tiny_model_dir), timeout=60)
    c.submit("(yes|no)").result(timeout=30)  # the child is up
    slow = c.submit("[ab]*a[ab]{40}")
    time.sleep(1.0)
    c.shutdown()
    with pytest.raises(UnsupportedSchema, match="shutting down"):
        slow.result(timeout=30)
    assert "memory" not in caplog.text and not c._failed


def test_a_compiler_child_that_dies_says_how(tiny_model_dir, monkeypatch):
    """A child that exits for a reason other than its limits reports its exit, and the next
    compile starts a fresh child."""
    from transformers import AutoTokenizer

    from pageserve.grammar import worker

    c = GrammarCompiler(AutoTokenizer.from_pretrained(tiny_model_dir), timeout=60)
    try:
        monkeypatch.setattr(worker.CompileWorker, "command", [sys.executable, "-c", "import sys; sys.exit(3)"])
        with pytest.raises(UnsupportedSchema, match="exited with code 3") as e:
            c.submit("(yes|no)").result(timeout=30)
        assert "memory" not in str(e.value)
        monkeypatch.setattr(worker.CompileWorker, "command", [sys.executable, "-c", "import os; os.abort()"])
        with pytest.raises(UnsupportedSchema, match="ran out of memory"):  # what an allocation failure does
            c.submit("(maybe|never)").result(timeout=30)
        assert "(maybe|never)" in c._failed  # not compiled again
        # a SIGKILL may come from outside (an operator, the OOM killer for another process's
        # sake): this request fails, the grammar is compiled again next time
        killed = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
        monkeypatch.setattr(worker.CompileWorker, "command", [sys.executable, "-c", killed])
        with pytest.raises(UnsupportedSchema, match="was killed while compiling this grammar"):
            c.submit("(sometimes|often)").result(timeout=30)
        assert "(sometimes|often)" not in c._failed
        monkeypatch.setattr(worker.CompileWorker, "command", ["/nonexistent/python"])
        with pytest.raises(UnsupportedSchema, match="could not start"):
            c.submit("(perhaps|later)").result(timeout=30)
        monkeypatch.undo()
        assert c.submit("(hello|world)").result(timeout=30) is not None
        assert c.submit("(sometimes|often)").result(timeout=30) is not None
    finally:
        c.shutdown()


def test_a_call_cut_short_streams_what_was_written():
    parser = HERMES.stream_parser()
    deltas = parser.feed('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2') + parser.finish()
    assert deltas[0]["tool_calls"][0]["function"]["name"] == "f"
    assert "".join(d["tool_calls"][0]["function"].get("arguments", "") for d in deltas) == '{"a": [1, 2'
    assert HERMES.parse('<tool_call>\n{"name": "f", "arguments": {"a": [1, 2') == (None, [])
    # cut short before the call's name: no call, and none of its markup in the content
    parser = HERMES.stream_parser()
    deltas = parser.feed('ok <tool_call>\n{"na') + parser.finish()
    assert "".join(d["content"] for d in deltas) == "ok"  # the space waited for text that never came
    assert HERMES.parse('ok <tool_call>\n{"na') == ("ok", [])


def test_streamed_tool_calls_match_the_whole_parse():
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "nested": {"x": [1, {}]}}}'
            '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    content, calls = HERMES.parse(text)
    assert content == "Let me check." and [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 40)))
        parser, deltas = HERMES.stream_parser(), []
        for a, b in zip([0] + cuts, cuts + [len(text)]):
            deltas += parser.feed(text[a:b])
        deltas += parser.finish()
        streamed_content = "".join(d.get("content", "") for d in deltas)
        assert "<" not in streamed_content and streamed_content.strip() == "Let me check."
        got: dict[int, dict] = {}
        for d in deltas:
            for c in d.get("tool_calls", []):
                entry = got.setdefault(c["index"], {"name": "", "arguments": "", "id": None})
                if "id" in c:
                    assert entry["id"] is None  # id, type and name come once, first
                    entry["id"], entry["name"] = c["id"], c["function"]["name"]
                entry["arguments"] += c["function"].get("arguments", "")
        assert [got[i]["name"] for i in sorted(got)] == ["get_weather", "add"]
        for i, call in enumerate(calls):
            assert json.loads(got[i]["arguments"]) == json.loads(call["function"]["arguments"])


def test_tool_call_markup_never_reaches_content():
    """Whole or streamed: the start of a tag where the output was cut (max_tokens), a block that
    is not a valid call, a second call cut short after a complete one, a stray closing tag
    (free text under tool_choice auto may write one). A lone "<" is text, and so is a tag's
    start at the end of an output that stopped on its own."""
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    cases = {("a < b and <tool_ca", True): "a < b and", ("a < b and <tool_ca", False): "a < b and <tool_ca",
             ("<tool_call>not json</tool_call> after", False): "after", ("x <", True): "x <",
             (f"{call}\n<tool_call>\n{{\"name\": \"ad", True): None,
             (f"{call}\n<tool_call>\n{{\"name\": \"add\", \"arguments\": {{\"a\"", True): None,
             (f"{call}\n<tool_", True): None, (f"{call}\n</tool_", True): None,
             (f"Done.</tool_call> {call}</tool_call>\nBye", False): "Done. Bye"}
    for (text, cut_short), expected in cases.items():
        content, calls = HERMES.parse(text, cut_short)
        assert (content and " ".join(content.split())) == expected, text
        assert len(calls) == text.count(call)
        rng = random.Random(len(text))
        cuts = sorted(rng.sample(range(1, len(text)), min(5, len(text) - 1)))
        parser, deltas = HERMES.stream_parser(), []
        for a, b in zip([0] + cuts, cuts + [len(text)]):
            deltas += parser.feed(text[a:b])
        deltas += parser.finish(cut_short)
        streamed = "".join(d.get("content", "") for d in deltas)
        assert streamed == (content or ""), text  # exactly the whole parse's, whitespace too
        for d in deltas:
            for c in d.get("tool_calls", []):
                assert "<" not in c["function"].get("arguments", ""), text


def test_engine_constrained_requests_and_waiting_for_grammar(tiny_llm):
    """A random-weight model under a bounded schema always ends with valid JSON, also with
    n = 2; a request whose grammar is still compiling waits without holding up another."""
    engine = tiny_llm.engine
    schema = {"type": "object", "properties": {"k": {"enum": ["x", "yy"]},
                                               "v": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["k", "v"], "additionalProperties": False}
    params = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(json=schema))
    for out in tiny_llm.generate(["The quick brown fox", [5, 6, 7]], params, use_tqdm=False):
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), schema)

    slow: Future = Future()
    real_submit = engine.grammar.submit
    engine.grammar.submit = lambda regex, owner="": slow
    try:
        waiting = engine.add_request([5, 6, 7], SamplingParams(max_tokens=20, structured_outputs=StructuredOutputsParams(
            choice=["yes", "no"])), request_id="grammar-wait")
        other = engine.add_request([8, 9], SamplingParams(max_tokens=3, ignore_eos=True), request_id="plain")
    finally:
        engine.grammar.submit = real_submit
    done = {}
    for _ in range(50):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if "plain" in done:
            break
    assert "plain" in done and "grammar-wait" not in done
    assert engine.requests[waiting].status.name == "WAITING_FOR_GRAMMAR"
    slow.set_result(real_submit(engine.grammar.regex(StructuredOutputsParams(choice=["yes", "no"]))).result())
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done[waiting].outputs[0].text in ("yes", "no")
    assert other == "plain"

    engine.grammar.submit = lambda regex, owner="": Future()  # a compile that never ends
    try:
        aborted = engine.add_request([5, 6, 7], SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(
            choice=["a"])), request_id="grammar-abort")
    finally:
        engine.grammar.submit = real_submit
    engine.abort_request(aborted)  # a client gone while its grammar compiles: nothing of it is kept
    assert not engine.structured.waiting and not engine.has_unfinished_requests()


@pytest.mark.unit
def test_a_schema_whose_regex_would_be_huge_is_refused_before_it_is_built(monkeypatch):
    """Optional properties grow outlines-core's regex as their square: 60 untyped ones are under
    1 KB of JSON and tens of MB of regex. Refused from an estimate, never built; 300 optional
    strings are built and refused by their regex's length; all required, they are fine."""
    built = []
    real = json_schema.build_regex_from_schema
    monkeypatch.setattr(json_schema, "build_regex_from_schema", lambda *a: built.append(a) or real(*a))
    untyped = {"type": "object", "properties": {f"p{i}": {} for i in range(60)}}
    with pytest.raises(UnsupportedSchema, match="optional properties"):
        schema_to_regex(untyped)
    assert not built
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(300)}}
    with pytest.raises(UnsupportedSchema, match=str(json_schema.MAX_REGEX_CHARS)):
        schema_to_regex(wide)
    wide["required"] = list(wide["properties"])
    assert schema_to_regex(wide)
    with pytest.raises(UnsupportedSchema, match="64000"):
        schema_to_regex({"type": "object", "description": "d" * 70_000})


@pytest.mark.unit
def test_defs_in_a_tool_s_parameters_resolve():
    """A tool's parameters with $defs and "#/$defs/..." references: the call schema nests the
    parameters, so their $defs move to its root, where the references point."""
    from pageserve.grammar.regexes import json_call_regex

    params = {"type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
              "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    regex = json_call_regex([("f", params)])
    assert re.fullmatch(regex, '{"name": "f", "arguments": {"loc": {"city": "Oslo"}}}')
    assert not re.fullmatch(regex, '{"name": "f", "arguments": {"loc": 3}}')
    assert "$defs" in params  # the caller's schema is left as it was


@pytest.mark.unit
def test_the_size_estimate_is_linear_and_counts_what_outlines_writes_out(monkeypatch):
    """A chain of definitions each using the next one twice: 5 KB of JSON whose regex doubles at
    every link (outlines-core writes a $ref out in place). The estimate sizes each definition
    once, so it answers in a few hundred steps, and the schema is refused unbuilt. An array of
    any items costs what any value costs, so 120 of them are refused unbuilt too."""
    steps, built = [], []
    size_bound = json_schema._size_bound
    monkeypatch.setattr(json_schema, "_size_bound", lambda *a: steps.append(1) or size_bound(*a))
    monkeypatch.setattr(json_schema, "build_regex_from_schema", lambda *a: built.append(a) or "x")
    n = 40
    defs = {f"d{i}": {"type": "object", "required": ["a", "b"], "properties": {
        "a": {"$ref": f"#/$defs/d{i + 1}"}, "b": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    with pytest.raises(UnsupportedSchema, match="optional properties"):
        schema_to_regex({"$ref": "#/$defs/d0", "$defs": defs})
    assert len(steps) < 10 * n and not built
    with pytest.raises(UnsupportedSchema, match="optional properties"):
        schema_to_regex({"type": "object", "properties": {f"p{i}": {"type": "array"} for i in range(120)}})
    assert not built
