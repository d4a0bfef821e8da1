"""Speculative decoding: drafts proposed for the decoding requests before each step, scored by
the target model with the request's last real token in one forward. Two proposers, as vLLM
names them: "ngram" (prompt lookup, llama.cpp's lookup decoding: a request whose last n tokens,
prompt_lookup_max down to prompt_lookup_min, occurred earlier in its prompt or output proposes
the k tokens that followed them) and "draft_model" (a small model's greedy tokens: here the
proposer only reserves the k places, which runtime/draft_model.py fills in the runner's step).
The target samples a token at the last real token and at each draft, as if the drafts before it
were the request's tokens. The drafts equal to the sampled tokens are
kept, then the sampled token after them (verify). A draft is a point mass, for which this is
the rejection-sampling rule: the draft is kept with the probability the target gives it, and a
rejected one is replaced by a draw from the target without it. So every token is distributed
as one token a step gives it; greedy and seeded requests get exactly the same tokens (the
runner rewinds a seeded generator to the draws of the kept tokens)."""

from __future__ import annotations

from dataclasses import dataclass

from pageserve.runtime.config import SpeculativeConfig
from pageserve.runtime.request import Request


def can_speculate(req: Request, grammars: bool = True) -> bool:
    """Whether drafts can be scored for this request: one sequence (n > 1 forks first), no
    penalties (their counts would need the drafts), not pooling; a grammar (where the proposer
    can check drafts against it) only while it governs the tokens, not while it waits for the
    end of reasoning or the output's first token; a thinking budget, once the thinking is over."""
    p, m = req.sampling_params, req.matcher
    thought = m is not None and m.start is not None and not m.opening  # no thinking (left) to bound
    return (req.num_samples == 1 and not p.has_penalties and not req.pooling
            and (p.structured_outputs is None or grammars and thought)
            and (p.thinking_budget is None or thought))


