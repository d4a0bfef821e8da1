"""A model's output as chat deltas, piece by piece, for any tool-call format: free text as
`content`, each call as a first delta with `index`, `id`, `type` and `function.name`, then
`function.arguments` fragments. The whole-output parse runs the same parser, so the two agree:
a call's whole `arguments` is the concatenation of its streamed fragments."""

from __future__ import annotations

import logging

from pageserve.grammar.regexes import SPACE

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
    is markup too (a lone character is text). Growing text is kept as lists of pieces, joined
    once, so that feeding a token at a time stays linear in the output's length."""

    def __init__(self, fmt):
        self.fmt = fmt
        self.buffer = ""  # text not yet handed out (at most the start of a word, between feeds)
        self.space: list[str] = []  # whitespace opening the output, held until what follows shows
        self.region = None  # the scanner of the calls being read, if any
        self.at_start = True  # nothing handed out yet (formats whose calls open the output)
        self.trim = False  # newlines right after a calls region are not content
        self.calls: list[dict] = []  # id, name, and arguments: the final JSON text once valid
        self.invalid: list[str] = []  # ids of calls read to their end that are not valid
        self.finished = False
        self.arguments: list[str] = []  # the open call's argument fragments so far
        self.content: list[str] = []  # all content handed out
        self.pending_space: list[str] = []  # whitespace after it, handed out only before more text
        self.out: list[dict] = []  # deltas not yet taken, their text still as lists of pieces

    @property
    def num_calls(self) -> int:
        return len(self.calls)

    def feed(self, text: str) -> list[dict]:
        self.buffer += text
        while self._region_step() if self.region is not None else self._content_step():
            pass
        return self._take()

    def finish(self, cut_short: bool = False) -> list[dict]:
        if self.region is None and (self.buffer or self.space):
            markup = max(held_prefix(self.buffer, m) for m in self._words()) if cut_short else 0
            self._content("".join(self.space) + self.buffer[:len(self.buffer) - (markup if markup >= 2 else 0)])
        self.buffer, self.space = "", []
        self.finished = True
        return self._take()

    @property
    def failed_calls(self) -> list[str]:
        """Ids of the announced calls that are not valid: read to their end and rejected, or,
        once the output has finished, never ended."""
        if not self.finished:
            return self.invalid
        return [c["id"] for c in self.calls if c["arguments"] is None]

    def result(self) -> tuple[str | None, list[dict]]:
        """After finish: the content and the calls that were complete and valid."""
        calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                 for c in self.calls if c["arguments"] is not None]
        return "".join(self.content) or None, calls  # as streamed: no whitespace at its end

    # ---- what regions report ----

    def open_call(self, name: str) -> None:
        call = {"id": self.fmt.new_call_id(), "name": name, "arguments": None}
        self.calls.append(call)
        self.arguments = []
        self.out.append({"tool_calls": [{"index": len(self.calls) - 1, "id": call["id"], "type": "function",
                                         "function": {"name": name, "arguments": []}}]})

    def add_arguments(self, text: str) -> None:
        if not text:
            return
        self.arguments.append(text)
        index = len(self.calls) - 1
        last = self.out[-1]["tool_calls"][0] if self.out and "tool_calls" in self.out[-1] else None
        if last is not None and last["index"] == index:
            last["function"]["arguments"].append(text)
        else:
            self.out.append({"tool_calls": [{"index": index, "function": {"arguments": [text]}}]})

    def close_call(self, valid: bool) -> None:
        """The call just read is complete; one that is not valid is left out of the whole parse.
        A valid one's arguments are the text streamed for it, exactly as the model wrote it."""
        if valid:
            self.calls[-1]["arguments"] = "".join(self.arguments)
        else:
            self.invalid.append(self.calls[-1]["id"])
            logger.warning("left out a %s tool call that is not valid", self.fmt.name)
        self.arguments = []

    # ---- internals ----

    def _words(self) -> tuple[str, ...]:
        return tuple(self.fmt.starts) + self.fmt.markup

    def _content(self, text: str) -> None:
        for word in self.fmt.markup:  # a stray closing tag is markup, not text
            text = text.replace(word, "")
        if self.trim:
            text = text.lstrip("\n")
            self.trim = not text
        if not text:
            return
        self.at_start = False
        body = text.rstrip()  # whitespace after text waits for more text: none at the end, as whole
        if not body:
            self.pending_space.append(text)
            return
        text, self.pending_space = "".join(self.pending_space) + body, [text[len(body):]]
        self.content.append(text)
        if self.out and "content" in self.out[-1]:
            self.out[-1]["content"].append(text)
        else:
            self.out.append({"content": [text]})

    def _enter(self, at: int, start: str) -> bool:
        self._content(self.buffer[:at])
        self.at_start = False
        self.buffer = self.fmt.starts[start] + self.buffer[at + len(start):]
        self.region = self.fmt.region()
        return True

    def _content_step(self) -> bool:
        """Hands out content up to a calls region; True when one was entered."""
        if self.fmt.at_start_only:
            return self._opening_step()
        buf = self.buffer
        found = [(buf.find(s), s) for s in self.fmt.starts if s in buf]
        if found:
            return self._enter(*min(found))
        keep = max(held_prefix(buf, w) for w in self._words())
        self._content(buf[:len(buf) - keep])
        self.buffer = buf[len(buf) - keep:]
        return False

    def _opening_step(self) -> bool:
        """For formats whose calls open the output, after any whitespace (a model often writes a
        newline or two first, as after a think block): that whitespace is dropped before calls."""
        buf = self.buffer
        if not self.at_start:
            self._content(buf)
            self.buffer = ""
            return False
        body = buf.lstrip(SPACE)
        if len(body) < len(buf):
            self.space.append(buf[:len(buf) - len(body)])
            self.buffer = buf = body
        if not buf:
            return False
        for start in self.fmt.starts:
            if buf.startswith(start):
                self.space = []
                return self._enter(0, start)
        if not any(s.startswith(buf) for s in self.fmt.starts):
            self._content("".join(self.space) + buf)
            self.buffer, self.space = "", []
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
        for delta in out:
            if "content" in delta:
                delta["content"] = "".join(delta["content"])
            else:
                function = delta["tool_calls"][0]["function"]
                function["arguments"] = "".join(function["arguments"])
        return out
