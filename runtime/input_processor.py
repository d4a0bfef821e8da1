"""Every check of a request's content, done once where it enters the engine: the prompt
(tokenized, in the vocabulary, not too long), the sampling parameters that depend on the
model (token ids, n, max_tokens against the context) and the grammar (converted to its regex
here, so that a schema we cannot enforce fails before anything is queued). Errors name the
request field at fault (`param`), for the server's 400."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pageserve.runtime.lora.request import LoRARequest
from pageserve.sampling.params import SamplingParams


# a text is tokenized whole only once a part of it this many characters per token of the context
# (doubling from there) is found to fit; English runs about 4 characters a token
PROBE_CHARS_PER_TOKEN = 8
# the tokens a part may have beyond the whole text, where it was cut (one at most was seen)
BOUNDARY_TOKENS = 16
# how far before the tokens it must hold a tail of a text may have to begin (truncate_prompt_tokens)
MAX_TAIL_CHARS = 1 << 20


class InvalidRequest(ValueError):
    """A request the engine cannot take. `param`: the request field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class ProcessedRequest:
    """A request checked and ready for the engine."""
    prompt_token_ids: list[int]
    params: SamplingParams | None  # None: an embedding request (prefill only, nothing sampled)
    max_tokens: int  # resolved against the context length
    prompt: str | None = None  # the text, when it was given as text
    cache_salt: str | None = None
    grammar: str | None = None  # the regex the output must match
    mm_items: tuple = ()  # multimodal.ImageItem of each image, in prompt order
    lora: LoRARequest | None = None  # the adapter it runs under
    priority: int = 0  # --scheduling-policy priority: the lowest value runs first
    owner: str = ""  # who sent it (the API key's tag): whose turn its grammar compiles in

    @property
    def num_sequences(self) -> int:
        return 1 if self.params is None else self.params.n


