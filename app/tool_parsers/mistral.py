"""Mistral: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}`, after any
free text. Call ids are 9 letters and digits, which Mistral's templates check."""

from __future__ import annotations

import json
import re
import secrets
import string

from pageserve.app.tool_parsers.base import ToolFormat
from pageserve.app.tool_parsers.json_calls import JsonCalls
from pageserve.grammar.regexes import free_text_and_calls, in_a_row, json_call_regex

TOOL_CALLS = "[TOOL_CALLS]"
_ALPHANUMERIC = string.ascii_letters + string.digits

_SYSTEM = (
    "[AVAILABLE_TOOLS] {tools}[/AVAILABLE_TOOLS]\n"
    "To call tools, write [TOOL_CALLS] followed by a JSON list of the calls, each "
    "{{\"name\": <function name>, \"arguments\": <its arguments as a JSON object>}}.")


class Mistral(ToolFormat):
    name = "mistral"
    starts = {TOOL_CALLS: ""}

    def forced_regex(self, functions, parallel):
        return f"{re.escape(TOOL_CALLS)} ?\\[{in_a_row(json_call_regex(functions), ',[ ]?', parallel)}\\]"

    def lazy_regex(self, functions, parallel):
        return free_text_and_calls(TOOL_CALLS, self.forced_regex(functions, parallel), again=False)

    def region(self):
        return JsonCalls(opener="[", separator=",", closer="]")

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))

    def template_call_id(self, call_id):
        """The last 9 letters and digits of an id from elsewhere (zero-padded), so that a call and
        its result keep matching ids."""
        if call_id is None:
            return None
        return re.sub(r"[^A-Za-z0-9]", "", call_id)[-9:].rjust(9, "0")

    def system_prompt(self, tools):
        return _SYSTEM.format(tools=json.dumps(tools, ensure_ascii=False))

    def write_calls(self, calls):
        return TOOL_CALLS + json.dumps([{"name": c["name"], "arguments": c["arguments"],
                                         "id": self.template_call_id(c["id"])} for c in calls], ensure_ascii=False)

    def write_result(self, text, call_id, name):
        result = {"content": text, "call_id": self.template_call_id(call_id)}
        return f"[TOOL_RESULTS]{json.dumps(result, ensure_ascii=False)}[/TOOL_RESULTS]"