def verify(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a step of drafts gives: the drafts equal to the tokens sampled at their
    places, then the sampled token after them (sampled: one per draft and one past the last)."""
    n = 0
    while n < len(drafts) and drafts[n] == sampled[n]:
        n += 1
    return drafts[:n] + [sampled[n]]


def grammar_prefix(matcher, drafts: list[int]) -> list[int]:
    """The drafts a request's grammar allows, up to the first it refuses, a stop token or the
    grammar's end (the matcher is left as it was)."""
    n = 0
    for token in drafts:
        if token in matcher.stop_ids or matcher.is_terminated() or not matcher.advance(token):
            break
        n += 1
    if n:
        matcher.rollback(n)
    return drafts[:n]


class _Backoff:
    __slots__ = ("misses", "skip")

    def __init__(self):
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


class Proposer:
    """What both methods share: which requests get drafts and how many, the back-off of
    requests whose drafts keep failing, and the counts."""
    grammars = True  # drafts are checked against a request's grammar when proposed

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self._backoff: dict[str, _Backoff] = {}
        self.stats = SpecStats(accepted_per_position=[0] * config.num_speculative_tokens)

    def propose_all(self, running: list[Request], max_model_len: int) -> None:
        """Drafts for the running requests that decode next, in their draft_tokens (none above
        the batch size where speculation stops paying)."""
        limit = self.config.disable_by_batch_size
        off = limit is not None and len(running) > limit
        for req in running:
            if off or req.num_tokens - req.num_computed_tokens != 1 or not can_speculate(req, self.grammars):
                req.draft_tokens = []
                continue
            room = min(max_model_len - req.num_tokens, req.max_tokens - req.num_output_tokens) - 1
            drafts = self.propose(req, room)
            m = req.matcher
            req.draft_tokens = grammar_prefix(m, drafts) if m is not None and m.guide is not None and drafts else drafts

    def propose(self, req: Request, max_len: int) -> list[int]:
        """Up to k drafts to follow req's tokens, no more than max_len (room left in its context
        and max_tokens); none for a few steps after runs of which nothing was accepted."""
        k = min(self.config.num_speculative_tokens, max_len)
        if k <= 0:
            return []
        backoff = self._backoff.get(req.request_id)
        if backoff is None:
            backoff = self._backoff[req.request_id] = _Backoff()
        if backoff.skip:
            backoff.skip -= 1
            return []
        return self._drafts(req, k)

    def _drafts(self, req: Request, k: int) -> list[int]:
        raise NotImplementedError

    def accept_all(self, scheduled: list, runs: dict[str, list[int]]) -> dict[str, list[int]]:
        """Count the step's draft runs (`runs`: the runner's StepResult.spec_tokens, the tokens
        each request with drafts was given) and return them."""
        for sr in scheduled:
            if sr.draft_tokens:
                self.record(sr.request_id, sr.draft_tokens, runs[sr.request_id])
        return runs

    def record(self, request_id: str, drafts: list[int], run: list[int]) -> None:
        """Count a step's run (accepted drafts and one). A request whose runs keep failing waits
        1, 2, 4, ... 32 steps before its next one: a rejected run costs the step the drafts' rows."""
        accepted = len(run) - 1
        backoff = self._backoff.get(request_id)
        if backoff is not None:
            backoff.misses = 0 if accepted else backoff.misses + 1
            backoff.skip = min(2 ** (backoff.misses - 1), MAX_SKIP) if backoff.misses else 0
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += len(drafts)
        s.num_accepted_tokens += accepted
        for i in range(accepted):
            s.accepted_per_position[i] += 1

    def release(self, request_id: str) -> None:
        self._backoff.pop(request_id, None)


class _Index:
    """A request's n-grams: each -> where its latest occurrence that has a token after it starts
    (the latest: a small model copying a pasted file drifts from it and then repeats its own
    recent text; measured on the default model continuing a file, 3.7 tokens a step against 3.0
    with the first occurrence); grown as the request's tokens are."""
    __slots__ = ("seen", "num_indexed")

    def __init__(self):
        self.seen: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0  # n-grams ending before this position are in `seen`


class NgramProposer(Proposer):
    def __init__(self, config: SpeculativeConfig):
        super().__init__(config)
        self._index: dict[str, _Index] = {}

    def _drafts(self, req: Request, k: int) -> list[int]:
        """The k tokens that followed the longest suffix n-gram's latest occurrence; [] when no
        n-gram of its suffix occurred before. An occurrence whose continuation reaches the end
        is a loop: its continuation repeats with the loop's period."""
        c, tokens = self.config, req.token_ids
        if len(tokens) <= c.prompt_lookup_min:
            return []
        index = self._index.get(req.request_id)
        if index is None:
            index = self._index[req.request_id] = _Index()
        self._grow(index, tokens)
        for n in range(min(c.prompt_lookup_max, len(tokens) - 1), c.prompt_lookup_min - 1, -1):
            start = index.seen.get(tuple(tokens[-n:]))
            if start is not None:
                follow = tokens[start + n:start + n + k]
                return (follow * -(-k // len(follow)))[:k]
        return []

    def _grow(self, index: _Index, tokens: list[int]) -> None:
        """Index every n-gram that ends before the last token (each has a token after it)."""
        lo, hi = self.config.prompt_lookup_min, self.config.prompt_lookup_max
        seen = index.seen
        for end in range(index.num_indexed, len(tokens) - 1):  # the n-grams ending at `end`
            for n in range(lo, min(hi, end + 1) + 1):
                seen[tuple(tokens[end + 1 - n:end + 1])] = end + 1 - n
        index.num_indexed = max(index.num_indexed, len(tokens) - 1)

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self._index.pop(request_id, None)


PLACEHOLDER = 0  # a reserved draft place, filled by the draft model in the runner before any forward


class DraftModelProposer(Proposer):
    """k places a step for the draft model's tokens (runtime/draft_model.py writes them into the
    scheduled chunk). Not for requests under a grammar: the draft's tokens are not checked
    against it."""
    grammars = False

    def _drafts(self, req: Request, k: int) -> list[int]:
        return [PLACEHOLDER] * k


def make_proposer(config: SpeculativeConfig) -> Proposer:
    return DraftModelProposer(config) if config.method == "draft_model" else NgramProposer(config)
