"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


_GREEDY_BELOW = 1e-5


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every step: all the text and tokens so far
    DELTA = 1  # every step: only what is new (streaming)
    FINAL_ONLY = 2  # once, when the request finishes


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) keeps the whole vocabulary
    max_tokens: int | None = 16  # None: as many as the context leaves
    stop: list[str] = field(default_factory=list)  # strings that end the output
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self):
        for name in ("n", "top_k"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        for name in ("temperature", "top_p"):
            if not isinstance(getattr(self, name), (int, float)) or isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a number, got {getattr(self, name)!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)):
            raise ValueError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.n != 1:
            raise ValueError(f"n must be 1 for now, got {self.n}")
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
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
