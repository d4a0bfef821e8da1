"""Finished responses kept in memory for `previous_response_id`, `GET` and `DELETE
/v1/responses/{id}`. Each response belongs to the API key that made it (a hash of the key; ""
without --api-key): another key sees none of it, as if it did not exist. Each owner has its own
share, least recently used out, bounded by a count (`--max-stored-responses`) and by bytes
(`--max-stored-responses-mb`), so one key's burst cannot push out another key's conversations.
Nothing is written to disk: stored responses end with the process.

A response is kept as compressed JSON (its own items, and the response object), so its size is
what it holds: as Python dicts the same response took about 7x its JSON. It links to the one it
continued instead of copying the conversation; its size counts its whole chain, which
over-counts what chains share, so what a share holds stays within its bound even for a chain
whose earlier turns were evicted (they live on, uncounted on their own, while a later turn needs
them). A chain is at most MAX_TURNS responses and MAX_ITEMS items long. An `item_reference`
finds the items of the owner's responses still stored (their input and output), never another
owner's."""

from __future__ import annotations

import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass

import orjson

MAX_TURNS = 1024  # responses in one previous_response_id chain
MAX_ITEMS = 16384  # items in one chain, every turn's input and output
# what holding a stored response costs beside its JSON: the object, its map entries, and per
# item an entry in the owner's item index (measured with tracemalloc in test_response_store)
RESPONSE_OVERHEAD = 512
ITEM_OVERHEAD = 160


class ChainTooLong(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response_json: bytes  # the response object as it was returned, as compressed JSON
    items_json: bytes  # this request's own input items, each with its id, then the output items
    num_inputs: int
    item_ids: tuple[str, ...]  # of every own item, in order
    previous: StoredResponse | None  # the response this one continued
    size: int  # the bytes this one holds, plus the previous one's size
    turns: int  # responses in the chain, this one included
    items: int  # items in the chain

    @classmethod
    def build(cls, response: dict, input_items: tuple[dict, ...], previous: StoredResponse | None) -> StoredResponse:
        own = (*input_items, *response["output"])
        response_json, items_json = _pack(response), _pack(own)
        ids = tuple(str(item["id"]) for item in own)
        size = len(response_json) + len(items_json) + RESPONSE_OVERHEAD + len(own) * ITEM_OVERHEAD \
            + sum(map(len, ids))
        if previous is None:
            return cls(response_json, items_json, len(input_items), ids, None, size, 1, len(own))
        return cls(response_json, items_json, len(input_items), ids, previous, size + previous.size,
                   previous.turns + 1, previous.items + len(own))

    @property
    def response(self) -> dict:
        return orjson.loads(self.response_bytes)

    @property
    def response_bytes(self) -> bytes:
        """The response object as JSON."""
        return zlib.decompress(self.response_json)

    @property
    def own_items(self) -> list[dict]:
        return orjson.loads(zlib.decompress(self.items_json))

    @property
    def input_items(self) -> list[dict]:
        return self.own_items[:self.num_inputs]

    def conversation(self) -> list[dict]:
        """Every item up to and including this response's output, oldest first."""
        chain = []
        node: StoredResponse | None = self
        while node is not None:
            chain.append(node)
            node = node.previous
        return [item for node in reversed(chain) for item in node.own_items]


def _pack(value) -> bytes:
    # compressed, which also sizes the bytes object to its content (orjson's output keeps the
    # room it grew into: about 6x a 10 KB document)
    return zlib.compress(orjson.dumps(value), 1)


def check_chain(turns: int, items: int) -> None:
    """ChainTooLong when a conversation of `turns` responses and `items` items is over a limit."""
    if turns > MAX_TURNS:
        raise ChainTooLong(f"the conversation would be {turns} responses long; the limit is {MAX_TURNS}: start a "
                           "new one with the input items it needs")
    if items > MAX_ITEMS:
        raise ChainTooLong(f"the conversation would hold {items} items; the limit is {MAX_ITEMS}: start a new "
                           "one with the input items it needs")


class _Share:
    """One owner's responses, least recently used first, and its item index."""

    def __init__(self):
        self.bytes = 0
        self.responses: OrderedDict[str, StoredResponse] = OrderedDict()
        # item id -> the ids of the stored responses that hold it (a client sends output items
        # back as input, ids and all), newest last: item_reference in O(1)
        self.items: dict[str, list[str]] = {}

    def delete(self, response_id: str) -> bool:
        stored = self.responses.pop(response_id, None)
        if stored is None:
            return False
        self.bytes -= stored.size
        for item_id in stored.item_ids:
            holders = self.items.get(item_id)
            if holders is not None and response_id in holders:
                holders.remove(response_id)
                if not holders:
                    del self.items[item_id]
        return True


class ResponseStore:
    def __init__(self, max_responses: int, max_bytes: int):
        """The bounds are each owner's."""
        if max_responses < 0 or max_bytes < 0:
            raise ValueError("the stored responses' bounds must be >= 0")
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._shares: dict[str, _Share] = {}
        # a reply built in a worker thread (a large one) stores itself from there
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return sum(len(s.responses) for s in self._shares.values())

    @property
    def bytes(self) -> int:
        with self._lock:
            return sum(s.bytes for s in self._shares.values())

    def put(self, owner: str, response_id: str, stored: StoredResponse) -> bool:
        """Keep `stored` in `owner`'s share, evicting that share's least recently used; False
        when it alone is over a bound."""
        if self.max_responses == 0 or stored.size > self.max_bytes:
            return False
        with self._lock:
            share = self._shares.setdefault(owner, _Share())
            share.delete(response_id)
            share.responses[response_id] = stored
            share.bytes += stored.size
            for item_id in stored.item_ids:
                holders = share.items.setdefault(item_id, [])
                if response_id not in holders:  # an item may come twice in one response
                    holders.append(response_id)
            while len(share.responses) > self.max_responses or share.bytes > self.max_bytes:
                share.delete(next(iter(share.responses)))
        return True

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        with self._lock:
            share = self._shares.get(owner)
            stored = share.responses.get(response_id) if share else None
            if stored is not None:
                share.responses.move_to_end(response_id)
            return stored

    def delete(self, owner: str, response_id: str) -> bool:
        with self._lock:
            share = self._shares.get(owner)
            if share is None or not share.delete(response_id):
                return False
            if not share.responses:
                del self._shares[owner]
            return True

    def holder(self, owner: str, item_id: str) -> StoredResponse | None:
        """The stored response of `owner`'s, the one stored last, that holds an item (input or
        output) with this id, for an `item_reference`. Its items are read with find_items."""
        with self._lock:
            share = self._shares.get(owner)
            holders = share.items.get(item_id) if share else None
            return share.responses[holders[-1]] if holders else None

    def find_item(self, owner: str, item_id: str) -> dict | None:
        stored = self.holder(owner, item_id)
        return find_items([(stored, item_id)])[0] if stored is not None else None


def find_items(references: list[tuple[StoredResponse, str]]) -> list[dict]:
    """The items named by (holder, item id) pairs; each holder's items read once (one may hold
    megabytes: the caller runs this off the event loop)."""
    read: dict[int, dict[str, dict]] = {}
    out = []
    for stored, item_id in references:
        items = read.get(id(stored))
        if items is None:
            items = read[id(stored)] = {}
            for item in stored.own_items:
                items.setdefault(item["id"], item)  # the first, where an item comes twice
        out.append(items[item_id])
    return out
