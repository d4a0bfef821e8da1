"""Hermes (Qwen2.5, Hermes 2/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks, anywhere in free text, one call each."""

from __future__ import annotations

import json
import re

from pageserve.app.tool_parsers.base import ToolFormat
from pageserve.app.tool_parsers.json_calls import JsonCalls
from pageserve.grammar.regexes import free_text_and_calls, in_a_row, json_call_regex

OPEN, CLOSE = "<tool_call>", "</tool_call>"

_SYSTEM = (
    "You can call functions to answer. The functions are described inside <tools></tools> tags:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, write a JSON object with its name and arguments inside <tool_call></tool_call> "
    "tags, like this:\n<tool_call>\n{{\"name\": \"<function name>\", \"arguments\": <arguments as a JSON "
    "object>}}\n</tool_call>\nWrite one such block for each call.")


class Hermes(ToolFormat):
    name = "hermes"
    starts = {OPEN: ""}
    markup = (CLOSE,)

    def _block(self, functions) -> str:
        return f"{re.escape(OPEN)}\\n?({json_call_regex(functions)})\\n?{re.escape(CLOSE)}"

    def forced_regex(self, functions, parallel):
        return in_a_row(self._block(functions), "\\n?", parallel)

    def lazy_regex(self, functions, parallel):
        return free_text_and_calls(OPEN, self._block(functions), again=parallel)

    def region(self):
        return JsonCalls(closer=CLOSE)

    def system_prompt(self, tools):
        return _SYSTEM.format(tools="\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools))

    def write_calls(self, calls):
        return "\n".join(f"{OPEN}\n{json.dumps({'name': c['name'], 'arguments': c['arguments']}, ensure_ascii=False)}"
                         f"\n{CLOSE}" for c in calls)

    def write_result(self, text, call_id, name):
        return f"<tool_response>\n{text}\n</tool_response>"
