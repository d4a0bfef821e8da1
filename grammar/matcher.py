"""Per-request grammar state: which tokens may come next, advanced with each sampled token."""

from __future__ import annotations

import numpy as np
from outlines_core import Guide

from pageserve.grammar.worker import CompiledGrammar


def reasoning_end_position(output_ids: list[int], end: tuple[int, ...], start: int = 0) -> int | None:
    """The output length at which `output_ids` first ends with `end` (the grammar governs the
    tokens after it), or None: the reasoning has not ended. `start`: where `end` may begin at
    the earliest (the caller looked before it already)."""
    k = len(end)
    for n in range(start + k, len(output_ids) + 1):
        if tuple(output_ids[n - k:n]) == end:
            return n
    return None


class Matcher:
    """Wraps an outlines-core Guide. `stop_ids` are the request's end tokens: allowed
    wherever the grammar may end, and the request stops by itself once nothing but them is
    allowed (`is_terminated`).

    With `reasoning_end` (a reasoning model's `</think>` ids) the grammar waits: `start` is
    None until the output ends with those ids, then the output position the grammar governs
    from; until then the caller neither masks nor advances it, but passes each token to
    `think`. With `reasoning_start` too (the one token that opens the thinking) the output's
    first token decides (`opening`): it may be that token (then the grammar waits as above) or
    one the grammar allows (then it governs from the first token).

    With `budget` (a ThinkingBudget's tokens), once the thinking has that many tokens the next
    are masked to the rest of `reasoning_end` (`forcing`). `grammar` None: a budget alone, with
    nothing to govern after the thinking."""

    __slots__ = ("grammar", "guide", "stop_ids", "num_tokens", "reasoning_end", "reasoning_start", "opening",
                 "start", "budget", "thought", "end_at")

    def __init__(self, grammar: CompiledGrammar | None, stop_ids: tuple[int, ...], max_rollback: int = 32,
                 reasoning_end: tuple[int, ...] | None = None, reasoning_start: int | None = None,
                 budget: int | None = None):
        self.grammar = grammar
        self.guide = Guide(grammar.index, max_rollback=max_rollback) if grammar is not None else None
        self.stop_ids = stop_ids
        self.num_tokens = 0  # tokens accepted so far
        self.reasoning_end = reasoning_end or None
        self.reasoning_start = reasoning_start if self.reasoning_end else None
        self.opening = self.reasoning_start is not None  # the first token is still to come
        self.start: int | None = None if self.reasoning_end else 0
        self.budget = budget if self.reasoning_end else None
        self.thought = 0  # tokens of thinking so far
        self.end_at = 0  # how much of reasoning_end the output's tail holds

    @property
    def forcing(self) -> bool:
        """The thinking has used its budget: the next token is the end marker's next."""
        return self.budget is not None and self.start is None and not self.opening and self.thought >= self.budget

    @property
    def active(self) -> bool:
        """The next token is masked: the grammar governs it (it is not waiting for the end of
        reasoning), it is the output's first and may open the thinking, or the budget forces it."""
        return self.guide is not None and (self.start is not None or self.opening) or self.forcing

    @property
    def reads_tokens(self) -> bool:
        """The host must see each token before the next is drawn: a grammar, or thinking still to
        watch (a budget alone, once the thinking is over, needs nothing)."""
        return self.guide is not None or self.start is None or self.opening

    def think(self, token_id: int) -> None:
        """One token of the thinking (while the grammar waits for its end)."""
        self.thought += 1
        end = self.reasoning_end
        if token_id == end[self.end_at]:
            self.end_at += 1
        else:  # tags are short: a restart at the first id is exact for `</think>`'s ids
            self.end_at = 1 if token_id == end[0] else 0

    def ends_reasoning(self, token_ids: list[int], num_prompt_tokens: int) -> bool:
        """Whether the output (`token_ids` after the prompt) now ends with `reasoning_end`:
        asked once per appended token while the grammar waits, so it looks at the tail only."""
        end = self.reasoning_end
        n = len(token_ids)
        return (n - num_prompt_tokens >= len(end) and token_ids[-1] == end[-1]
                and tuple(token_ids[n - len(end):]) == end)

    def advance(self, token_id: int) -> bool:
        """Accept one sampled token; False if the grammar does not allow it (the request is
        then ended by the caller)."""
        if self.guide is None:
            self.num_tokens += 1
            return True
        if token_id in self.stop_ids:
            return self.guide.is_finished()
        try:
            self.guide.advance(token_id, return_tokens=False)
        except Exception:  # noqa: BLE001 - outlines-core raises on a disallowed token
            return False
        self.num_tokens += 1
        return True

    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more but an end token."""
        return self.guide is not None and self.guide.get_state() in self.grammar.terminal_states

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` advances (for speculative decoding)."""
        if self.guide is not None:
            self.guide.rollback_state(num_tokens)
        self.num_tokens -= num_tokens

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into row `row` of a packed int32 [B, W] mask (bit
        j of word w = token 32 * w + j) living in CPU memory."""
        words = bitmask.shape[1]
        bitmask[row] = 0
        bits = bitmask.view(np.uint32)
        if self.forcing:
            t = self.reasoning_end[self.end_at]
            if t // 32 < words:
                bits[row, t // 32] = np.uint32(1 << (t % 32))
            return
        self.guide.write_mask_into(bitmask[row].ctypes.data, words, 4)
        if self.guide.is_finished():
            for t in self.stop_ids:
                if t // 32 < words:
                    bits[row, t // 32] |= np.uint32(1 << (t % 32))
        if self.opening and self.reasoning_start // 32 < words:
            bits[row, self.reasoning_start // 32] |= np.uint32(1 << (self.reasoning_start % 32))

    def fork(self) -> "Matcher":
        """A matcher in the same state (n > 1: siblings start from the parent's state)."""
        if self.num_tokens:
            raise ValueError("fork() is for a matcher that has accepted no token yet")
        child = Matcher(self.grammar, self.stop_ids, reasoning_end=self.reasoning_end,
                        reasoning_start=self.reasoning_start, budget=self.budget)
        child.start, child.opening, child.thought, child.end_at = self.start, self.opening, self.thought, self.end_at
        return child
