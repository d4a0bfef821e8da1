"""The Responses API's in-memory store: each owner's share least recently used out, bounded by
count and by the bytes it really holds, conversations linked rather than copied, item
references found through an owner's own index, chains bounded."""

from __future__ import annotations

import gc
import os
import tracemalloc

import pytest

from pageserve.app.response_store import MAX_TURNS, ChainTooLong, ResponseStore, StoredResponse, check_chain

pytestmark = pytest.mark.unit

A, B = "owner-a", "owner-b"


def _response(rid: str, *texts: str) -> dict:
    return {"id": rid, "output": [{"id": f"out-{rid}-{i}", "type": "message", "text": t} for i, t in enumerate(texts)]}


def _put(store: ResponseStore, rid: str, previous: StoredResponse | None = None, text: str = "x",
         inputs: tuple[dict, ...] | None = None, owner: str = A) -> StoredResponse:
    stored = StoredResponse.build(_response(rid, text), inputs if inputs is not None else ({"id": f"in-{rid}"},),
                                  previous)
    store.put(owner, rid, stored)
    return stored


def test_least_recently_used_goes_first():
    store = ResponseStore(2, 1 << 20)
    _put(store, "a"), _put(store, "b")
    assert store.get(A, "a") is not None  # a is now the most recent
    _put(store, "c")
    assert store.get(A, "b") is None and store.get(A, "a") is not None and len(store) == 2
    assert store.find_item(A, "in-c") == {"id": "in-c"} and store.find_item(A, "in-b") is None
    assert store.find_item(A, "out-b-0") is None and store.find_item(A, "out-a-0")["text"] == "x"
    none = ResponseStore(0, 1 << 20)
    _put(none, "x")
    assert len(none) == 0 and none.find_item(A, "in-x") is None


def _noise(n: int) -> str:  # text that does not compress
    return os.urandom(n // 2).hex()


def test_bytes_bound_the_store_and_an_oversized_response_is_not_kept():
    one = StoredResponse.build(_response("probe", _noise(1000)), ({"id": "in-probe"},), None)
    store = ResponseStore(1000, 3 * one.size + one.size // 2)
    for rid in "abcde":
        _put(store, rid, text=_noise(1000))
        assert store.bytes <= store.max_bytes
    assert len(store) == 3 and store.get(A, "b") is None and store.get(A, "e") is not None
    assert not store.put(A, "big", StoredResponse.build(_response("big", _noise(10 * one.size)), (), None))
    assert store.get(A, "big") is None and len(store) == 3
    for rid in "cde":
        assert store.delete(A, rid)
    assert store.bytes == 0 and len(store) == 0 and not store._shares


def test_the_counted_bytes_cover_what_the_store_really_holds():
    """tracemalloc's count of every allocation the stored responses keep, against their sizes:
    many small items (where per-object costs dominate) and a few long texts."""
    for n_items, text in ((40, "short answer"), (2, "a long answer " * 400)):
        responses = []
        for i in range(200):
            inputs = tuple({"id": f"msg_{i}_{j}_{'f' * 24}", "type": "message", "role": "user",
                            "content": [{"type": "input_text", "text": f"{text} {j}"}]} for j in range(n_items))
            responses.append((_response(f"resp_{i:032x}", text, text), inputs))
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        store = ResponseStore(10_000, 1 << 30)
        previous = None
        for i, (resp, inputs) in enumerate(responses):
            previous = StoredResponse.build(resp, inputs, previous if i % 10 else None)
            store.put(A, resp["id"], previous)
        del previous
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        own = sum(s.size - (s.previous.size if s.previous else 0) for s in store._shares[A].responses.values())
        assert held <= own, f"{n_items} items a response: {held} bytes held, {own} counted"
        assert held > own / 3, f"the count is far above what is held: {held} held, {own} counted"


def test_a_chain_links_turns_and_counts_each_with_what_it_continues():
    store = ResponseStore(100, 1 << 20)
    first = _put(store, "t1", text="one")
    second = _put(store, "t2", previous=first, text="two")
    third = _put(store, "t3", previous=second, text="three")
    ids = [item["id"] for item in third.conversation()]
    assert ids == ["in-t1", "out-t1-0", "in-t2", "out-t2-0", "in-t3", "out-t3-0"]
    assert third.size > second.size > first.size and (third.turns, third.items) == (3, 6)
    store.delete(A, "t1"), store.delete(A, "t2")  # earlier turns evicted: the latest still continues
    assert [item["id"] for item in store.get(A, "t3").conversation()] == ids
    assert store.bytes == third.size


def test_a_chain_is_bounded():
    check_chain(MAX_TURNS, 10)
    with pytest.raises(ChainTooLong, match=f"limit is {MAX_TURNS}"):
        check_chain(MAX_TURNS + 1, 10)
    with pytest.raises(ChainTooLong, match="items"):
        check_chain(2, 10**6)


def test_an_item_sent_back_as_input_stays_findable_while_any_holder_is_stored():
    store = ResponseStore(100, 1 << 20)
    first = _put(store, "a", text="answer")
    echoed = first.response["output"][0]  # the client sends the output item back, id and all
    _put(store, "b", previous=None, inputs=(echoed, {"id": "in-b"}))
    store.delete(A, "a")
    assert store.find_item(A, echoed["id"]) == echoed
    store.delete(A, "b")
    assert store.find_item(A, echoed["id"]) is None and not store._shares


def test_putting_the_same_id_again_replaces_it():
    store = ResponseStore(100, 1 << 20)
    _put(store, "a", text="old")
    _put(store, "a", text="new")
    assert len(store) == 1 and store.get(A, "a").response["output"][0]["text"] == "new"
    assert store.bytes == store.get(A, "a").size


def test_owners_see_only_their_own():
    store = ResponseStore(100, 1 << 20)
    _put(store, "a", text="secret", inputs=({"id": "shared-id", "text": "A's"},))
    _put(store, "b", inputs=({"id": "shared-id", "text": "B's plant"},), owner=B)
    assert store.get(B, "a") is None and not store.delete(B, "a") and store.get(A, "a") is not None
    assert store.find_item(B, "out-a-0") is None
    # the same client-chosen id in both: each owner resolves only its own, whoever stored last
    assert store.find_item(A, "shared-id")["text"] == "A's"
    assert store.find_item(B, "shared-id")["text"] == "B's plant"


def test_one_owner_cannot_push_out_another():
    store = ResponseStore(3, 1 << 20)
    _put(store, "a1"), _put(store, "a2")
    for i in range(50):  # B's burst evicts only B's own
        _put(store, f"b{i}", owner=B)
    assert store.get(A, "a1") is not None and store.get(A, "a2") is not None
    assert [store.get(B, f"b{i}") is not None for i in (46, 47, 48, 49)] == [False, True, True, True]
