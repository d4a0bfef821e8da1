"""Tool-call formats, one file each, chosen with --tool-call-parser (as vLLM's parsers of the
same names). base.py says what a format offers."""

from __future__ import annotations

from pageserve.app.tool_parsers.base import ToolFormat, function_of, tool_dict
from pageserve.app.tool_parsers.hermes import Hermes
from pageserve.app.tool_parsers.llama3_json import Llama3Json
from pageserve.app.tool_parsers.mistral import Mistral
from pageserve.app.tool_parsers.pythonic import Pythonic

FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Hermes(), Llama3Json(), Mistral(), Pythonic())}
TOOL_PARSERS = tuple(FORMATS)
DEFAULT_TOOL_PARSER = "hermes"  # when tools are used without --tool-call-parser


def tool_format(name: str | None) -> ToolFormat:
    return FORMATS[name or DEFAULT_TOOL_PARSER]


__all__ = ["DEFAULT_TOOL_PARSER", "FORMATS", "TOOL_PARSERS", "ToolFormat", "function_of", "tool_dict", "tool_format"]
