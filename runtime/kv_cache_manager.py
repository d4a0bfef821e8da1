"""Block tables per request on top of the BlockPool, with chained-hash prefix caching."""

from __future__ import annotations

import array
import hashlib
import os

from pageserve.runtime.block_pool import BlockPool, KVBlock
from pageserve.runtime.request import Request

# a per-process key: nobody can search offline for token blocks whose digests collide
_DIGEST_KEY = os.urandom(16)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_digest(parent: bytes, token_ids: list[int]) -> bytes:
    """Chained digest of a full block: the parent's digest (or the salt) and the block's tokens."""
    h = hashlib.blake2b(parent, key=_DIGEST_KEY, digest_size=16)
    h.update(array.array("q", token_ids).tobytes())
    return h.digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_hashes: dict[str, list[bytes]] = {}  # chained digests of the request's full blocks
        self.req_num_cached: dict[str, int] = {}  # how many of its blocks are in the cache map
        self.reset_counters()

    def reset_counters(self) -> None:
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found there

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        hashes = self.req_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        tokens = request.token_ids
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            if hashes:
                parent = b"p" + hashes[-1]
            else:  # the first block chains from the salt, so salted requests never share blocks
                parent = b"s" + request.cache_salt.encode() if request.cache_salt else b"-"
            hashes.append(block_digest(parent, tokens[i * bs:(i + 1) * bs]))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of full blocks; at least one token is always left to compute
        so that the step produces logits for the request."""
        if not self.enable_prefix_caching or request.needs_every_position:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        hits: list[KVBlock] = []
        tokens = request.token_ids
        bs = self.block_size
        for i in range(max_blocks):
            block = self.pool.lookup(hashes[i], tuple(tokens[i * bs:(i + 1) * bs]))
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * bs

    def record_prefix_query(self, num_tokens: int, num_hit: int) -> None:
        """Counted once per admitted request, not per look-up attempt."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] = (), keep_free: int = 0) -> bool:
        """Give the request room for `num_new_tokens` more tokens after its computed ones (and
        after `new_computed_blocks`, prefix-cache hits of a request being admitted), leaving at
        least `keep_free` blocks free. Returns False, changing nothing, when the pool is too
        short."""
        rid = request.request_id
        blocks = self.req_blocks.setdefault(rid, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        num_needed = cdiv(total, self.block_size) - len(blocks) - len(new_computed_blocks)
        # hits sitting in the free queue stop being free once we reference them
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_needed + num_evictable_hits + keep_free > self.pool.num_free_blocks:
            if not blocks:
                del self.req_blocks[rid]
            return False
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            self.req_num_cached[rid] = len(blocks)
        if num_needed > 0:
            blocks.extend(self.pool.get_new_blocks(num_needed))
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Make the request's full, computed blocks findable by the prefix cache. Called once
        the step that wrote their KV has finished, never at allocation: a step that fails (or
        a swap-in that never lands) must leave no block findable whose KV was not written."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        start = self.req_num_cached.get(rid, 0)
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        blocks = self.req_blocks[rid]
        bs = self.block_size
        tokens = request.token_ids
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i], tuple(tokens[i * bs:(i + 1) * bs]))
        self.req_num_cached[rid] = num_full

    def fork(self, parent: Request, child: Request) -> tuple[int, int] | None:
        """Give `child` the parent's blocks by reference. The partly filled last block is the
        one both will write into, so the child gets its own copy of it: returns the (source,
        destination) block pair to copy, or None when there is no partial block. When no block
        is free for the copy, the child shares the full blocks only and recomputes the rest
        (its num_computed_tokens is lowered to match)."""
        blocks = self.req_blocks[parent.request_id]
        num_full = parent.num_computed_tokens // self.block_size
        shared = blocks[:num_full]
        self.pool.touch(shared)
        mine = self.req_blocks[child.request_id] = list(shared)
        self.req_hashes[child.request_id] = list(self.req_hashes.get(parent.request_id, [])[:num_full])
        self.req_num_cached[child.request_id] = min(self.req_num_cached.get(parent.request_id, 0), num_full)
        if parent.num_computed_tokens % self.block_size == 0:
            return None
        if self.pool.num_free_blocks == 0:
            child.num_computed_tokens = num_full * self.block_size
            return None
        copy = self.pool.get_new_blocks(1)[0]
        mine.append(copy)
        return blocks[num_full].block_id, copy.block_id

    def free(self, request: Request) -> None:
        rid = request.request_id
        blocks = self.req_blocks.pop(rid, [])
        # tail blocks first: they are the least likely to be shared, so the first evicted
        self.pool.free_blocks(reversed(blocks))
        self.req_num_cached.pop(rid, None)
        self.req_hashes.pop(rid, None)

    def num_allocated_slots(self) -> int:
        return sum(len(b) for b in self.req_blocks.values()) * self.block_size

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        held: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            for b in blocks:
                held[b.block_id] = held.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == held.get(block.block_id, 0), (
                f"{block} is held by {held.get(block.block_id, 0)} requests")
