"""Regexes for the other structured-output kinds: a choice among strings, any JSON object,
and Hermes-style tool calls (forced, or lazily after free text)."""

from __future__ import annotations

import re

from pageserve.grammar.json_schema import UnsupportedSchema, schema_to_regex

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


def choice_regex(choices: list[str]) -> str:
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise UnsupportedSchema("choice must be a non-empty list of non-empty strings")
    return "|".join(f"({re.escape(c)})" for c in choices)


def json_object_regex() -> str:
    """Any JSON object (nesting to the depth outlines-core allows)."""
    return schema_to_regex({"type": "object"})


def call_schema(name: str, parameters: dict | None) -> dict:
    """One call of function `name`: {"name": name, "arguments": <its parameters>}."""
    params = parameters if parameters else {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def tool_calls_regex(functions: list[tuple[str, dict | None]], parallel: bool) -> str:
    """One `<tool_call>{...}</tool_call>` block calling one of `functions` (with arguments that
    match its parameters), or several when `parallel`."""
    calls = "|".join(f"({schema_to_regex(call_schema(n, p))})" for n, p in functions)
    block = f"{re.escape(TOOL_CALL_OPEN)}\\n?({calls})\\n?{re.escape(TOOL_CALL_CLOSE)}"
    return f"{block}(\\n?{block})*" if parallel else block


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


def lazy_tool_calls_regex(functions: list[tuple[str, dict | None]]) -> str:
    """tool_choice auto: free text, but a `<tool_call>` the model starts must go on as a valid
    call of one of the tools (then free text again)."""
    chunk, tail = avoiding(TOOL_CALL_OPEN)
    free = f"{chunk}*{tail}?"
    calls = "|".join(f"({schema_to_regex(call_schema(n, p))})" for n, p in functions)
    block = f"{re.escape(TOOL_CALL_OPEN)}\\n?({calls})\\n?{re.escape(TOOL_CALL_CLOSE)}"
    # never empty (at least one character, or a call): the compiler anchors every regex with
    # `$`, which outlines-core cannot do for a regex that matches the empty string
    return f"(?:{chunk}+{tail}?|{tail}|{block}{free})({block}{free})*"
