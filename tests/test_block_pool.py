import pytest

from pageserve.runtime.block_pool import BlockPool
from pageserve.runtime.kv_cache_manager import KVCacheManager
from pageserve.runtime.request import Request
from pageserve.sampling.params import SamplingParams

pytestmark = pytest.mark.unit


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), 8, (0,))


def test_free_queue_order_and_middle_removal():
    pool = BlockPool(6)
    blocks = pool.get_new_blocks(4)
    assert [b.block_id for b in blocks] == [0, 1, 2, 3]
    pool.free_blocks(reversed(blocks))  # the last block of a request is evicted first
    assert [b.block_id for b in pool.free_queue] == [4, 5, 3, 2, 1, 0]
    pool.touch([blocks[1]])  # a prefix hit takes a free block out of the middle
    assert [b.block_id for b in pool.free_queue] == [4, 5, 3, 2, 0]
    assert pool.num_free_blocks == 5
    pool.check_integrity()
    pool.free_blocks([blocks[1]])
    pool.check_integrity()
    with pytest.raises(AssertionError):
        pool.free_blocks([blocks[1]])


def test_lazy_eviction_keeps_hash_until_reuse():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, b"h1", (1, 2))
    pool.free_blocks([b])
    assert pool.counts() == (1, 1, 0)  # free, cached, in use
    assert pool.lookup(b"h1", (1, 2)) is b
    assert pool.lookup(b"h1", (9, 9)) is None  # a hash hit is confirmed by the tokens
    pool.get_new_blocks(2)  # reuse evicts it
    assert pool.lookup(b"h1", (1, 2)) is None
    assert pool.counts() == (0, 0, 2)
    pool.check_integrity()


def test_allocation_fails_without_side_effects():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a = make_request("a", list(range(10)))
    assert kv.allocate_slots(a, 10)  # 3 blocks
    b = make_request("b", list(range(8)))
    assert not kv.allocate_slots(b, 8)  # needs 2, 1 free
    assert kv.pool.num_free_blocks == 1 and "b" not in kv.req_blocks
    kv.check_integrity()
    kv.free(a)
    assert kv.pool.num_free_blocks == 4
    kv.check_integrity()


def test_prefix_hit_shares_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prefix = list(range(100, 112))  # three full blocks
    a = make_request("a", prefix + [1, 2])
    assert kv.get_computed_blocks(a) == ([], 0)
    assert kv.allocate_slots(a, a.num_tokens)
    b = make_request("b", prefix + [7])
    # allocated is not written: nothing is findable until the step that computes it is done
    assert kv.get_computed_blocks(b) == ([], 0)
    a.num_computed_tokens = a.num_tokens
    kv.cache_computed_blocks(a)
    hits, n = kv.get_computed_blocks(b)
    assert n == 12 and [h.block_id for h in hits] == kv.block_ids("a")[:3]
    assert kv.allocate_slots(b, 1, hits)
    assert kv.block_ids("b")[:3] == kv.block_ids("a")[:3]
    kv.check_integrity()
    kv.free(a)
    kv.free(b)
    free, cached, in_use = kv.pool.counts()
    assert in_use == 0 and cached == 3
    kv.check_integrity()
