"""Tool calling, Hermes style: tools into the prompt, a grammar for `tool_choice`, and the
model's `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks parsed back into
OpenAI `tool_calls`, whole or streamed.

- `required` / a named function: the grammar forces one call (or several with
  `parallel_tool_calls`) whose arguments match the function's `parameters` schema.
- `auto` (needs `--enable-auto-tool-choice --tool-call-parser hermes`, as in vLLM): free text,
  but a `<tool_call>` the model starts is held to a valid call until its closing tag.
- `none`: the tools are shown to the model, nothing is constrained or parsed."""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass

from pageserve.app.errors import bad_request
from pageserve.app.protocol import ChatCompletionRequest, ChatMessage
from pageserve.grammar.regexes import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, lazy_tool_calls_regex, tool_calls_regex
from pageserve.sampling.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

TOOL_PARSERS = ("hermes",)


@dataclass(slots=True)
class ToolPlan:
    grammar: StructuredOutputsParams | None  # None: free text (tool_choice none)
    parse: bool  # turn <tool_call> blocks of the output into tool_calls


def plan_tools(body: ChatCompletionRequest, enable_auto: bool) -> ToolPlan | None:
    if not body.tools:
        if body.tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    choice = body.tool_choice or "auto"
    functions = [(t.function.name, t.function.parameters) for t in body.tools]
    if choice == "none":
        return ToolPlan(None, False)
    try:
        if choice == "auto":
            if not enable_auto:
                raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and '
                                  '--tool-call-parser to be set', "tool_choice")
            regex = lazy_tool_calls_regex(functions)
        elif choice == "required":
            regex = tool_calls_regex(functions, body.parallel_tool_calls)
        else:
            named = [f for f in functions if f[0] == choice.function.name]
            if not named:
                raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is "
                                  f"not among the tools", "tool_choice")
            regex = tool_calls_regex(named, False)
    except ValueError as e:  # a parameters schema we cannot enforce
        raise bad_request(str(e), "tools") from None
    return ToolPlan(StructuredOutputsParams(regex=regex, source="tools"), True)


# ---- the prompt ----

_SYSTEM = (
    "You can call functions to answer. The functions are described inside <tools></tools> tags:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, write a JSON object with its name and arguments inside <tool_call></tool_call> "
    "tags, like this:\n<tool_call>\n{{\"name\": \"<function name>\", \"arguments\": <arguments as a JSON "
    "object>}}\n</tool_call>\nWrite one such block for each call.")


