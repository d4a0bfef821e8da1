"""Block tables per request on top of the BlockPool, with chained-hash prefix caching. Where
every layer attends within a sliding window, a request's blocks wholly before the window of
its next token go back to the pool and leave NULL_BLOCK in their place (as vLLM's
sliding-window manager does), so its live KV is bounded by the window, not by its length."""

from __future__ import annotations

import array
import hashlib
import os

from pageserve.runtime.block_pool import NULL_BLOCK, BlockPool, KVBlock
from pageserve.runtime.request import Request

# a per-process key: nobody can search offline for token blocks whose digests collide
_DIGEST_KEY = os.urandom(16)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_digest(parent: bytes, token_ids: list[int], images: bytes = b"") -> bytes:
    """Chained digest of a full block: the parent's digest (or the salt), the block's tokens,
    and the digests of the images whose tokens the block holds (their tokens are all alike)."""
    h = hashlib.blake2b(parent, key=_DIGEST_KEY, digest_size=16)
    h.update(array.array("q", token_ids).tobytes())
    h.update(images)
    return h.digest()


def image_keys(items, lo: int, hi: int) -> bytes:
    """The digest and offset of each image with tokens in positions [lo, hi)."""
    return b"".join(i.digest + i.offset.to_bytes(8, "little") for i in items if i.offset < hi and i.end > lo)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int = 0):
        self.block_size = block_size
        self.sliding_window = sliding_window  # every layer's (0: some layer sees everything)
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_block_ids: dict[str, list[int]] = {}  # the same as ids, kept as they change: read every step
        # per request: how many of its block ids the runners' tables hold (see block_update)
        self._ids_sent: dict[str, int] = {}
        self.req_hashes: dict[str, list[bytes]] = {}  # chained digests of the request's full blocks
        self.req_num_cached: dict[str, int] = {}  # how many of its blocks are in the cache map
        self.reset_counters()

    def reset_counters(self) -> None:
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found there

    @property
    def usage(self) -> float:
        return self.pool.usage

    def unused_fraction(self, requests) -> float | None:
        """Of the allocated slots, the fraction not holding a computed token of `requests` (the
        running ones); None when no block is allocated."""
        slots = (self.pool.num_blocks - self.pool.num_free_blocks) * self.block_size
        if not slots:
            return None
        if self.sliding_window:  # a request holds only its blocks since the window's start
            held = sum(r.num_computed_tokens - self.num_skipped_blocks(r.num_computed_tokens) * self.block_size
                       for r in requests)
        else:
            held = sum(r.num_computed_tokens for r in requests)
        return max(0.0, 1.0 - held / slots)

    def block_ids(self, request_id: str) -> list[int]:
        return list(self.req_block_ids.get(request_id, ()))

    def block_update(self, request_id: str) -> tuple[int, list[int]]:
        """What a step tells the runners of the request's block table: (the index from which
        it changed, its ids from there on). The whole table for a request the runners have not
        been sent (new, or its blocks given back since) or whose table was rewritten; else only
        the blocks appended since the last update. Each runner applies them in step order
        (step_inputs.BlockTables)."""
        ids = self.req_block_ids.get(request_id, [])
        start = self._ids_sent.get(request_id, 0)
        self._ids_sent[request_id] = len(ids)
        return start, ids[start:]

    def _sync_ids(self, rid: str, rewrite: bool) -> None:
        """req_block_ids after req_blocks changed: appended to (or, rewrite, changed anywhere)."""
        blocks = self.req_blocks.get(rid)
        if blocks is None:
            self.req_block_ids.pop(rid, None)
            self._ids_sent.pop(rid, None)
            return
        ids = self.req_block_ids.setdefault(rid, [])
        if rewrite:
            self._ids_sent.pop(rid, None)
            ids[:] = [b.block_id for b in blocks]
        else:
            ids.extend([b.block_id for b in blocks[len(ids):]])

    def num_skipped_blocks(self, num_computed: int) -> int:
        """Leading blocks that no query from position `num_computed` on reads: they end before
        its window (a query at p sees p - window + 1 .. p), in every layer."""
        if not self.sliding_window:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def _remove_skipped(self, blocks: list[KVBlock], num_skipped: int) -> None:
        """Give the first `num_skipped` blocks back to the pool (still findable by the prefix
        cache until reused), NULL_BLOCK in their place. Placeholders are always a prefix, so
        the walk back stops at the first one; the latest block is freed first, evicted first."""
        freed = []
        for i in range(min(num_skipped, len(blocks)) - 1, -1, -1):
            if blocks[i] is NULL_BLOCK:
                break
            freed.append(blocks[i])
            blocks[i] = NULL_BLOCK
        self.pool.free_blocks(freed)

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
                if request.lora is not None:  # nor requests of different adapters (or none)
                    key = request.lora.cache_key
                    parent = b"l%d:" % len(key) + key + parent
            images = image_keys(request.mm_items, i * bs, (i + 1) * bs) if request.mm_items else b""
            hashes.append(block_digest(parent, tokens[i * bs:(i + 1) * bs], images))
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
        least `keep_free` blocks free. Under a sliding window, blocks before the window of the
        first new token are given back first (hits there are not taken, and a request coming
        back from the swap space gets placeholders there). Returns False when the pool is too
        short, changing nothing but that giving back."""
        rid = request.request_id
        held = self.req_blocks.get(rid)
        if held is not None and not new_computed_blocks and not self.sliding_window:
            # a running request (a decode, most steps): at most new blocks at the end
            num_needed = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size) - len(held)
            if num_needed <= 0:
                return num_needed + keep_free <= self.pool.num_free_blocks
        blocks = self.req_blocks.setdefault(rid, [])
        hits = list(new_computed_blocks)
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        skip = self.num_skipped_blocks(num_computed)
        self._remove_skipped(blocks, skip)
        total = num_computed + num_new_tokens
        num_dropped_hits = min(max(0, skip - len(blocks)), len(hits))
        kept_hits = hits[num_dropped_hits:]
        num_needed = cdiv(total, self.block_size) - max(len(blocks) + len(hits), skip)
        # hits sitting in the free queue stop being free once we reference them
        num_evictable_hits = sum(1 for b in kept_hits if b.ref_cnt == 0)
        if num_needed + num_evictable_hits + keep_free > self.pool.num_free_blocks:
            if not blocks:
                del self.req_blocks[rid]
            self._sync_ids(rid, rewrite=skip > 0)
            return False
        if hits:
            self.pool.touch(kept_hits)
            blocks.extend([NULL_BLOCK] * num_dropped_hits + kept_hits)
            self.req_num_cached[rid] = len(blocks)
        blocks.extend([NULL_BLOCK] * (skip - len(blocks)))
        if num_needed > 0:
            blocks.extend(self.pool.get_new_blocks(num_needed))
        self._sync_ids(rid, rewrite=skip > 0)
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Make the request's full, computed blocks findable by the prefix cache. Called once
        the step that wrote their KV has finished, never at allocation: a step that fails (or
        a swap-in that never lands) must leave no block findable whose KV was not written."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        start = self.req_num_cached.get(rid, 0)
        # accepted speculative tokens are computed before they are appended: cached a step later
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        blocks = self.req_blocks[rid]
        bs = self.block_size
        tokens = request.token_ids
        for i in range(start, num_full):
            if blocks[i] is not NULL_BLOCK:
                self.pool.cache_block(blocks[i], hashes[i], tuple(tokens[i * bs:(i + 1) * bs]))
        self.req_num_cached[rid] = num_full

    def fork(self, parent: Request, child: Request) -> tuple[int, int] | None:
        """Give `child` the parent's blocks by reference. The partly filled last block is the
        one both will write into, so the child gets its own copy of it: returns the (source,
        destination) block pair to copy, or None when there is no partial block. When no block
        is free for the copy, the child shares the full blocks only and recomputes the rest
        (its num_computed_tokens is lowered to match), or nothing where the window of the
        first token it recomputes would reach blocks the parent has already let go."""
        blocks = self.req_blocks[parent.request_id]
        num_full = parent.num_computed_tokens // self.block_size
        no_copy = parent.num_computed_tokens % self.block_size != 0 and self.pool.num_free_blocks == 0
        if no_copy and sum(b is NULL_BLOCK for b in blocks[:num_full]) > self.num_skipped_blocks(
                num_full * self.block_size):
            num_full = 0
        shared = blocks[:num_full]  # the placeholders before the window included
        self.pool.touch([b for b in shared if b is not NULL_BLOCK])
        mine = self.req_blocks[child.request_id] = list(shared)
        self._sync_ids(child.request_id, rewrite=True)
        self.req_hashes[child.request_id] = list(self.req_hashes.get(parent.request_id, [])[:num_full])
        self.req_num_cached[child.request_id] = min(self.req_num_cached.get(parent.request_id, 0), num_full)
        if no_copy:
            child.num_computed_tokens = num_full * self.block_size
            return None
        if parent.num_computed_tokens % self.block_size == 0:
            return None
        copy = self.pool.get_new_blocks(1)[0]
        mine.append(copy)
        self._sync_ids(child.request_id, rewrite=False)
        return blocks[num_full].block_id, copy.block_id

    def free(self, request: Request) -> None:
        rid = request.request_id
        blocks = self.req_blocks.pop(rid, [])
        self.req_block_ids.pop(rid, None)
        self._ids_sent.pop(rid, None)
        # tail blocks first: they are the least likely to be shared, so the first evicted
        self.pool.free_blocks(b for b in reversed(blocks) if b is not NULL_BLOCK)
        self.req_num_cached.pop(rid, None)
        self.req_hashes.pop(rid, None)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        held: dict[int, int] = {}
        assert self.req_block_ids.keys() == self.req_blocks.keys()
        assert all(n <= len(self.req_block_ids[rid]) for rid, n in self._ids_sent.items())
        for rid, blocks in self.req_blocks.items():
            assert self.req_block_ids[rid] == [b.block_id for b in blocks], rid
            live = [b for b in blocks if b is not NULL_BLOCK]
            assert blocks[:len(blocks) - len(live)] == [NULL_BLOCK] * (len(blocks) - len(live)), (
                f"{rid}: a placeholder after a live block")
            for b in live:
                held[b.block_id] = held.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == held.get(block.block_id, 0), (
                f"{block} is held by {held.get(block.block_id, 0)} requests")
