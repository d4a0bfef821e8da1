"""One generation request: its tokens, its progress and its status."""

from __future__ import annotations

import copy
import enum
import time

from pageserve.sampling.logprobs import LogprobsList
from pageserve.sampling.params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2  # preempted, its KV blocks in the CPU swap space
    PREEMPTED = 3  # preempted, its KV blocks freed: recomputed when it runs again
    WAITING_FOR_GRAMMAR = 4  # waiting, but not admitted until its grammar has compiled
    # everything after WAITING_FOR_GRAMMAR is finished
    FINISHED_STOPPED = 5
    FINISHED_LENGTH = 6
    FINISHED_ABORTED = 7

    @property
    def finished(self) -> bool:
        return self > LAST_UNFINISHED


# a plain int: the member's look-up costs 3x the test; hot loops compare with it, not .finished
LAST_UNFINISHED = int(RequestStatus.WAITING_FOR_GRAMMAR)


def child_id(request_id: str, index: int) -> str:
    """The engine request id of the index-th sequence of an n > 1 request."""
    return request_id if index == 0 else f"{request_id}#{index}"


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    __slots__ = (
        "request_id", "prompt_token_ids", "token_ids", "num_prompt_tokens", "sampling_params",
        "status", "num_computed_tokens", "max_tokens", "arrival_time", "stop_reason",
        "eos_token_ids", "prompt", "cache_salt", "first_token_time", "finished_time",
        "detokenizer", "num_sent_tokens", "pooling", "pooled", "output_id", "index",
        "num_samples", "logprobs", "prompt_logprobs", "scheduled_time", "num_prompt_counted",
        "grammar", "matcher", "num_cached_tokens", "mm_items", "encoder_seconds", "lora", "draft_tokens",
        "priority",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 max_tokens: int, eos_token_ids: tuple[int, ...], prompt: str | None = None,
                 cache_salt: str | None = None, pooling: bool = False, mm_items: tuple = (), lora=None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.token_ids = list(prompt_token_ids)  # prompt followed by output
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens  # resolved against the context length
        self.eos_token_ids = eos_token_ids
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.arrival_time = time.monotonic()
        self.priority = 0  # --scheduling-policy priority: the lowest value runs first
        self.stop_reason: int | str | None = None
        self.cache_salt = cache_salt  # keeps one tenant's prefix cache from serving another
        self.lora = lora  # the LoRARequest it runs under (None: the base model)
        self.draft_tokens: list[int] = []  # speculative tokens proposed for its next step
        self.mm_items = mm_items  # multimodal.ImageItem of each image in the prompt, in order
        self.encoder_seconds = 0.0  # spent encoding its images
        self.scheduled_time: float | None = None  # first admitted to a step
        self.num_prompt_counted = 0  # prompt tokens counted in the stats (not again on recompute)
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache when first admitted
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.detokenizer = None  # IncrementalDetokenizer, set by the engine
        self.num_sent_tokens = 0  # output tokens already handed out (streaming)
        # embedding requests: prefill only, summing the last hidden states of every token
        self.pooling = pooling
        self.pooled = None
        # n > 1: the parent samples n first tokens, then forks into n sequences that share the
        # prompt's blocks; all report under output_id with their own index
        self.output_id = request_id
        self.index = 0
        self.num_samples = sampling_params.n  # tokens drawn at the next sample: n until forked
        self.logprobs: LogprobsList | None = LogprobsList() if sampling_params.logprobs is not None else None
        self.prompt_logprobs: LogprobsList | None = \
            LogprobsList([None]) if sampling_params.prompt_logprobs is not None else None
        # structured output: the grammar's compile future until it is ready, then its matcher
        # (which waits for the end of the reasoning when asked to: Matcher.start)
        self.grammar = None
        self.matcher = None

    def fork(self, index: int) -> "Request":
        """The index-th sequence of this n > 1 request, made once its prompt is computed and
        its n first tokens drawn: a copy of every field (a field added later is copied too),
        then what each sequence owns: its id and index, its token list, its grammar state and
        its output so far. The caller gives it a detokenizer. Shared with the parent: the
        prompt, its progress and timings, and the prompt logprobs (complete by now)."""
        child = copy.copy(self)
        child.request_id = child_id(self.request_id, index)
        child.index, child.num_samples = index, 1
        child.status = RequestStatus.WAITING  # the scheduler's fork makes it RUNNING
        child.token_ids = list(self.token_ids)
        child.logprobs = self.logprobs.copy() if self.logprobs is not None else None
        child.matcher = self.matcher.fork() if self.matcher is not None else None
        child.detokenizer, child.stop_reason, child.num_sent_tokens = None, None, 0
        return child

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def needs_every_position(self) -> bool:
        """Prefix-cache hits would skip positions whose hidden states this request needs."""
        return self.pooling or self.prompt_logprobs is not None

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
