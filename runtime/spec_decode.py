"""Speculative decoding by n-gram lookup (vLLM's "ngram" method, llama.cpp's lookup decoding):
a decoding request whose last n tokens (prompt_lookup_max down to prompt_lookup_min) occurred
earlier in its prompt or output proposes the k tokens that followed them; the target model
scores the last real token and the k drafts in one forward, and the longest run of drafts
equal to its own greedy choices is kept, plus its token after that run. Greedy only, so the
output is exactly what decoding one token a step gives; requests that sample, take logprobs,
penalties, logit bias or a grammar decode one token a step as before."""

from __future__ import annotations

from dataclasses import dataclass

from pageserve.runtime.config import SpeculativeConfig
from pageserve.runtime.request import Request


def can_speculate(req: Request) -> bool:
    """Whether a draft run cannot change what this request would have been given."""
    p = req.sampling_params
    return (p.greedy and req.num_samples == 1 and p.logprobs is None and p.structured_outputs is None
            and not p.has_penalties and not p.logit_bias and req.num_output_tokens >= p.min_tokens
            and not req.pooling and req.matcher is None)


class _Index:
    """A request's n-grams: each -> where its first occurrence that has a token after it starts
    (the first, as vLLM: its continuation is the longest, and it is the pasted text's rather than
    a repetition's just before); grown as the request's tokens are."""
    __slots__ = ("seen", "num_indexed", "misses", "skip")

    def __init__(self):
        self.seen: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0  # n-grams ending before this position are in `seen`
        self.misses = 0  # draft runs in a row of which nothing was accepted
        self.skip = 0  # steps left without drafts


MAX_SKIP = 32  # steps a request whose drafts keep failing waits, at most


@dataclass
class SpecStats:
    num_drafts: int = 0  # draft runs scored
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] | None = None  # drafts accepted at position 0, 1, ...

    def copy(self) -> SpecStats:
        return SpecStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                         list(self.accepted_per_position))

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a speculative step gives a request on average: its accepted drafts and one."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self._index: dict[str, _Index] = {}
        self.stats = SpecStats(accepted_per_position=[0] * config.num_speculative_tokens)

    def propose_all(self, running: list[Request], max_model_len: int) -> None:
        """Drafts for the running requests that decode next, in their draft_tokens (none above
        the batch size where speculation stops paying)."""
        limit = self.config.disable_by_batch_size
        off = limit is not None and len(running) > limit
        for req in running:
            if off or req.num_tokens - req.num_computed_tokens != 1 or not can_speculate(req):
                req.draft_tokens = []
                continue
            room = min(max_model_len - req.num_tokens, req.max_tokens - req.num_output_tokens) - 1
            req.draft_tokens = self.propose(req, room)

    def accept_all(self, scheduled: list, targets: dict[str, list[int]]) -> dict[str, list[int]]:
        """Request id -> the tokens its draft run gives (accept), for the step's scheduled
        requests that had drafts; `targets`: the runner's StepResult.spec_tokens."""
        return {sr.request_id: self.accept(sr.request_id, sr.draft_tokens, targets[sr.request_id])
                for sr in scheduled if sr.draft_tokens}

    def propose(self, req: Request, max_len: int) -> list[int]:
        """Up to k drafts to follow req's tokens, no more than max_len (room left in its context
        and max_tokens); [] when no n-gram of its suffix occurred before."""
        c = self.config
        k = min(c.num_speculative_tokens, max_len)
        tokens = req.token_ids
        if k <= 0 or len(tokens) <= c.prompt_lookup_min:
            return []
        index = self._index.get(req.request_id)
        if index is None:
            index = self._index[req.request_id] = _Index()
        if index.skip:  # its drafts have been rejected lately: a few steps without
            index.skip -= 1
            return []
        self._grow(index, tokens)
        for n in range(min(c.prompt_lookup_max, len(tokens) - 1), c.prompt_lookup_min - 1, -1):
            start = index.seen.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start + n:start + n + k]
        return []

    def _grow(self, index: _Index, tokens: list[int]) -> None:
        """Index every n-gram that ends before the last token (each has a token after it)."""
        lo, hi = self.config.prompt_lookup_min, self.config.prompt_lookup_max
        seen = index.seen
        for end in range(index.num_indexed, len(tokens) - 1):  # the n-grams ending at `end`
            for n in range(lo, min(hi, end + 1) + 1):
                seen.setdefault(tuple(tokens[end + 1 - n:end + 1]), end + 1 - n)
        index.num_indexed = max(index.num_indexed, len(tokens) - 1)

    def accept(self, request_id: str, drafts: list[int], targets: list[int]) -> list[int]:
        """The tokens a step of drafts gives: the drafts the target's greedy tokens agree with,
        then the target's own token after them (targets: one per draft, and one past the last).
        A request whose runs keep failing waits 1, 2, 4, ... 32 steps before its next one: a
        rejected run costs the step the drafts' rows."""
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
            accepted += 1
        index = self._index.get(request_id)
        if index is not None:
            index.misses = 0 if accepted else index.misses + 1
            index.skip = min(2 ** (index.misses - 1), MAX_SKIP) if index.misses else 0
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += len(drafts)
        s.num_accepted_tokens += accepted
        for i in range(accepted):
            s.accepted_per_position[i] += 1
        return drafts[:accepted] + [targets[accepted]]

    def release(self, request_id: str) -> None:
        self._index.pop(request_id, None)
