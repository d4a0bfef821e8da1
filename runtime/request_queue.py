"""The scheduler's queues of requests that do not run (waiting, swapped out), in the order it
takes them: by arrival (a deque), or under --scheduling-policy priority by (priority, arrival),
the lowest first, as vLLM orders them."""

from __future__ import annotations

import bisect
from collections import deque

from pageserve.runtime.config import SchedulingPolicy
from pageserve.runtime.request import Request


def priority_key(req: Request) -> tuple[int, float]:
    return req.priority, req.arrival_time


class PriorityQueue:
    """Requests sorted by priority_key, with the deque methods the scheduler uses. A request
    put back at the front (appendleft: preempted, or passed over) goes where its key puts it."""

    __slots__ = ("_items",)

    def __init__(self):
        self._items: list[Request] = []

    def append(self, req: Request) -> None:
        bisect.insort_right(self._items, req, key=priority_key)

    appendleft = append

    def extendleft(self, reqs) -> None:
        for req in reqs:
            self.append(req)

    def popleft(self) -> Request:
        return self._items.pop(0)

    def remove(self, req: Request) -> None:
        self._items.remove(req)

    def __getitem__(self, i: int) -> Request:
        return self._items[i]

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, req: Request) -> bool:
        return req in self._items


def request_queue(policy: SchedulingPolicy) -> deque[Request] | PriorityQueue:
    return PriorityQueue() if policy == SchedulingPolicy.PRIORITY else deque()
