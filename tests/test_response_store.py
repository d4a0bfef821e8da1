"""The Responses API's in-memory store: least recently used out, bounded by count and bytes,
conversations linked rather than copied, item references found through an index."""

from __future__ import annotations

import pytest

from pageserve.app.response_store import ResponseStore, StoredResponse

pytestmark = pytest.mark.unit


def _response(rid: str, *texts: str) -> dict:
    return {"id": rid, "output": [{"id": f"out-{rid}-{i}", "type": "message", "text": t} for i, t in enumerate(texts)]}


def _put(store: ResponseStore, rid: str, previous: StoredResponse | None = None, text: str = "x",
         inputs: tuple[dict, ...] | None = None) -> StoredResponse:
    stored = StoredResponse.build(_response(rid, text), inputs if inputs is not None else ({"id": f"in-{rid}"},),
                                  previous)
    store.put(stored)
    return stored


def test_least_recently_used_goes_first():
    store = ResponseStore(2, 1 << 20)
    _put(store, "a"), _put(store, "b")
    assert store.get("a") is not None  # a is now the most recent
    _put(store, "c")
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    assert store.find_item("in-c") == {"id": "in-c"} and store.find_item("in-b") is None
    assert store.find_item("out-b-0") is None and store.find_item("out-a-0")["text"] == "x"
    none = ResponseStore(0, 1 << 20)
    _put(none, "x")
    assert len(none) == 0 and none.find_item("in-x") is None


def test_bytes_bound_the_store_and_an_oversized_response_is_not_kept():
    one = StoredResponse.build(_response("probe", "y" * 1000), ({"id": "in-probe"},), None)
    store = ResponseStore(1000, 3 * one.size + one.size // 2)
    for rid in "abcde":
        _put(store, rid, text="y" * 1000)
        assert store.bytes <= store.max_bytes
    assert len(store) == 3 and store.get("b") is None and store.get("e") is not None
    assert not store.put(StoredResponse.build(_response("big", "z" * 10 * one.size), (), None))
    assert store.get("big") is None and len(store) == 3
    for rid in "cde":
        assert store.delete(rid)
    assert store.bytes == 0 and len(store) == 0 and not store._items


def test_a_chain_links_turns_and_counts_each_with_what_it_continues():
    store = ResponseStore(100, 1 << 20)
    first = _put(store, "t1", text="one")
    second = _put(store, "t2", previous=first, text="two")
    third = _put(store, "t3", previous=second, text="three")
    ids = [item["id"] for item in third.conversation()]
    assert ids == ["in-t1", "out-t1-0", "in-t2", "out-t2-0", "in-t3", "out-t3-0"]
    assert third.size > second.size > first.size
    store.delete("t1"), store.delete("t2")  # earlier turns evicted: the latest still continues
    assert [item["id"] for item in store.get("t3").conversation()] == ids
    assert store.bytes == third.size


def test_an_item_sent_back_as_input_stays_findable_while_any_holder_is_stored():
    store = ResponseStore(100, 1 << 20)
    first = _put(store, "a", text="answer")
    echoed = first.response["output"][0]  # the client sends the output item back, id and all
    _put(store, "b", previous=None, inputs=(echoed, {"id": "in-b"}))
    store.delete("a")
    assert store.find_item(echoed["id"]) == echoed
    store.delete("b")
    assert store.find_item(echoed["id"]) is None and not store._items


def test_putting_the_same_id_again_replaces_it():
    store = ResponseStore(100, 1 << 20)
    _put(store, "a", text="old")
    _put(store, "a", text="new")
    assert len(store) == 1 and store.get("a").response["output"][0]["text"] == "new"
    assert store.bytes == store.get("a").size
