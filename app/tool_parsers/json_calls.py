"""The calls region of the JSON formats (hermes, llama3_json, mistral): call objects
{"name": ..., "arguments" or "parameters": {...}}, read character by character so that the name
is announced as soon as it is complete and the arguments stream exactly as written."""

from __future__ import annotations

import json
import re

from pageserve.app.tool_parsers.stream import StreamParser, held_prefix

# the start of a call object whose name comes first: the name can be announced at once
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:')


class JsonCalls:
    """`opener`, then call objects separated by `separator`, then `closer` (each may be "":
    without a closer the region ends at the first text that is not a separator or a call).
    Text that is not a call is skipped to the closer (or to the end of the output)."""

    def __init__(self, opener: str = "", separator: str = "", closer: str = ""):
        self.opener, self.separator, self.closer = opener, separator, closer
        self.state = "open" if opener else "object"
        self.pending = ""  # the start of the closer, held back

    def feed(self, text: str, parser: StreamParser) -> str | None:
        """Reads `text`; returns what follows the region's end, or None while it goes on."""
        text, self.pending = self.pending + text, ""
        i = 0
        while i < len(text):
            c = text[i]
            if self.state == "in":
                i += 1
                if self.object.feed(c, parser):
                    self.state = "after"
            elif c.isspace() and self.state != "skip":
                i += 1
            elif self.state == "open":
                self.state = "object" if c == self.opener else "skip"
                i += c == self.opener
            elif self.state == "object":
                self.state = "in" if c == "{" else "skip"
                self.object = _CallObject()
            elif self.state == "after":
                if self.separator and c == self.separator:
                    self.state, i = "object", i + 1
                elif not self.closer:
                    return text[i:]  # the region ends: what follows is text again
                elif text.startswith(self.closer, i):
                    return text[i + len(self.closer):]
                elif self.closer.startswith(text[i:]):
                    self.pending = text[i:]
                    return None
                else:
                    self.state = "skip"
            else:  # skipping what is not a call: to the closer, or to the end of the output
                if not self.closer:
                    return None
                at = text.find(self.closer, i)
                if at >= 0:
                    return text[at + len(self.closer):]
                self.pending = text[len(text) - held_prefix(text[i:], self.closer):]
                return None
        return None


class _CallObject:
    """One JSON object, character by character: depth, strings, and where the arguments are."""

    def __init__(self):
        self.chars: list[str] = []  # the object's text so far (joined only to read it)
        self.depth = 0
        self.in_string = self.escape = False
        self.colons = 0  # colons between keys and values of the object itself
        self.named = False  # the name came first and is announced; the arguments stream as written
        self.args_state = "before"  # before / streaming / done / scalar
        self.streamed = False

    def feed(self, c: str, parser: StreamParser) -> bool:
        """Takes one character; True once the object is complete."""
        self.chars.append(c)
        before = self.depth
        if self.in_string:
            self.escape, self.in_string = (False, True) if self.escape else (c == "\\", c != '"')
        elif c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
        if not self.named:
            if c == ":" and self.depth == 1 and not self.in_string:
                self.colons += 1
                # a name-first head ends at the second such colon: the only place it can match
                m = _HEAD.match("".join(self.chars)) if self.colons == 2 else None
                if m:
                    parser.open_call(json.loads(f'"{m.group(1)}"'))
                    self.named = True
        elif self.args_state == "before" and not c.isspace():
            self.args_state = "streaming" if c in "{[" else "scalar"
        if self.args_state == "streaming" and max(before, self.depth) >= 2:
            parser.add_arguments(c)
            self.streamed = True
            if self.depth == 1:
                self.args_state = "done"
        if self.depth == 0:
            self._close(parser)
            return True
        return False

    def _close(self, parser: StreamParser) -> None:
        try:
            obj = json.loads("".join(self.chars))
        except (json.JSONDecodeError, RecursionError):
            obj = None
        key = next((k for k in ("arguments", "parameters") if isinstance(obj, dict) and k in obj), None)
        valid = key is not None and isinstance(obj.get("name"), str)
        if not self.named and valid:  # the name was not first: announced now, whole
            parser.open_call(obj["name"])
        if not self.named and not valid:
            return  # never announced: nothing to take back
        if valid and not self.streamed:
            parser.add_arguments(json.dumps(obj[key], ensure_ascii=False))
        parser.close_call(valid and obj[key] is not None)
