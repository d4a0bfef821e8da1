"""Tool calling: which grammar a request's `tools` and `tool_choice` call for, in the format
chosen with --tool-call-parser (app/tool_parsers/: its prompt, grammar and parser).

- `required` / a named function: the grammar forces one call (or several with
  `parallel_tool_calls`) whose arguments match the function's `parameters` schema.
- `auto` (needs `--enable-auto-tool-choice`, as in vLLM): free text, but a call the model starts
  in the format's markup is held to a valid call.
- `none`: the tools are shown to the model, nothing is constrained or parsed."""

from __future__ import annotations

from dataclasses import dataclass

from pageserve.app.errors import bad_request
from pageserve.app.tool_parsers import TOOL_PARSERS, ToolFormat, function_of, tool_format
from pageserve.sampling.params import StructuredOutputsParams

__all__ = ["TOOL_PARSERS", "ToolFormat", "ToolPlan", "plan_tools", "tool_format"]


@dataclass(slots=True)
class ToolPlan:
    grammar: StructuredOutputsParams | None  # None: free text (tool_choice none)
    parse: bool  # turn the output's calls into tool_calls (with format.parse / format.stream_parser())
    format: ToolFormat
    # a chat reply's finish_reason when its calls end it: "stop" for a named function, as
    # OpenAI's API and vLLM say there
    finish: str = "tool_calls"


def plan_tools(tools: list | None, tool_choice, parallel_tool_calls: bool, enable_auto: bool,
               fmt: ToolFormat) -> ToolPlan | None:
    """The plan for a request's tools, or None without tools. `tools`: chat tools
    ({"type": "function", "function": {...}}) or Responses API function tools (the same fields at
    the top). `tool_choice`: None (auto), "none", "auto", "required", or a named choice (an
    object with `.function.name`, or `.name`). `enable_auto`: --enable-auto-tool-choice.
    A 400 naming the field for what cannot be served."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    choice = tool_choice or "auto"
    functions = [(f.name, f.parameters) for f in map(function_of, tools)]
    if choice == "none":
        return ToolPlan(None, False, fmt)
    try:
        if choice == "auto":
            if not enable_auto:
                raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and '
                                  '--tool-call-parser to be set', "tool_choice")
            regex = fmt.lazy_regex(functions, parallel_tool_calls)
        elif choice == "required":
            regex = fmt.forced_regex(functions, parallel_tool_calls)
        else:
            name = function_of(choice).name
            named = [f for f in functions if f[0] == name]
            if not named:
                raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools",
                                  "tool_choice")
            regex = fmt.forced_regex(named, False)
    except ValueError as e:  # a parameters schema this format cannot enforce
        raise bad_request(str(e), "tools") from None
    return ToolPlan(StructuredOutputsParams(regex=regex, source="tools"), True, fmt,
                    "tool_calls" if choice in ("auto", "required") else "stop")
