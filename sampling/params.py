"""Per-request sampling parameters, validated at construction: every bad value is a
ValueError that starts with the field's name."""

from __future__ import annotations

import copy
import enum
import json as _json
import math
from array import array
from dataclasses import dataclass, field

_GREEDY_BELOW = 1e-5
_NO_ID = 2 ** 63  # no vocabulary is this large (and the sampler keeps token ids in int64)
MAX_LOGPROBS = 20
MAX_N = 128


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every step: all the text and tokens so far
    DELTA = 1  # every step: only what is new (streaming)
    FINAL_ONLY = 2  # once, when the request finishes


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Constrain the output to a grammar: exactly one of a JSON schema (`json`, a dict or its
    text), a regex, a choice among strings, or any JSON object (`json_object`).

    `reasoning_end`: the token ids that end a reasoning model's thinking (`</think>`). With it,
    the output is free until it ends with those ids and the grammar governs what comes after
    (as vLLM does with a reasoning parser); an output that never ends its reasoning is never
    constrained. `reasoning_start` (with it: the one token id that opens the thinking, `<think>`):
    the thinking happens only if the output opens with that token, so the first token may be it
    or any the grammar allows, and the grammar governs from the first token when it is not. It
    does not change the compiled grammar, so it is not in the cache key."""
    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    json_object: bool = False
    source: str | None = None  # the request field it came from, named in errors (not in the key)
    reasoning_end: tuple[int, ...] | None = None
    reasoning_start: int | None = None

    def __post_init__(self):
        given = [k for k in ("json", "regex", "choice") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of json, regex, choice or "
                             f"json_object, got {given or 'none'}")
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.reasoning_end is not None:
            end = tuple(self.reasoning_end) if isinstance(self.reasoning_end, (list, tuple)) else ()
            if not end or any(not _is_int(t) or t < 0 for t in end):
                raise ValueError(f"reasoning_end must be a non-empty sequence of token ids, got "
                                 f"{self.reasoning_end!r}")
            object.__setattr__(self, "reasoning_end", end)
        if self.reasoning_start is not None and (self.reasoning_end is None or not _is_int(self.reasoning_start)
                                                 or self.reasoning_start < 0):
            raise ValueError(f"reasoning_start must be a token id, with reasoning_end, got {self.reasoning_start!r}")

    def cache_key(self) -> str:
        # key order kept: it is the order the output's properties come in
        value = self.json if not isinstance(self.json, dict) else _json.dumps(self.json)
        return repr((value, self.regex, self.choice, self.json_object))


@dataclass(frozen=True, slots=True)
class ThinkingBudget:
    """At most `tokens` tokens of a reasoning model's thinking (vLLM's thinking_token_budget):
    past them the engine writes `end` (the ids of `</think>`; from where the output's tail
    already began it), and the answer follows. `start`: as StructuredOutputsParams'
    reasoning_start, the one token that opens the thinking when the output may open it itself
    (an output that does not open it has no thinking to bound)."""
    tokens: int
    end: tuple[int, ...]
    start: int | None = None

    def __post_init__(self):
        if not _is_int(self.tokens) or self.tokens < 0:
            raise ValueError(f"the thinking budget must be an integer >= 0, got {self.tokens!r}")
        end = tuple(self.end) if isinstance(self.end, (list, tuple)) else ()
        if not end or any(not _is_int(t) or t < 0 for t in end):
            raise ValueError(f"the thinking budget's end must be a non-empty sequence of token ids, got {self.end!r}")
        object.__setattr__(self, "end", end)
        if self.start is not None and (not _is_int(self.start) or self.start < 0):
            raise ValueError(f"the thinking budget's start must be a token id, got {self.start!r}")


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) keeps the whole vocabulary
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of seen tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    max_tokens: int | None = 16  # None: as many as the context leaves
    min_tokens: int = 0  # EOS and stop token ids are masked until this many are generated
    stop: list[str] = field(default_factory=list)  # strings that end the output
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    logprobs: int | None = None  # top log-probabilities per output token (plus the sampled one)
    prompt_logprobs: int | None = None  # the same for every prompt token
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None  # grammar-constrained output
    thinking_budget: ThinkingBudget | None = None  # a bound on a reasoning model's thinking
    allowed_token_ids: list[int] | None = None  # only these may be sampled (vLLM's)
    bad_words: list[str] = field(default_factory=list)  # words the output never writes (vLLM's)
    # each bad word's token ids, with and without a space before it: set by with_bad_words
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False, default=())
    # greedy with nothing for the sampler to do but an argmax: no bias, no min_tokens mask, no
    # penalties, no log-probabilities (set from the fields above: the sampler reads it every row)
    plain_greedy: bool = field(init=False, repr=False, compare=False, default=False)
    # logit_bias's token ids (int64s) and values (float32s), and stop_token_ids (int64s), packed
    # once: a step concatenates them (256 rows of 1,024 logit_bias entries, rebuilt as Python
    # triples, took 0.32 s a step)
    bias_tokens: bytes = field(init=False, repr=False, compare=False, default=b"")
    bias_values: bytes = field(init=False, repr=False, compare=False, default=b"")
    stop_tokens: bytes = field(init=False, repr=False, compare=False, default=b"")
    allowed_tokens: bytes = field(init=False, repr=False, compare=False, default=b"")

    def __post_init__(self):
        for name in ("n", "top_k", "min_tokens"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if not _is_number(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)!r}")
        for name in ("max_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2 ** 63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        if not 0.0 <= self.temperature <= 1e4:
            raise ValueError(f"temperature must be in [0, 10000], got {self.temperature}")
        if self.temperature < _GREEDY_BELOW:
            self.temperature = 0.0  # a tiny temperature is greedy (and would overflow the logits)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0:
            self.top_k = -1
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        self.logit_bias = self._check_logit_bias(self.logit_bias)
        self.bias_tokens = array("q", self.logit_bias.keys()).tobytes()
        self.bias_values = array("f", self.logit_bias.values()).tobytes()
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")
        if self.thinking_budget is not None and not isinstance(self.thinking_budget, ThinkingBudget):
            raise ValueError("thinking_budget must be a ThinkingBudget")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(not _is_int(t) or not 0 <= t < _NO_ID for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids (non-negative integers), got {self.stop_token_ids}")
        self.stop_tokens = array("q", self.stop_token_ids).tobytes()
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            ids = self.allowed_token_ids = list(ids) if isinstance(ids, (list, tuple)) else ids
            if not isinstance(ids, list) or not ids or any(not _is_int(t) or not 0 <= t < _NO_ID for t in ids):
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {ids}")
            self.allowed_tokens = array("q", ids).tobytes()
        self.bad_words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words or [])
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words must be words (strings that are not blank), got {self.bad_words!r}")
        try:  # the member itself: the engine tests it by identity
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise ValueError(f"output_kind must be one of {[k.name for k in RequestOutputKind]}, "
                             f"got {self.output_kind!r}") from None
        self.plain_greedy = (self.temperature == 0.0 and not self.logit_bias and not self.min_tokens
                             and self.logprobs is None and not self.has_penalties
                             and self.allowed_token_ids is None and not self.bad_words)

    def with_bad_words(self, encode) -> SamplingParams:
        """These params with bad_words tokenized (`encode`: text -> token ids, no special tokens),
        as a copy: the caller's object may go to another engine with another tokenizer. Each word
        as it stands and after a space (a word inside a text starts with one), where that gives
        other tokens than a space's own before the word's. vLLM keeps the second form only when
        it has as many tokens as the first, so a word that is one token after a space but two
        at the start of a text (" rainbow", "rain" "bow") is still written inside a text."""
        if not self.bad_words:
            return self
        ids = []
        for word in self.bad_words:
            plain, spaced = encode(word.lstrip()), encode(" " + word.lstrip())
            if not plain:
                continue
            ids.append(tuple(plain))
            if spaced != plain and spaced[1:] != plain:
                ids.append(tuple(spaced))
        params = copy.copy(self)
        params.bad_words_token_ids = tuple(ids)
        return params

    def banned_after(self, tokens, start: int) -> list[int]:
        """The tokens bad_words forbid next in a sequence (`tokens`, whose output begins at
        `start`): the last token of each word whose other tokens end the output."""
        n = len(tokens)
        return [w[-1] for w in self.bad_words_token_ids
                if len(w) == 1 or (n - start >= len(w) - 1 and tuple(tokens[n - len(w) + 1:]) == w[:-1])]

    @property
    def bans_by_context(self) -> bool:
        """Whether what bad_words forbid depends on the tokens before (a word of several tokens)."""
        return any(len(w) > 1 for w in self.bad_words_token_ids)

    @staticmethod
    def _check_logit_bias(bias) -> dict[int, float]:
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a map of token id to bias, got {bias!r}")
        out = {}
        for k, v in bias.items():
            try:
                token = int(k)  # OpenAI sends the ids as JSON object keys (strings)
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
            if not 0 <= token < _NO_ID or isinstance(k, bool):
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {k!r}")
            if not _is_number(v) or not -100.0 <= v <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {v!r} for token {k}")
            out[token] = float(v)
        return out

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
