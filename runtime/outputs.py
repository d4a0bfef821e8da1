"""What the engine hands back: small result objects, as vLLM's offline API shapes them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One token's log-probability at a position, as vLLM's offline API gives it."""
    logprob: float
    rank: int | None = None  # 1 = the most likely token of the model's own distribution
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or string that ended it, if any
    # per output token, when asked for: the engine's TokenLogprobs (in a LogprobsList, read as a
    # list); LLM.generate hands out vLLM's dict[token_id, Logprob] (the sampled token, then the top ones)
    logprobs: Sequence | None = None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float  # time.monotonic() seconds
    first_token_time: float | None
    finished_time: float | None
    scheduled_time: float | None = None  # first admitted to a step
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # all sequences of the request, so far
    longest_output: int = 0  # tokens of its longest sequence
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (usage.prompt_tokens_details)
    num_images: int = 0
    encoder_time: float = 0.0  # seconds in the vision encoder for its images

    @property
    def queue_time(self) -> float | None:
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time

    @property
    def e2e_time(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean gap between output tokens after the first."""
        if self.finished_time is None or self.first_token_time is None or self.longest_output < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.longest_output - 1)

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    embedding: list[float] | None = None  # embedding requests: the pooled, normalized vector
    prompt_logprobs: Sequence | None = None  # None for the first token, then as CompletionOutput.logprobs
    lora_request: object = None  # the LoRARequest it ran under (None: the base model)
