"""What the engine counts, and the snapshot of it that the server reads (metrics, the status
line): the app asks the engine for `stats()` instead of walking into its scheduler and cache."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class IterationCounters:
    """Running totals the engine keeps as it steps."""
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    generation_tokens: int = 0
    kv_waste_sum: float = 0.0  # per step: allocated slots not holding a token / allocated slots
    kv_waste_steps: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # generation requests by finish reason
    step_seconds: float = 0.0  # in the model runner (forward, sampling, swaps, the vision encoder)
    encoder_seconds: float = 0.0  # of which in the vision encoder

    def record_step(self, kv_waste: float | None) -> None:
        """A step done; `kv_waste`: the KV cache's unused fraction after it (None: nothing held)."""
        self.steps += 1
        if kv_waste is not None:
            self.kv_waste_sum += kv_waste
            self.kv_waste_steps += 1

    def count_finished(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1

    @property
    def kv_waste(self) -> float:
        return self.kv_waste_sum / max(self.kv_waste_steps, 1)


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_running: int  # requests in the running batch
    num_waiting: int  # admitted to the engine, not yet running
    num_swapped: int
    kv_cache_usage: float  # fraction of KV blocks in use
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of them, found
    num_preemptions: int
    num_recomputed: int  # preemptions that freed the blocks (the others swapped out)
    max_loras: int = 0  # --max-loras (0: adapters off)
    running_loras: tuple[str, ...] = ()  # the adapters of the running requests, by name
    waiting_loras: tuple[str, ...] = ()  # ... and of the waiting and swapped ones


@dataclass(frozen=True, slots=True)
class EngineStats:
    scheduler: SchedulerStats
    steps: int
    prompt_tokens: int
    generation_tokens: int
    kv_waste: float
    finished: dict[str, int]  # a copy
    step_seconds: float = 0.0
    encoder_seconds: float = 0.0
    spec: object = None  # spec_decode.SpecStats with --speculative-config

    @property
    def prefix_cache_hit_rate(self) -> float:
        s = self.scheduler
        return s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
