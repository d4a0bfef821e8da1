"""Finished responses kept in memory for `previous_response_id`, `GET` and `DELETE
/v1/responses/{id}`: a map in least-recently-used order, bounded by a count
(`--max-stored-responses`) and by bytes (`--max-stored-responses-mb`). Nothing is written to
disk: stored responses end with the process.

A response links to the one it continued instead of copying the conversation, so a long chain
of turns holds each item once. Sizes are the responses' and inputs' bytes as JSON (the Python
objects behind them take a few times that), each counted with its whole chain, which
over-counts what chains share: what the store holds stays within the bound, even for a chain
whose earlier turns were evicted (they live on, uncounted on their own, as long as a later turn
needs them). An `item_reference` finds the items of the responses still stored (their input
and output), not those of evicted turns that a stored one continues."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import orjson


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict  # the response object as it was returned
    input_items: tuple[dict, ...]  # this request's own input items, each with its id
    previous: StoredResponse | None  # the response this one continued
    size: int  # bytes of this response and its input, plus the previous one's size

    @classmethod
    def build(cls, response: dict, input_items: tuple[dict, ...], previous: StoredResponse | None) -> StoredResponse:
        own = len(orjson.dumps(response)) + len(orjson.dumps(input_items))
        return cls(response, input_items, previous, own + (previous.size if previous else 0))

    @property
    def own_items(self) -> tuple[dict, ...]:
        return (*self.input_items, *self.response["output"])

    def conversation(self) -> list[dict]:
        """Every item up to and including this response's output, oldest first."""
        chain = []
        node: StoredResponse | None = self
        while node is not None:
            chain.append(node)
            node = node.previous
        return [item for node in reversed(chain) for item in node.own_items]


class ResponseStore:
    def __init__(self, max_responses: int, max_bytes: int):
        if max_responses < 0 or max_bytes < 0:
            raise ValueError("the stored responses' bounds must be >= 0")
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self.bytes = 0
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        # item id -> {response id: item} for every stored response that holds it (a client sends
        # output items back as input, ids and all), newest last: item_reference in O(1)
        self._items: dict[str, dict[str, dict]] = {}

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, stored: StoredResponse) -> bool:
        """Keep `stored`, evicting the least recently used; False when it alone is over a bound."""
        if self.max_responses == 0 or stored.size > self.max_bytes:
            return False
        rid = stored.response["id"]
        self.delete(rid)
        self._responses[rid] = stored
        self.bytes += stored.size
        for item in stored.own_items:
            self._items.setdefault(item["id"], {})[rid] = item
        while len(self._responses) > self.max_responses or self.bytes > self.max_bytes:
            self.delete(next(iter(self._responses)))
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        stored = self._responses.pop(response_id, None)
        if stored is None:
            return False
        self.bytes -= stored.size
        for item in stored.own_items:
            holders = self._items.get(item["id"])
            if holders is not None:
                holders.pop(response_id, None)
                if not holders:
                    del self._items[item["id"]]
        return True

    def find_item(self, item_id: str) -> dict | None:
        """An item (input or output) of a stored response, for an `item_reference`; from the
        response stored last when several hold it."""
        holders = self._items.get(item_id)
        return next(reversed(holders.values())) if holders else None
