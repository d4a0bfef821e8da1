"""Per-request grammar state: which tokens may come next, advanced with each sampled token."""

from __future__ import annotations

import numpy as np
from outlines_core import Guide

from pageserve.grammar.worker import CompiledGrammar


class Matcher:
    """Wraps an outlines-core Guide. `stop_ids` are the request's end tokens: allowed
    wherever the grammar may end, and the request stops by itself once nothing but them is
    allowed (`is_terminated`)."""

    __slots__ = ("grammar", "guide", "stop_ids", "num_tokens")

    def __init__(self, grammar: CompiledGrammar, stop_ids: tuple[int, ...], max_rollback: int = 32):
        self.grammar = grammar
        self.guide = Guide(grammar.index, max_rollback=max_rollback)
        self.stop_ids = stop_ids
        self.num_tokens = 0  # tokens accepted so far

    def advance(self, token_id: int) -> bool:
        """Accept one sampled token; False if the grammar does not allow it (the request is
        then ended by the caller)."""
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
        return self.guide.get_state() in self.grammar.terminal_states

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` advances (for speculative decoding)."""
        self.guide.rollback_state(num_tokens)
        self.num_tokens -= num_tokens

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into row `row` of a packed int32 [B, W] mask (bit
        j of word w = token 32 * w + j) living in CPU memory."""
        words = bitmask.shape[1]
        bitmask[row] = 0
        self.guide.write_mask_into(bitmask[row].ctypes.data, words, 4)
        if self.guide.is_finished():
            bits = bitmask.view(np.uint32)
            for t in self.stop_ids:
                if t // 32 < words:
                    bits[row, t // 32] |= np.uint32(1 << (t % 32))

    def fork(self) -> "Matcher":
        """A matcher in the same state (n > 1: siblings start from the parent's state)."""
        if self.num_tokens:
            raise ValueError("fork() is for a matcher that has accepted no token yet")
        return Matcher(self.grammar, self.stop_ids)