def chat_dicts(messages: list[ChatMessage], tools: list | None, template: str) -> tuple[list[dict], list | None]:
    """Messages for the chat template, and the tools to pass it. A template that renders tools
    itself gets them as they are; for one that does not, the tools go into a system prompt, and
    earlier tool calls and tool results are written in the same Hermes tags."""
    native_tools = "tools" in template
    native_calls = "tool_calls" in template
    out = []
    for m in messages:
        d = {"role": m.role, "content": m.text()}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_calls:
            calls = [{"id": c.id, "type": c.type, "function": {"name": c.function.name,
                                                              "arguments": c.function.arguments}}
                     for c in m.tool_calls]
            if native_calls:  # templates write the arguments with tojson: give them the object
                d["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _call_json(c)["arguments"]}}
                                   for c in calls]
            else:
                blocks = [f"{TOOL_CALL_OPEN}\n{json.dumps(_call_json(c), ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"
                          for c in calls]
                d["content"] = "\n".join(([d["content"]] if d["content"] else []) + blocks)
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.role == "tool" and not native_calls:
            d = {"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"}
        out.append(d)
    if not tools:
        return out, None
    tool_dicts = [t.model_dump(by_alias=True, exclude_none=True) for t in tools]
    if native_tools:
        return out, tool_dicts
    system = _SYSTEM.format(tools="\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tool_dicts))
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{system}"}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out, None


def _call_json(call: dict) -> dict:
    try:
        arguments = json.loads(call["function"]["arguments"] or "{}")
    except json.JSONDecodeError:
        arguments = call["function"]["arguments"]
    return {"name": call["function"]["name"], "arguments": arguments}


# ---- the output ----

_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_CLOSE), re.S)
_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str, cut_short: bool = False) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a whole output. Markup of the format never reaches the
    content: a call cut short (max_tokens) is left out, as is a block that is not a valid call
    (the grammar allows none; one here means the output was not constrained as planned) and a
    stray closing tag (the grammar keeps free text from opening a call, not from closing one).
    `cut_short`: the output ended at max_tokens, so a tag's start at its end is markup too."""
    calls, kept, last = [], [], 0
    for m in _BLOCK.finditer(text):
        kept.append(_free_text(text[last:m.start()]))
        last = m.end()
        try:
            obj = json.loads(m.group(1))
            name, arguments = obj["name"], obj["arguments"]
            if not isinstance(name, str):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError):
            logger.warning("left out a %s block that is not a valid call", TOOL_CALL_OPEN)
            continue
        calls.append({"id": new_call_id(), "type": "function",
                      "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
    rest = text[last:]
    cut = rest.find(TOOL_CALL_OPEN)
    rest = rest[:cut] if cut >= 0 else rest[:len(rest) - (_tag_start(rest) if cut_short else 0)]
    kept.append(_free_text(rest))
    content = "".join(kept).strip()
    return (content or None), calls


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _tag_start(text: str) -> int:
    """Length of a tag's start that ends a cut-short output (a lone "<" is text)."""
    n = max(_held_prefix(text, TOOL_CALL_OPEN), _held_prefix(text, TOOL_CALL_CLOSE))
    return n if n >= 2 else 0


def _free_text(text: str) -> str:
    """Text outside the calls, less any stray closing tag."""
    return text.replace(TOOL_CALL_CLOSE, "")


class StreamingToolParser:
    """Turns streamed text into chat deltas: `content` outside the tags; for each call, a
    first delta with `index`, `id`, `type` and `function.name`, then `function.arguments`
    fragments. No piece of a tag ever reaches `content`."""

    def __init__(self):
        self.buffer = ""  # text not yet handed out
        self.in_call = False
        self.num_calls = 0
        self.call_text = ""
        self.header_sent = False
        self.args_sent = 0

    def feed(self, text: str) -> list[dict]:
        self.buffer += text
        deltas: list[dict] = []
        while True:
            if not self.in_call:
                at = self.buffer.find(TOOL_CALL_OPEN)
                if at < 0:
                    keep = max(_held_prefix(self.buffer, TOOL_CALL_OPEN), _held_prefix(self.buffer, TOOL_CALL_CLOSE))
                    self._content(deltas, _free_text(self.buffer[:len(self.buffer) - keep]))
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return deltas
                before = _free_text(self.buffer[:at])
                self._content(deltas, before.rstrip("\n") if self.num_calls else before)
                self.buffer = self.buffer[at + len(TOOL_CALL_OPEN):]
                self.in_call, self.call_text, self.header_sent, self.args_sent = True, "", False, 0
            at = self.buffer.find(TOOL_CALL_CLOSE)
            if at < 0:
                keep = _held_prefix(self.buffer, TOOL_CALL_CLOSE)
                self.call_text += self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                self._call_progress(deltas, final=False)
                return deltas
            self.call_text += self.buffer[:at]
            self.buffer = self.buffer[at + len(TOOL_CALL_CLOSE):].lstrip("\n")
            self._call_progress(deltas, final=True)
            self.in_call = False

    def finish(self, cut_short: bool = False) -> list[dict]:
        """At the end of the output: whatever was held back that is not markup. A call cut
        short (max_tokens) before its name was complete is left out; one already announced
        gets the rest of the arguments written (the buffer then holds at most the start of
        a closing tag). `cut_short`: a tag's start held at the very end is markup too."""
        deltas: list[dict] = []
        if self.in_call and self.header_sent:
            self._call_progress(deltas, final=True, closed=False)
        elif not self.in_call:
            self._content(deltas, self.buffer[:len(self.buffer) - (_tag_start(self.buffer) if cut_short else 0)])
        self.buffer = ""
        return deltas

    def _content(self, deltas: list[dict], text: str) -> None:
        if text:
            deltas.append({"content": text})

    def _call_progress(self, deltas: list[dict], final: bool, closed: bool = True) -> None:
        m = _NAME.match(self.call_text)
        if m is None:
            if final:  # not a valid call: left out, as parse_tool_calls does
                logger.warning("left out a %s block that is not a valid call", TOOL_CALL_OPEN)
            return
        index = self.num_calls - (1 if self.header_sent else 0)
        if not self.header_sent:
            self.header_sent = True
            self.num_calls += 1
            deltas.append({"tool_calls": [{"index": index, "id": new_call_id(), "type": "function",
                                           "function": {"name": json.loads(f'"{m.group(1)}"'), "arguments": ""}}]})
        args = self.call_text[m.end():]
        if final and closed:
            args = args.rstrip()
            args = args[:-1].rstrip() if args.endswith("}") else args  # the call object's own brace
        elif final:
            pass  # unclosed: there is no brace of the call object to take off
        else:  # trailing braces and blanks may be the end of the call object: wait and see
            args = args.rstrip("} \n\t\r")
        if len(args) > self.args_sent:
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": args[self.args_sent:]}}]})
            self.args_sent = len(args)
