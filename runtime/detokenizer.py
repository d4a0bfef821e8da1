"""Incremental detokenization with stop strings.

Tokens become text one at a time through the tokenizers library's `DecodeStream`, which
holds back the bytes of a character split across tokens, so no half UTF-8 character is ever
emitted. Text that could still turn out to be the start of a stop string is held back until
the next tokens decide it."""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# prompt tokens given to the decoder as context: enough for it to know whether the first
# output token starts a word (SentencePiece drops a leading space at the start of a text)
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    __slots__ = ("tokenizer", "stream", "skip_special", "ids", "text", "sent", "stop", "include_stop",
                 "max_stop_len", "stop_prefixes")

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str],
                 include_stop: bool, skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.stream = self._new_stream(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.ids: list[int] = []  # the output tokens decoded so far
        self.text = ""  # the output text so far (cut at a stop string once one is seen)
        self.sent = 0  # characters of `text` already handed out
        self.stop = stop
        self.include_stop = include_stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        # every proper prefix of a stop string: text ending in one is held back
        self.stop_prefixes = {s[:k] for s in stop for k in range(1, len(s))}

    def _new_stream(self, context: list[int]) -> DecodeStream:
        # context that ends inside a character would leak into the first output text
        while context and self.tokenizer.decode(context, skip_special_tokens=False).endswith("\ufffd"):
            context = context[:-1]
        return DecodeStream(ids=context, skip_special_tokens=self.skip_special)

    def _step(self, token_id: int) -> str | None:
        self.ids.append(token_id)
        try:
            return self.stream.step(self.tokenizer, token_id)
        except Exception:  # noqa: BLE001 - the stream lost its footing (e.g. stray byte tokens)
            pass
        # start over after the last whole character (a stray partial one is dropped), then retry
        self.stream = self._new_stream(self.ids[:-1][-_CONTEXT_TOKENS:])
        try:
            return self.stream.step(self.tokenizer, token_id)
        except Exception:  # noqa: BLE001 - this token's bytes are lost, never the engine
            self.stream = self._new_stream(self.ids[-_CONTEXT_TOKENS:])
            return None

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Decode one more token. Returns the stop string it completed, if any; the text is
        then cut there (after the stop string when it is to be included). With `check_stop`
        off (before min_tokens), stop strings are not looked for."""
        chunk = self._step(token_id)
        if not chunk:
            return None
        before = len(self.text)
        self.text += chunk
        if not self.stop or not check_stop:
            return None
        found, where = None, len(self.text)
        for s in self.stop:
            # a match must end inside the new chunk: older ones were seen (or not looked for)
            i = self.text.find(s, max(0, before - len(s) + 1))
            if i != -1 and i < where:
                found, where = s, i
        if found is not None:
            self.text = self.text[:where + len(found) if self.include_stop else where]
        return found

    def take_delta(self, finished: bool) -> str:
        """The text not handed out yet, less a tail that may still grow into a stop string."""
        end = len(self.text) if finished else len(self.text) - self._held_back()
        if end <= self.sent:
            return ""
        delta = self.text[self.sent:end]
        self.sent = end
        return delta

    def _held_back(self) -> int:
        text = self.text
        for k in range(min(self.max_stop_len - 1, len(text) - self.sent), 0, -1):
            if text[-k:] in self.stop_prefixes:
                return k
        return 0
