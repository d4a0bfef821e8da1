"""What every tool-call format has: its markup, its grammars, its parser and its prompt.

The interface the chat and Responses routes use (through `plan_tools` in app/tools.py and
`tool_format(name)`):
- `forced_regex(functions, parallel)` / `lazy_regex(functions, parallel)`: the grammar for
  tool_choice required or a named function, and for auto (free text until the format's call
  start, then held to a valid call). `functions`: [(name, parameters schema)]. ValueError (an
  UnsupportedSchema) for what the format cannot enforce, or tools too large for a grammar.
- `parse(text, cut_short) -> (content, calls)`: a whole output; calls as OpenAI `tool_calls`,
  their arguments the text streamed for them; a call cut short or not valid is left out.
- `stream_parser()`: a StreamParser with `feed(text) -> deltas`, `finish(cut_short) -> deltas`
  and `num_calls`; deltas are chat `delta` objects (`content`, or `tool_calls` with index, id,
  type and function.name first, then function.arguments fragments).
- `chat_dicts(messages, tools, template) -> (message dicts, tools for the template)`: the
  conversation as the chat template takes it. A template that renders tools gets them (and
  earlier calls with their arguments as objects); for one that does not, the tools go into a
  system prompt and earlier calls and results are written in the format's own markup."""

from __future__ import annotations

import json
import re
import uuid

from pageserve.app.tool_parsers.stream import StreamParser


class ToolFormat:
    name = ""
    starts: dict[str, str] = {}  # markup that opens the calls -> the part of it that is the calls' text
    markup: tuple[str, ...] = ()  # other markup, never content (a stray closing tag)
    at_start_only = False  # calls may only open the output (else they may follow free text)

    # ---- grammar ----

    def forced_regex(self, functions: list[tuple[str, dict | None]], parallel: bool) -> str:
        raise NotImplementedError

    def lazy_regex(self, functions: list[tuple[str, dict | None]], parallel: bool) -> str:
        raise NotImplementedError

    # ---- output ----

    def region(self):
        """A fresh scanner for one region of calls (after its start markup)."""
        raise NotImplementedError

    def new_call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def stream_parser(self) -> StreamParser:
        return StreamParser(self)

    def parse(self, text: str, cut_short: bool = False) -> tuple[str | None, list[dict]]:
        parser = self.stream_parser()
        parser.feed(text)
        parser.finish(cut_short)
        return parser.result()

    # ---- prompt ----

    def system_prompt(self, tools: list[dict]) -> str:
        """The tools, described in the format's own style, for a template that cannot."""
        raise NotImplementedError

    def write_calls(self, calls: list[dict]) -> str:
        """Earlier calls ({"id", "name", "arguments"}) as the model would have written them."""
        raise NotImplementedError

    def write_result(self, text: str, call_id: str | None, name: str | None) -> str:
        return json.dumps({"output": text}, ensure_ascii=False)

    def template_call_id(self, call_id: str | None) -> str | None:
        """A call id as the format's template expects it."""
        return call_id

    def chat_dicts(self, messages: list, tools: list | None, template: str,
                   image_placeholder: str = "") -> tuple[list[dict], list | None]:
        native_tools, native_calls = "tools" in template, "tool_calls" in template
        names = {c.id: c.function.name for m in messages for c in m.tool_calls or ()}
        # OpenAI's developer messages are system messages to a template that knows no such role
        developer = "developer" if re.search(r"""['"]developer['"]""", template) else "system"
        out = []
        for m in messages:
            d = {"role": developer if m.role == "developer" else m.role, "content": m.text(image_placeholder)}
            if m.name is not None:
                d["name"] = m.name
            if m.reasoning_content or m.reasoning:  # templates that show past thinking read this name
                d["reasoning_content"] = m.reasoning_content or m.reasoning
            if m.tool_calls:
                calls = [{"id": c.id, "name": c.function.name, "arguments": _arguments(c.function.arguments)}
                         for c in m.tool_calls]
                if native_calls:  # templates write the arguments with tojson: give them the object
                    d["tool_calls"] = [{"id": self.template_call_id(c["id"]), "type": "function",
                                        "function": {"name": c["name"], "arguments": c["arguments"]}}
                                       for c in calls]
                else:
                    d["content"] = "\n".join(([d["content"]] if d["content"] else []) + [self.write_calls(calls)])
            if m.role == "tool" and not native_calls:
                d = {"role": "user", "content": self.write_result(m.text(image_placeholder), m.tool_call_id, names.get(m.tool_call_id))}
            elif m.tool_call_id is not None:
                d["tool_call_id"] = self.template_call_id(m.tool_call_id)
                if m.role == "tool" and "name" not in d and m.tool_call_id in names:
                    d["name"] = names[m.tool_call_id]  # some templates name the function a result is from
            out.append(d)
        if not tools:
            return out, None
        tool_dicts = [tool_dict(t) for t in tools]
        if native_tools:
            return out, tool_dicts
        system = self.system_prompt(tool_dicts)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
        return out, None


def function_of(tool):
    """The function definition of a tool: a chat tool's `function`, or a Responses API tool
    (which is its own definition)."""
    return getattr(tool, "function", tool)


def tool_dict(tool) -> dict:
    """A tool as chat templates take it: {"type": "function", "function": {...}}."""
    f = function_of(tool)
    fields = {"name": f.name, "description": f.description, "parameters": f.parameters}
    return {"type": "function", "function": {k: v for k, v in fields.items() if v is not None}}


def _arguments(text: str):
    try:
        return json.loads(text or "{}")
    except (json.JSONDecodeError, RecursionError):  # a template gets the text as it came
        return text
