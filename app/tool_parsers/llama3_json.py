"""Llama 3.1 / 3.2 JSON calls: the output is `{"name": ..., "parameters": {...}}` (optionally
after `<|python_tag|>`), several separated by `; `, after any whitespace. Output that does not
start so is text."""

from __future__ import annotations

import json

from pageserve.app.tool_parsers.base import ToolFormat
from pageserve.app.tool_parsers.json_calls import JsonCalls
from pageserve.grammar.regexes import in_a_row, json_call_regex, opening_calls

PYTHON_TAG = "<|python_tag|>"

_SYSTEM = (
    "You can call functions to answer. To call one, reply with nothing but a JSON object "
    "{{\"name\": <function name>, \"parameters\": <its arguments as a JSON object>}}; for several "
    "calls, separate the objects with \"; \". Use literal values, not variables. The functions:\n\n{tools}")


class Llama3Json(ToolFormat):
    name = "llama3_json"
    starts = {PYTHON_TAG: "", "{": "{"}
    at_start_only = True

    def forced_regex(self, functions, parallel):
        return in_a_row(json_call_regex(functions, "parameters"), ";[ ]?", parallel)

    def lazy_regex(self, functions, parallel):
        return opening_calls(self.forced_regex(functions, parallel), ("{", PYTHON_TAG[:2]))

    def region(self):
        return JsonCalls(separator=";")

    def system_prompt(self, tools):
        return _SYSTEM.format(tools="\n\n".join(json.dumps(t, indent=4, ensure_ascii=False) for t in tools))

    def write_calls(self, calls):
        return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False)
                         for c in calls)
