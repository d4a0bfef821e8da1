"""Bookkeeping of the CPU swap space: which swap blocks hold which preempted request.
The bytes themselves live in the model runner; the scheduler only moves block ids."""

from __future__ import annotations


class SwapSpace:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.req_blocks: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_hold(self, n: int) -> bool:
        return 0 < n <= len(self._free)

    def allocate(self, request_id: str, n: int) -> list[int]:
        assert request_id not in self.req_blocks, f"{request_id} is already swapped out"
        ids = [self._free.pop() for _ in range(n)]
        self.req_blocks[request_id] = ids
        return ids

    def free(self, request_id: str) -> list[int]:
        ids = self.req_blocks.pop(request_id, [])
        self._free.extend(reversed(ids))
        return ids

    def check_integrity(self) -> None:
        held = [b for ids in self.req_blocks.values() for b in ids]
        assert len(held) == len(set(held)), "a swap block is held twice"
        assert not set(held) & set(self._free), "a held swap block is also free"
        assert len(held) + len(self._free) == self.num_blocks
