"""Log-probabilities of sampled tokens: one token's (TokenLogprobs, as a step makes them) and a
sequence's or a prompt's (LogprobsList, packed in arrays for as long as the request lives)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Iterator


@dataclass(slots=True)
class TokenLogprobs:
    """The sampled token's log-probability and rank, and the top-k alternatives, in two arrays
    rather than k pairs: a request of n=128 with 20 alternatives over 8,000 tokens held 21
    million Python objects (+4.4 GB), and freeing them held the event loop 5.2 s."""
    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_ids: bytes  # int32s, the most likely first
    top_logprobs: bytes  # float32s

    @property
    def num_top(self) -> int:
        return len(self.top_ids) // 4

    @property
    def top(self) -> list[tuple[int, float]]:
        """The alternatives as (token id, log-probability) pairs, the most likely first."""
        return list(zip(array("i", self.top_ids), array("f", self.top_logprobs)))


class _Columns:
    __slots__ = ("token_ids", "logprobs", "ranks", "top_ids", "top_logprobs", "top_ends")

    def __init__(self):
        self.token_ids, self.logprobs, self.ranks = array("i"), array("d"), array("q")
        self.top_ids, self.top_logprobs = bytearray(), bytearray()
        self.top_ends = array("q")  # where each token's alternatives end in top_ids, in bytes


class LogprobsList:
    """A sequence's (or a prompt's) TokenLogprobs, in a few arrays rather than an object each:
    the cyclic garbage collector walks every live object, and a million of them (n=128 over
    8,000 tokens) made its full passes hold every thread, the event loop's too, 1.3-2.0 s.
    It reads as a list: an item is made when it is read, and a slice is a view of the same
    arrays (they only grow, so a view stays true). An item may be None (a prompt's first
    token has nothing before it): its rank is kept as 0."""
    __slots__ = ("_cols", "_start", "_stop")

    def __init__(self, items=()):
        self._cols, self._start, self._stop = _Columns(), 0, None
        self.extend(items)

    def _view(self, start: int, stop: int) -> LogprobsList:
        """Items start to stop of the same arrays (indices into them)."""
        view = LogprobsList.__new__(LogprobsList)
        view._cols, view._start, view._stop = self._cols, start, stop
        return view

    def append(self, e: TokenLogprobs | None) -> None:
        if self._stop is not None:
            raise TypeError("a view of a LogprobsList does not grow")
        c = self._cols
        if e is None:
            c.token_ids.append(0)
            c.logprobs.append(0.0)
            c.ranks.append(0)
        else:
            c.token_ids.append(e.token_id)
            c.logprobs.append(e.logprob)
            c.ranks.append(e.rank)
            c.top_ids += e.top_ids
            c.top_logprobs += e.top_logprobs
        c.top_ends.append(len(c.top_ids))

    def extend(self, items) -> None:
        for e in items:
            self.append(e)

    def copy(self) -> LogprobsList:
        """A list of its own, with the same items (a forked sequence's)."""
        return LogprobsList(self)

    def _end(self) -> int:
        return len(self._cols.token_ids) if self._stop is None else self._stop

    def __len__(self) -> int:
        return self._end() - self._start

    def _item(self, i: int) -> TokenLogprobs | None:
        c = self._cols
        if not c.ranks[i]:
            return None
        begin, end = c.top_ends[i - 1] if i else 0, c.top_ends[i]
        return TokenLogprobs(c.token_ids[i], c.logprobs[i], c.ranks[i], bytes(c.top_ids[begin:end]),
                             bytes(c.top_logprobs[begin:end]))

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            return self._view(self._start + start, self._start + max(start, stop))
        n = len(self)
        if not -n <= index < n:
            raise IndexError("LogprobsList index out of range")
        return self._item(self._start + index % n)

    def __iter__(self) -> Iterator[TokenLogprobs | None]:
        return map(self._item, range(self._start, self._end()))

    def __add__(self, other) -> LogprobsList:
        """The items of both (a stream's unread pieces merged): two pieces in a row of one
        list join as one view of it, anything else as a new list."""
        if not len(other):
            return self[:]
        if isinstance(other, LogprobsList) and other._cols is self._cols and other._stop is not None \
                and self._stop == other._start:
            return self._view(self._start, other._stop)
        joined = self.copy()
        joined.extend(other)
        return joined

    def __eq__(self, other) -> bool:
        try:
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        except TypeError:
            return NotImplemented

    def __repr__(self) -> str:
        return f"LogprobsList({list(self)!r})"
