"""Pythonic calls (Llama 3.2, Llama 4): the output is a Python list of calls with literal
keyword arguments, `[get_weather(city="Paris"), add(a=1, b=2)]`. Output that does not start
with `[` (after any whitespace) is text."""

from __future__ import annotations

import ast
import json

from pageserve.app.tool_parsers.base import ToolFormat
from pageserve.app.tool_parsers.stream import StreamParser
from pageserve.grammar.regexes import in_a_row, opening_calls, python_call_regex

_SYSTEM = (
    "You can call functions to answer. To call them, reply with nothing but a Python list of the "
    "calls, [name(key=value, ...), other_name(...)], with literal values, not variables. The "
    "functions:\n\n{tools}")


class Pythonic(ToolFormat):
    name = "pythonic"
    starts = {"[": "["}
    at_start_only = True

    def forced_regex(self, functions, parallel):
        return f"\\[{in_a_row(python_call_regex(functions), ',[ ]?', parallel)}\\]"

    def lazy_regex(self, functions, parallel):
        return opening_calls(self.forced_regex(functions, parallel), ("[",))

    def region(self):
        return PythonCalls()

    def system_prompt(self, tools):
        return _SYSTEM.format(tools="\n\n".join(json.dumps(t, indent=4, ensure_ascii=False) for t in tools))

    def write_calls(self, calls):
        def call(c):
            args = c["arguments"] if isinstance(c["arguments"], dict) else {}
            return f"{c['name']}({', '.join(f'{k}={python_literal(v)}' for k, v in args.items())})"
        return f"[{', '.join(call(c) for c in calls)}]"


def python_literal(value) -> str:
    """A JSON value written as a Python literal."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, list):
        return f"[{', '.join(python_literal(v) for v in value)}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k), ensure_ascii=False)}: {python_literal(v)}"
                               for k, v in value.items()) + "}"
    return json.dumps(value, ensure_ascii=False)


class PythonCalls:
    """`[`, calls `name(key=value, ...)` separated by commas, `]`. Each call is announced at its
    `(`; its arguments stream as JSON, one keyword argument at a time, as each value ends."""

    def __init__(self):
        self.state = "open"  # open / name / args / after / skip
        self.name: list[str] = []  # the call's name so far

    def feed(self, text: str, parser: StreamParser) -> str | None:
        for i, c in enumerate(text):
            if self.state == "args":
                self._argument_char(c, parser)
            elif self.state == "skip":
                return None  # not a list of calls: the rest of the output is left out
            elif c.isspace() and not (self.state == "name" and self.name):
                continue
            elif self.state == "open":
                self.state = "name" if c == "[" else "skip"
            elif self.state == "name" and (c.isalnum() or c == "_"):
                self.name.append(c)
            elif self.state == "name" and c == "(" and "".join(self.name).isidentifier():
                parser.open_call("".join(self.name))
                self.state, self.arg, self.args, self.depth, self.quote, self.escape = "args", [], {}, 0, None, False
            elif self.state == "after" and c == ",":
                self.state, self.name = "name", []
            elif self.state in ("after", "name") and c == "]" and not self.name:
                return text[i + 1:]
            else:
                self.state = "skip"
        return None

    def _argument_char(self, c: str, parser: StreamParser) -> None:
        if self.quote is not None:  # inside a string literal
            self.escape, done = (False, False) if self.escape else (c == "\\", c == self.quote)
            self.quote = None if done else self.quote
        elif c in "'\"":
            self.quote = c
        elif c in "([{":
            self.depth += 1
        elif c in ")]}" and self.depth:
            self.depth -= 1
        elif c in ",)" and not self.depth:  # the end of a keyword argument, or of the call
            arg = "".join(self.arg)
            if arg.strip() and not self._argument(arg, parser):
                parser.close_call(False)
                self.state = "skip"
                return
            if c == ")":
                parser.add_arguments("}" if self.args else "{}")
                parser.close_call(True)
                self.state, self.name = "after", []
            self.arg = []
            return
        self.arg.append(c)

    def _argument(self, arg: str, parser: StreamParser) -> bool:
        key, eq, value = arg.partition("=")
        key = key.strip()
        try:
            if not eq or not key.isidentifier():
                raise ValueError(arg)
            source = value.strip()
            value = _value(ast.parse(source, mode="eval").body, source)
        except (SyntaxError, ValueError):
            return False
        try:  # a literal such as 1e400 is a float Python keeps as inf, which JSON cannot write
            written = json.dumps(value, ensure_ascii=False, allow_nan=False)
        except ValueError:
            return False
        parser.add_arguments(("{" if not self.args else ", ") + json.dumps(key, ensure_ascii=False) + ": " + written)
        self.args[key] = value
        return True


def _value(node: ast.expr, source: str):
    """A literal's value; a double-quoted string is read as JSON reads it (the grammar writes
    JSON strings), others as Python does."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        segment = ast.get_source_segment(source, node) or ""
        if segment.startswith('"'):
            try:
                return json.loads(segment)
            except json.JSONDecodeError:
                pass
        return node.value
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (bool, int, float))):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and \
            isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_value(e, source) for e in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
        return {k.value: _value(v, source) for k, v in zip(node.keys, node.values)}
    raise ValueError("tool call arguments must be literals")
