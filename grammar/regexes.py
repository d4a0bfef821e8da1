"""Regexes for the other structured-output kinds: a choice among strings, any JSON object,
and the pieces that tool-call grammars are made of (app/tool_parsers/ puts them together, one
format each): a call as a JSON object or as a Python call with literal arguments, calls in a
row, free text that never writes a word, free text that does not start with one; and the
limits past which tools are refused rather than made into a grammar."""

from __future__ import annotations

import json
import keyword
import re

from pageserve.grammar.json_schema import MAX_REGEX_CHARS, UnsupportedSchema, regex_size_bound, schema_to_regex

ANY = r"[\s\S]"  # any character, newlines too
SPACE = " \t\r\n"  # whitespace a model may write before calls that open its output
_SPACE = "[ \\t\\r\\n]"

# Tools past these limits are refused with a 400 naming `tools`, rather than compiled for minutes.
# The test suites' tools take under 1,000 characters and give calls of under 3,000.
MAX_TOOLS_SCHEMA_CHARS = 64_000  # the functions' names and parameters, written as JSON
MAX_TOOL_REGEX_CHARS = MAX_REGEX_CHARS  # the regex of one call; a format's grammar holds it up to 3 times


def choice_regex(choices: list[str]) -> str:
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise UnsupportedSchema("choice must be a non-empty list of non-empty strings")
    return "|".join(f"({re.escape(c)})" for c in choices)


def json_object_regex() -> str:
    """Any JSON object (nesting to the depth outlines-core allows)."""
    return schema_to_regex({"type": "object"})


def avoiding(word: str) -> tuple[str, str]:
    """Strings that do not contain `word` (whose first character appears only once in it), as
    (chunk, tail): such a string is chunks, then at most one tail. This is the automaton that
    tracks how much of `word` was just read, written as a regex."""
    first = re.escape(word[0])
    if word[0] in word[1:]:
        raise ValueError("avoiding() needs a word whose first character does not recur")
    prefixes = [re.escape(word[1:i]) for i in range(1, len(word))]  # what may follow the first char
    # from "just read the first char", back to it: a partial match then the first char again
    loop = f"(?:(?:{'|'.join(prefixes)}){first})*"
    # ... or out to the start: a partial match then a character that breaks it
    exits = "|".join(f"{re.escape(word[1:i])}[^{re.escape(word[i])}{first}]" for i in range(1, len(word)))
    chunk = f"(?:[^{first}]|{first}{loop}(?:{exits}))"
    tail = f"(?:{first}{loop}(?:{'|'.join(prefixes)}))"
    return chunk, tail


def free_text_and_calls(word: str, region: str, again: bool) -> str:
    """tool_choice auto where calls may follow free text: text that never writes `word`, except
    as the start of `region` (the calls); after a region, free text and more regions when
    `again`, else nothing. Never empty: the compiler anchors every regex with `$`, which
    outlines-core cannot do for a regex that matches the empty string."""
    chunk, tail = avoiding(word)
    if again:
        free = f"{chunk}*{tail}?"
        return f"(?:{chunk}+{tail}?|{tail}|{region}{free})({region}{free})*"
    return f"(?:{chunk}+(?:{tail}|{region})?|{tail}|{region})"


def opening_calls(calls: str, starts: tuple[str, ...]) -> str:
    """tool_choice auto where calls may only open the output: `calls` after any whitespace (a
    model often writes a newline or two first, as after a think block), or free text that does
    not start so (see not_starting_with)."""
    return f"{_SPACE}*(?:{calls})|{not_starting_with(starts)}"


