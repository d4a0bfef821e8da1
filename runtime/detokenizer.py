"""Incremental detokenization with stop strings.

Tokens become text one at a time through the tokenizers library's `DecodeStream`, which
holds back the bytes of a character split across tokens, so no half UTF-8 character is ever
emitted. Text that could still turn out to be the start of a stop string is held back until
the next tokens decide it. A request that reports only its final text and has no stop strings
is decoded in one call when its text is asked for (`deferred`), not a call a token: the same
text."""

from __future__ import annotations

import functools

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# prompt tokens given to the decoder as context: enough for it to know whether the first
# output token starts a word (SentencePiece drops a leading space at the start of a text)
_CONTEXT_TOKENS = 4


@functools.lru_cache(maxsize=16)
def _stop_prefixes(stop: tuple[str, ...]) -> frozenset[str]:
    """Shared by the requests (and n > 1 sequences) with the same stop strings: 64 strings of
    256 characters make 16K prefixes, 3 MB a set."""
    return frozenset(s[:k] for s in stop for k in range(1, len(s)))


class IncrementalDetokenizer:
    __slots__ = ("tokenizer", "stream", "skip_special", "ids", "text", "sent", "stop", "include_stop",
                 "max_stop_len", "stop_prefixes", "context", "pending")

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str],
                 include_stop: bool, skip_special_tokens: bool, deferred: bool = False):
        """deferred: tokens are only collected until the text is asked for (take_delta); for
        requests with no stop strings (nothing to look for in the text as it grows)."""
        if deferred and stop:
            raise ValueError("a detokenizer with stop strings cannot defer its decoding")
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.context = self._whole_chars(prompt_token_ids[-_CONTEXT_TOKENS:])  # the stream's first
        self.stream = DecodeStream(ids=self.context, skip_special_tokens=skip_special_tokens)
        self.pending: list[int] | None = [] if deferred else None  # deferred: tokens not decoded yet
        self.ids: list[int] = []  # the output tokens decoded so far
        self.text = ""  # the output text so far (cut at a stop string once one is seen)
        self.sent = 0  # characters of `text` already handed out
        self.stop = stop
        self.include_stop = include_stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        # every proper prefix of a stop string: text ending in one is held back
        self.stop_prefixes = _stop_prefixes(tuple(stop))

    def _whole_chars(self, context: list[int]) -> list[int]:
        # context that ends inside a character would leak into the first output text
        while context and self.tokenizer.decode(context, skip_special_tokens=False).endswith("\ufffd"):
            context = context[:-1]
        return context

    def _new_stream(self, context: list[int]) -> DecodeStream:
        return DecodeStream(ids=self._whole_chars(context), skip_special_tokens=self.skip_special)

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
        if self.pending is not None:
            self.pending.append(token_id)
            return None
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

    def _catch_up(self) -> None:
        """Decode the deferred tokens: at once where that gives the stream's text, else token by
        token through the stream."""
        pending, self.pending = self.pending, None
        if pending:
            text = self.decode_at_once(pending)
            if text is None:
                for token_id in pending:
                    self.add_token(token_id)
            else:
                self.text += text
                self.ids += pending
                self.stream = self._new_stream(self.ids[-_CONTEXT_TOKENS:])
        self.pending = []

    def decode_at_once(self, new_ids: list[int]) -> str | None:
        """The text of new_ids after those decoded so far, in one decode, or None where it might
        differ from the stream's: the whole decode does not extend the text so far, or its new
        part holds a replacement character (where the stream holds back or drops bytes). With
        neither, every window the stream decodes starts and ends on whole characters (the
        context ends on one), so its pieces join to the whole decode."""
        decode, skip = self.tokenizer.decode, self.skip_special
        before = decode(self.context, skip_special_tokens=skip) + self.text
        whole = decode(self.context + self.ids + new_ids, skip_special_tokens=skip)
        if not whole.startswith(before) or "\ufffd" in whole[len(before):]:
            return None
        return whole[len(before):]

    def take_delta(self, finished: bool) -> str:
        """The text not handed out yet, less a tail that may still grow into a stop string."""
        if self.pending is not None:
            self._catch_up()
        end = len(self.text) if finished or not self.stop else len(self.text) - self._held_back()
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
