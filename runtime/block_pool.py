"""All KV blocks, made up front: reference counts, an LRU free queue, and the prefix-cache map."""

from __future__ import annotations


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prev", "next")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None  # chained digest, set once the block is full and cached
        self.token_ids: tuple[int, ...] | None = None  # what the hash stands for, to confirm hits
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


# Stands in a block table for a block that was given back because no layer's window reaches
# it any more; the attention never reads it (id 0, as the padding of block tables)
NULL_BLOCK = KVBlock(0)


class FreeBlockQueue:
    """Doubly linked list of free blocks in eviction order, with O(1) removal from the middle."""

    def __init__(self, blocks: list[KVBlock]):
        self.head = KVBlock(-1)  # sentinels
        self.tail = KVBlock(-1)
        self.head.next, self.tail.prev = self.tail, self.head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self.tail.prev
        last.next, block.prev = block, last
        block.next, self.tail.prev = self.tail, block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        block = self.head.next
        assert block is not self.tail, "no free block"
        self.remove(block)
        return block

    def __iter__(self):
        block = self.head.next
        while block is not self.tail:
            yield block
            block = block.next


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.hash_to_block: dict[bytes, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (never-used and cached-but-unreferenced)."""
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > self.free_queue.num_free:
            raise ValueError(f"asked for {n} blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        # lazy eviction: a freed block keeps its hash until it is handed out again
        if block.block_hash is not None:
            if self.hash_to_block.get(block.block_hash) is block:
                del self.hash_to_block[block.block_hash]
            block.block_hash = None
            block.token_ids = None

    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...]) -> KVBlock | None:
        block = self.hash_to_block.get(block_hash)
        if block is not None and block.token_ids == token_ids:
            return block
        return None

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on prefix-cache hits; a free cached block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_block(self, block: KVBlock, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        if block_hash in self.hash_to_block:
            return  # the same content is cached in another block already
        block.block_hash = block_hash
        block.token_ids = token_ids
        self.hash_to_block[block_hash] = block

    def free_blocks(self, blocks) -> None:
        """Drop one reference on each block; the caller orders them so that the first freed
        is the first evicted."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_cnt == 0:
                self._evict(block)

    def counts(self) -> tuple[int, int, int]:
        """(free, cached, in use): cached = unreferenced but still holding a prefix-cache hash."""
        in_use = sum(1 for b in self.blocks if b.ref_cnt > 0)
        cached = sum(1 for b in self.blocks if b.ref_cnt == 0 and b.block_hash is not None)
        return self.num_blocks - in_use - cached, cached, in_use

    def check_integrity(self) -> None:
        free, cached, in_use = self.counts()
        assert free + cached + in_use == self.num_blocks
        queued = list(self.free_queue)
        assert len(queued) == self.free_queue.num_free == free + cached, (
            len(queued), self.free_queue.num_free, free, cached)
        assert len({b.block_id for b in queued}) == len(queued), "a block is queued twice"
        assert all(b.ref_cnt == 0 for b in queued), "a referenced block is in the free queue"
        for h, block in self.hash_to_block.items():
            assert block.block_hash == h, f"hash map points at {block} for {h}"
        assert all(b.ref_cnt >= 0 for b in self.blocks)