class InputProcessor:
    def __init__(self, tokenize, vocab_size: int, max_model_len: int, max_num_seqs: int, grammar_regex,
                 priority_scheduling: bool = False, embeddings_refused: str | None = None, max_token_chars: int = 0):
        self.tokenize = tokenize  # (text, add_special_tokens=True) -> token ids
        # the most characters one token's text has (its vocabulary entry's; 0: not known)
        self.max_token_chars = max_token_chars
        self.embeddings_refused = embeddings_refused  # why the model's embeddings cannot be made here
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.grammar_regex = grammar_regex  # StructuredOutputsParams -> regex, ValueError if unenforceable
        self.priority_scheduling = priority_scheduling

    def process(self, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None,
                param: str = "prompt", strict_max_tokens: bool = False, mm_items: tuple = (),
                prompt_text: str | None = None, priority: int = 0) -> ProcessedRequest:
        """`strict_max_tokens`: a max_tokens that does not fit beside the prompt is an error (the
        server, as vLLM's), not cut to what fits (the offline API). `mm_items`: the images of a
        prompt the multimodal processor made (their tokens are in `prompt`)."""
        ids = self._prompt_ids(prompt, param, self.max_model_len - 1)
        room = self.max_model_len - len(ids)
        if room < 1:  # at least one output token must fit
            raise self.too_long(len(ids), param)
        if params.max_tokens is not None and params.max_tokens > room and strict_max_tokens:
            raise InvalidRequest(
                f"'max_tokens' is too large: {params.max_tokens}. This model's maximum context length is "
                f"{self.max_model_len} tokens and your request has {len(ids)} input tokens "
                f"({params.max_tokens} > {self.max_model_len} - {len(ids)}).", "max_tokens")
        if params.n > self.max_num_seqs:
            raise InvalidRequest(f"n ({params.n}) is larger than the server's --max-num-seqs "
                                 f"({self.max_num_seqs})", "n")
        for name, token_ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids),
                                ("allowed_token_ids", params.allowed_token_ids or ())):
            self.check_token_ids(token_ids, name)
        params = params.with_bad_words(lambda word: self.tokenize(word, False))
        _check_salt(cache_salt)
        self._check_priority(priority)
        grammar = None
        if params.structured_outputs is not None:
            spec = params.structured_outputs
            try:
                grammar = self.grammar_regex(spec)
            except ValueError as e:
                raise InvalidRequest(str(e), spec.source or "structured_outputs") from None
            if spec.reasoning_end is not None:
                self.check_token_ids(spec.reasoning_end, "structured_outputs.reasoning_end")
            if spec.reasoning_start is not None:
                self.check_token_ids((spec.reasoning_start,), "structured_outputs.reasoning_start")
        if params.thinking_budget is not None:
            budget = params.thinking_budget
            self.check_token_ids((*budget.end, *(() if budget.start is None else (budget.start,))), "thinking_budget")
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        return ProcessedRequest(ids, params, max_tokens, prompt if isinstance(prompt, str) else prompt_text,
                                cache_salt, grammar, tuple(mm_items), priority=priority)

    def process_embedding(self, prompt: str | list[int], param: str = "input") -> ProcessedRequest:
        if self.embeddings_refused:
            raise InvalidRequest(f"this model's embeddings need {self.embeddings_refused}, which pageserve does not "
                                 "apply")
        ids = self._prompt_ids(prompt, param, self.max_model_len)
        if len(ids) > self.max_model_len:
            raise self.too_long(len(ids), param)
        return ProcessedRequest(ids, None, 0, prompt if isinstance(prompt, str) else None)

    def _check_priority(self, priority) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequest(f"priority must be an integer, got {priority!r}", "priority")
        if priority and not self.priority_scheduling:
            raise InvalidRequest(f"priority {priority} was given, but the server schedules first come, first "
                                 "served (start it with --scheduling-policy priority)", "priority")

    def check_token_ids(self, token_ids, param: str) -> None:
        for t in token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise InvalidRequest(f"{param}: token id {t!r} is outside the vocabulary (valid ids are 0 "
                                     f"to {self.vocab_size - 1})", param)

    def too_long(self, num_tokens: int, param: str, at_least: bool = False) -> InvalidRequest:
        return InvalidRequest(
            f"This model's maximum context length is {self.max_model_len} tokens. However, your request "
            f"has {'at least ' if at_least else ''}{num_tokens} input tokens. Please reduce the length of the "
            "input.", param)

    def check_text_length(self, text: str, count: Callable[[str], int], param: str) -> None:
        """Refuse a text far longer than the context from a part of it (`count`: a text's number
        of tokens): tokenizing a whole 30 MB prompt took 48 s and 7 GB before its length could be
        checked. The part tried doubles until it holds more tokens than the context, or is the
        whole text (which the caller then tokenizes), so a text that fits costs at most twice.
        A text longer than the longest token times the context (four times over: a normalizer
        may fold a few characters into one) is refused without any part."""
        if self.max_token_chars and len(text) > 4 * self.max_token_chars * (self.max_model_len + 1):
            raise self.too_long(len(text) // (4 * self.max_token_chars), param, at_least=True)
        size = PROBE_CHARS_PER_TOKEN * (self.max_model_len + 1)
        while size < len(text):
            num_tokens = count(text[:_word_start(text, size)]) - BOUNDARY_TOKENS
            if num_tokens > self.max_model_len:
                raise self.too_long(num_tokens, param, at_least=True)
            size *= 2

    def last_tokens(self, text: str, keep: int, encode: Callable[[str], list[int]], param: str = "prompt") -> list[int]:
        """The text's last `keep` tokens (vLLM's truncate_prompt_tokens), the special tokens `encode`
        puts around every text (BOS; BERT's [CLS] and [SEP]) kept among them, as a tokenizer that
        truncates on the left keeps them. Read from a tail of the text, cut where whitespace
        begins a word (no pre-tokenizer merges across it), that doubles until it holds them: a
        text far longer than the context is not tokenized whole. A text with no whitespace in
        MAX_TAIL_CHARS before those tokens (one long run, which BPE may merge differently from
        its start) is refused."""
        head, tail = _specials(encode)
        room = max(keep - len(head) - len(tail), 0)
        size = PROBE_CHARS_PER_TOKEN * (room + BOUNDARY_TOKENS + 1)
        while True:
            start = _space_before(text, len(text) - size) if size < len(text) else 0
            if len(text) - start > max(MAX_TAIL_CHARS, 2 * size):
                raise InvalidRequest(f"truncate_prompt_tokens: the text has no whitespace to cut it at in its last "
                                     f"{MAX_TAIL_CHARS} characters; send its end only", param)
            ids = encode(text[start:])
            body = ids[len(head):] if ids[:len(head)] == head else ids
            if tail and body[len(body) - len(tail):] == tail:
                body = body[:len(body) - len(tail)]
            if start:
                body = body[BOUNDARY_TOKENS:]  # (a tokenizer that marks the start of a text, as SentencePiece)
            if not start or len(body) >= room:
                break
            size *= 2
        return (head + body[max(len(body) - room, 0):] if room else head) + tail

    def _prompt_ids(self, prompt, param: str, limit: int) -> list[int]:
        """The prompt's token ids, checked: its length against `limit` first, then each id (a
        million ids take a tenth of a second to check)."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("the prompt is empty", param)
            self.check_text_length(prompt, lambda part: len(self.tokenize(part)), param)
            ids = self.tokenize(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
        else:
            raise InvalidRequest(f"a prompt is a string or a list of token ids, not {type(prompt).__name__}",
                                 param)
        if not ids:
            raise InvalidRequest("the prompt is empty (0 tokens)", param)
        if len(ids) > limit:
            raise self.too_long(len(ids), param)
        self.check_token_ids(ids, param)
        return ids


def _space_before(text: str, end: int) -> int:
    """Where a tail holding at least text[end:] begins: at the start of the last run of
    whitespace that begins before `end` (inside a run, BPE would merge what is left of it
    otherwise), or 0 (the whole text) where there is none."""
    cut = max(text.rfind(c, 0, end + 1) for c in " \n\t\r")
    while cut > 0 and text[cut - 1].isspace():
        cut -= 1
    return max(cut, 0)


def _specials(encode: Callable[[str], list[int]]) -> tuple[list[int], list[int]]:
    """The special tokens `encode` puts before and after every text."""
    empty, probe = encode(""), encode("a")
    n = 0
    while n < min(len(empty), len(probe)) and empty[n] == probe[n]:
        n += 1
    after = empty[n:]
    return empty[:n], after if probe[len(probe) - len(after):] == after else []


def _word_start(text: str, end: int) -> int:
    """Where the text's part ends: before the last space of its last 256 characters (so that
    the part's tokens are the whole text's, up to a word split in two), or at `end`."""
    space = text.rfind(" ", max(end - 256, 1), end)
    return space if space > 0 else end


def _check_salt(cache_salt) -> None:
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise InvalidRequest(f"cache_salt must be a non-empty string, got {cache_salt!r}", "cache_salt")