def not_starting_with(starts: tuple[str, ...]) -> str:
    """Free text (at least one character) that, after any whitespace, starts with none of
    `starts`, each one or two characters long (a longer word is kept out by its first two: the
    automaton that tracks a long one compiles too slowly). Whitespace alone is text too."""
    firsts = "".join(dict.fromkeys(s[0] for s in starts))
    ways = [f"[^{re.escape(firsts)}{_SPACE[1:-1]}]{ANY}*"]
    for first in firsts:
        if first not in starts:  # only longer starts begin so: the first character alone is text
            seconds = "".join(s[1] for s in starts if len(s) == 2 and s[0] == first)
            ways.append(f"{re.escape(first)}(?:[^{re.escape(seconds)}]{ANY}*)?")
    return f"{_SPACE}*(?:{'|'.join(f'(?:{w})' for w in ways)})|{_SPACE}+"


def in_a_row(call: str, separator: str, parallel: bool) -> str:
    """One `call`, or several separated by `separator` when `parallel`."""
    return f"(?:{call})(?:{separator}(?:{call}))*" if parallel else f"(?:{call})"


def call_schema(name: str, parameters: dict | None, arguments_key: str = "arguments") -> dict:
    """One call of function `name`: {"name": name, <arguments_key>: <its parameters>}."""
    params = dict(parameters) if parameters else {"type": "object", "properties": {}}
    # "#/$defs/X" in the parameters points at the document's root: their $defs go there
    defs = {key: params.pop(key) for key in ("$defs", "definitions") if key in params}
    return {"type": "object", "properties": {"name": {"const": name}, arguments_key: params},
            "required": ["name", arguments_key], "additionalProperties": False, **defs}


def json_call_regex(functions: list[tuple[str, dict | None]], arguments_key: str = "arguments") -> str:
    """One JSON call object of one of `functions`, with arguments that match its parameters."""
    return _one_of(functions, lambda n, p: schema_to_regex(call_schema(n, p, arguments_key)))


def _one_of(functions: list[tuple[str, dict | None]], one) -> str:
    """`one(name, parameters)` of each function, as alternatives; UnsupportedSchema (a 400 naming
    `tools`) past MAX_TOOLS_SCHEMA_CHARS or MAX_TOOL_REGEX_CHARS."""
    try:
        size = len(json.dumps(functions, ensure_ascii=False, default=str))
        if size > MAX_TOOLS_SCHEMA_CHARS:
            raise UnsupportedSchema(f"the tools' names and parameters take {size} characters as JSON, more than "
                                    f"the {MAX_TOOLS_SCHEMA_CHARS} that can be made into a grammar; send fewer "
                                    f"tools or smaller parameter schemas")
        bounds = [regex_size_bound(p or {"properties": {}}) for _, p in functions]
    except RecursionError:
        raise UnsupportedSchema("the tools' parameters are nested too deeply") from None
    pieces, total = [], 0
    for (name, parameters), bound in zip(functions, bounds):
        # a few KB of JSON can ask outlines-core for gigabytes: what is surely too large is never built
        if total + bound > 8 * MAX_TOOL_REGEX_CHARS:
            total = 8 * MAX_TOOL_REGEX_CHARS
        else:
            pieces.append(f"({one(name, parameters)})")
            total += len(pieces[-1]) + 1
        if total > MAX_TOOL_REGEX_CHARS:
            raise UnsupportedSchema(f"the tools make a grammar of more than {MAX_TOOL_REGEX_CHARS} regex "
                                    f"characters per call (at {name!r}), too large to compile; send fewer "
                                    f"tools, or fewer optional properties (their regex grows as their square)")
    return "|".join(pieces)


# ---- Python calls: name(key=value, ...) with Python literals ----

# booleans and null become placeholder strings in the schema, and Python's words in the regex
_PY_WORDS = {"PSPYTRUE": "True", "PSPYFALSE": "False", "PSPYNONE": "None", "PSPYBOOL": "(True|False)"}
_PY_CONST = {True: "PSPYTRUE", False: "PSPYFALSE", None: "PSPYNONE"}
_SCHEMAS = ("items", "additionalProperties", "anyOf", "oneOf", "allOf", "prefixItems")
_PARAMETER_KEYS = {"type", "properties", "required", "additionalProperties", "title", "description",
                   "$defs", "definitions", "$schema", "strict"}


