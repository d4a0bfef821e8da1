"""A model's output as chat deltas, piece by piece, for any tool-call format: free text as
`content`, each call as a first delta with `index`, `id`, `type` and `function.name`, then
`function.arguments` fragments. The whole-output parse runs the same parser, so the two agree."""

from __future__ import annotations

import json
import logging

logger = logging.getLogger(__name__)


def held_prefix(text: str, word: str) -> int:
    """Length of the longest end of `text` that could be the start of `word`."""
    for n in range(min(len(word) - 1, len(text)), 0, -1):
        if word.startswith(text[-n:]):
            return n
    return 0


class StreamParser:
    """feed(text) -> deltas as the output grows; finish(cut_short) -> the last deltas;
    num_calls: calls announced so far. No piece of the format's markup ever reaches `content`.
    `cut_short`: the output ended at max_tokens, so the start of a tag held back at its very end
    is markup too (a lone character is text)."""

    def __init__(self, fmt):
        self.fmt = fmt
        self.buffer = ""  # text not yet handed out
        self.region = None  # the scanner of the calls being read, if any
        self.at_start = True  # nothing handed out yet (formats whose calls open the output)
        self.trim = False  # newlines right after a calls region are not content
        self.calls: list[dict] = []  # id, name, and arguments: the final JSON text once valid
        self.content = ""  # all content handed out
        self.out: list[dict] = []  # deltas not yet taken

    @property
    def num_calls(self) -> int:
        return len(self.calls)

    def feed(self, text: str) -> list[dict]:
        self.buffer += text
        while self._region_step() if self.region is not None else self._content_step():
            pass
        return self._take()

    def finish(self, cut_short: bool = False) -> list[dict]:
        if self.region is None and self.buffer:
            markup = max(held_prefix(self.buffer, m) for m in self._words()) if cut_short else 0
            self._content(self.buffer[:len(self.buffer) - (markup if markup >= 2 else 0)])
        self.buffer = ""
        return self._take()

    def result(self) -> tuple[str | None, list[dict]]:
        """After finish: the content and the calls that were complete and valid."""
        calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                 for c in self.calls if c["arguments"] is not None]
        return self.content.strip() or None, calls

    # ---- what regions report ----

    def open_call(self, name: str) -> None:
        call = {"id": self.fmt.new_call_id(), "name": name, "arguments": None}
        self.calls.append(call)
        self.out.append({"tool_calls": [{"index": len(self.calls) - 1, "id": call["id"], "type": "function",
                                         "function": {"name": name, "arguments": ""}}]})

    def add_arguments(self, text: str) -> None:
        if not text:
            return
        index = len(self.calls) - 1
        last = self.out[-1]["tool_calls"][0] if self.out and "tool_calls" in self.out[-1] else None
        if last is not None and last["index"] == index:
            last["function"]["arguments"] += text
        else:
            self.out.append({"tool_calls": [{"index": index, "function": {"arguments": text}}]})

    def close_call(self, arguments) -> None:
        """The call just read is complete: `arguments` is its parsed value, or None when it is
        not a valid call (left out of the whole parse)."""
        if arguments is None:
            logger.warning("left out a %s tool call that is not valid", self.fmt.name)
        else:
            self.calls[-1]["arguments"] = json.dumps(arguments, ensure_ascii=False)

    # ---- internals ----

    def _words(self) -> tuple[str, ...]:
        return tuple(self.fmt.starts) + self.fmt.markup

    def _content(self, text: str) -> None:
        for word in self.fmt.markup:  # a stray closing tag is markup, not text
            text = text.replace(word, "")
        if self.trim:
            text = text.lstrip("\n")
            self.trim = not text
        if text:
            self.at_start = False
            self.content += text
            if self.out and "content" in self.out[-1]:
                self.out[-1]["content"] += text
            else:
                self.out.append({"content": text})

    def _enter(self, at: int, start: str) -> bool:
        self._content(self.buffer[:at])
        self.at_start = False
        self.buffer = self.fmt.starts[start] + self.buffer[at + len(start):]
        self.region = self.fmt.region()
        return True

    def _content_step(self) -> bool:
        """Hands out content up to a calls region; True when one was entered."""
        buf = self.buffer
        if self.fmt.at_start_only:
            if not self.at_start or not buf:
                self._content(buf)
                self.buffer = ""
                return False
            for start in self.fmt.starts:
                if buf.startswith(start):
                    return self._enter(0, start)
            if not any(s.startswith(buf) for s in self.fmt.starts):
                self._content(buf)
                self.buffer = ""
            return False
        found = [(buf.find(s), s) for s in self.fmt.starts if s in buf]
        if found:
            return self._enter(*min(found))
        keep = max(held_prefix(buf, w) for w in self._words())
        self._content(buf[:len(buf) - keep])
        self.buffer = buf[len(buf) - keep:]
        return False

    def _region_step(self) -> bool:
        rest = self.region.feed(self.buffer, self)
        self.buffer = ""
        if rest is None:
            return False
        self.region, self.buffer, self.trim = None, rest, True
        return True

    def _take(self) -> list[dict]:
        out, self.out = self.out, []
        return out
