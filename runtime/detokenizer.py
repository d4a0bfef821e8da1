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


def backend_tokenizer(tokenizer) -> Tokenizer:
    """The Rust `tokenizers.Tokenizer` behind a transformers fast tokenizer."""
    return tokenizer if isinstance(tokenizer, Tokenizer) else tokenizer.backend_tokenizer


class IncrementalDetokenizer:
    __slots__ = ("tokenizer", "stream", "text", "sent", "stop", "include_stop", "max_stop_len")

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str],
                 include_stop: bool, skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.stream = DecodeStream(ids=prompt_token_ids[-_CONTEXT_TOKENS:],
                                   skip_special_tokens=skip_special_tokens)
        self.text = ""  # the output text so far (cut at a stop string once one is seen)
        self.sent = 0  # characters of `text` already handed out
        self.stop = stop
        self.include_stop = include_stop
        self.max_stop_len = max((len(s) for s in stop), default=0)

    def add_token(self, token_id: int) -> str | None:
        """Decode one more token. Returns the stop string it completed, if any; the text is
        then cut there (after the stop string when it is to be included)."""
        chunk = self.stream.step(self.tokenizer, token_id)
        if not chunk:
            return None
        # a stop string completed by this chunk starts at most max_stop_len - 1 chars before it
        search_from = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += chunk
        if not self.stop:
            return None
        found, where = None, len(self.text)
        for s in self.stop:
            i = self.text.find(s, search_from)
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
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0