def python_call_regex(functions: list[tuple[str, dict | None]]) -> str:
    """One Python call `name(key=value, ...)` of one of `functions`: keyword arguments in the
    order of the parameters' properties (those not required may be left out), values written as
    Python literals (True, False, None; strings, lists and dicts as in JSON) that match their
    schemas."""
    return _one_of(functions, _one_python_call)


def _one_python_call(name: str, parameters: dict | None) -> str:
    if not name.isidentifier() or keyword.iskeyword(name):
        raise UnsupportedSchema(f"the function name {name!r} is not a Python identifier, which pythonic "
                                f"tool calls need")
    params = parameters or {"type": "object", "properties": {}}
    if params.get("type", "object") != "object" or set(params) - _PARAMETER_KEYS:
        raise UnsupportedSchema(f"pythonic tool calls need the parameters of {name!r} to be an object "
                                f"with properties (keyword arguments)")
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    required, properties = params.get("required", []), params.get("properties") or {}
    if not isinstance(properties, dict) or not isinstance(required, list) \
            or not all(isinstance(r, str) for r in required):
        raise UnsupportedSchema(f"the parameters of {name!r} need 'properties' as an object and 'required' "
                                f"as an array of names")
    arguments = []
    for key, schema in properties.items():
        if not key.isidentifier() or keyword.iskeyword(key):
            raise UnsupportedSchema(f"the parameter {key!r} of {name!r} is not a Python identifier, which "
                                    f"pythonic tool calls need")
        schema = {**schema, **defs} if isinstance(schema, dict) else {}
        arguments.append((f"{key}=({python_literal_regex(schema)})", key in required))
    return f"{re.escape(name)}\\({_in_order(arguments, ',[ ]?')}\\)"


def _in_order(items: list[tuple[str, bool]], separator: str) -> str:
    """The items in order, separated, each optional one present or not."""
    if not items:
        return ""
    tails = [""] * (len(items) + 1)  # tails[i]: items i.. each with its separator before it
    for i in reversed(range(len(items))):
        regex, required = items[i]
        tails[i] = (f"{separator}{regex}" if required else f"(?:{separator}{regex})?") + tails[i + 1]
    firsts = []
    for i, (regex, required) in enumerate(items):
        firsts.append(regex + tails[i + 1])
        if required:
            break
    else:
        firsts.append("")  # every argument optional: none at all
    return "(?:" + "|".join(firsts) + ")"


def python_literal_regex(schema: dict) -> str:
    """The Python literals of the JSON values `schema` accepts."""
    regex = schema_to_regex(_pythonic(schema))
    for marker, word in _PY_WORDS.items():
        regex = regex.replace(f'"{marker}"', word)
    # outlines-core's "any value" (untyped parts of the schema) spells these as one alternation
    return regex.replace("(true|false)|null", "(True|False)|None")


def _pythonic(node):
    """The schema with JSON's true, false and null swapped for placeholders."""
    if isinstance(node, list):
        return [_pythonic(v) for v in node]
    if not isinstance(node, dict):
        return node
    kind = node.get("type")
    if isinstance(kind, list):
        return {"anyOf": [_pythonic({**node, "type": t}) for t in kind]}
    out = {}
    for key, value in node.items():
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            out[key] = {k: _pythonic(v) for k, v in value.items()}
        elif key in _SCHEMAS:
            out[key] = _pythonic(value)
        elif key == "enum" and isinstance(value, list):
            out[key] = [_PY_CONST.get(v, v) if v is None or isinstance(v, bool) else v for v in value]
        elif key == "const":
            out[key] = _PY_CONST.get(value, value) if value is None or isinstance(value, bool) else value
        else:
            out[key] = value
    if "enum" in out or "const" in out:
        out.pop("type", None)
    elif kind == "boolean":
        return {"const": "PSPYBOOL"}
    elif kind == "null":
        return {"const": "PSPYNONE"}
    return out
