"""One HTTP request's outputs on their way from the engine task to its handler: a queue per
stream, read by one handler, in which a request's unread streamed (delta) outputs are merged per
sequence, as vLLM's output collector does: a slow reader gets fewer, longer pieces and the
server writes fewer events, instead of falling further behind."""

from __future__ import annotations

import asyncio
import collections
from dataclasses import fields, replace

from pageserve.runtime.outputs import RequestOutput


class RequestStream:
    """The outputs of one HTTP request's engine requests (one per prompt or choice) through one
    queue. Iteration ends once all of them have finished; `abort()` (safe at any time) cancels
    those still running. Streamed (delta) outputs that wait for a reader behind the engine are
    merged, per sequence, as vLLM's output collector does: a slow reader gets fewer, longer
    pieces and the server writes fewer events, instead of falling further behind."""

    __slots__ = ("_queue", "_waiter", "_engine", "_open", "_deltas", "_unread")

    def __init__(self, engine):
        """engine: the AsyncEngine, whose abort(request_id, stream) cancels a request."""
        self._queue: collections.deque[RequestOutput | BaseException] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._engine = engine
        self._open: set[str] = set()
        self._deltas: set[str] = set()  # requests whose outputs are deltas
        self._unread: dict[tuple[str, int], RequestOutput] = {}  # each sequence's delta in the queue

    def expect(self, request_id: str, deltas: bool) -> None:
        """An engine request whose outputs come here (deltas: its outputs are streamed pieces)."""
        self._open.add(request_id)
        if deltas:
            self._deltas.add(request_id)

    def put(self, item: RequestOutput | BaseException) -> None:
        if not isinstance(item, BaseException) and item.request_id in self._deltas:
            key = (item.request_id, item.outputs[0].index)
            queued = self._unread.get(key)
            # a request's finished output stays its last item (its reader stops at it)
            if queued is not None and (not item.finished or queued is self._queue[-1]):
                merge_delta(queued, item)
                return
            self._unread[key] = item
        self._queue.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._open:
            raise StopAsyncIteration
        while not self._queue:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._queue.popleft()
        if isinstance(item, BaseException):
            self.abort()
            raise item
        if self._unread and item.request_id in self._deltas:  # (an embedding's output has no sequences)
            key = (item.request_id, item.outputs[0].index)
            if self._unread.get(key) is item:
                del self._unread[key]
        if item.finished:
            self._open.discard(item.request_id)
        return item

    def abort(self) -> None:
        for rid in self._open:
            self._engine.abort(rid, self)
        self._open.clear()


_LATEST = tuple(f.name for f in fields(RequestOutput) if f.name not in ("outputs", "prompt_logprobs"))


def merge_delta(queued: RequestOutput, then: RequestOutput) -> None:
    """Fold a sequence's next delta output into its unread one: the text, tokens and
    log-probs of both, the rest (finished, metrics) as of the later one."""
    a, b = queued.outputs[0], then.outputs[0]
    logprobs = b.logprobs if a.logprobs is None else a.logprobs + (b.logprobs or [])
    queued.outputs = [replace(b, text=a.text + b.text, token_ids=a.token_ids + b.token_ids, logprobs=logprobs)]
    for name in _LATEST:
        setattr(queued, name, getattr(then, name))
    if queued.prompt_logprobs is None:
        queued.prompt_logprobs = then.prompt_logprobs
