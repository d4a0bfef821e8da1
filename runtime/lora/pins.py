"""Which adapters the engine's live requests run under, so that each is held in host memory
(pinned: --max-cpu-loras never lets it go) from before the first step that runs it until its
last request ends. A step then never reads an adapter from disk: an adapter whose files went
away after it left host memory fails only the new requests that name it, before their step."""

from __future__ import annotations

import threading
from collections import Counter

from pageserve.runtime.executor import ExecutorDeadError


class AdapterPins:
    def __init__(self):
        self._users: Counter[int] = Counter()  # live requests per adapter id
        self._pinned: set[int] = set()
        self._new: list = []  # requests added under an adapter not pinned yet
        # requests come and go on the event loop's thread; removals run on the engine's, between steps
        self._lock = threading.Lock()

    def add(self, req, members: int = 1) -> None:
        """A request (or `members` forked sequences of one) under req.lora is live."""
        lora_id = req.lora.lora_int_id
        with self._lock:
            self._users[lora_id] += members
            if lora_id not in self._pinned:
                self._new.append(req)

    def finish(self, req) -> None:
        lora_id = req.lora.lora_int_id
        with self._lock:
            self._users[lora_id] -= 1
            if not self._users[lora_id]:
                del self._users[lora_id]

    @property
    def pending(self) -> bool:
        return bool(self._new) or self.idle

    @property
    def idle(self) -> bool:
        """Whether an adapter is pinned that no live request runs under."""
        return any(i not in self._users for i in self._pinned)

    def sync(self, executor) -> list[tuple[str, Exception]]:
        """Between steps: pin the adapters of the requests added since the last call, unpin
        those no live request runs under. Returns (output id, error) for each new request
        whose adapter could not be read (every rank's part)."""
        failed, errors = [], {}
        with self._lock:
            new, self._new = self._new, []
        for req in new:
            lora_id = req.lora.lora_int_id
            if req.status.finished or lora_id in self._pinned:
                continue
            if lora_id not in errors:
                try:
                    executor.add_lora(req.lora, pin=True)
                    with self._lock:
                        self._pinned.add(lora_id)
                    continue
                except ExecutorDeadError:
                    raise
                except Exception as e:  # noqa: BLE001 - most often a LoRAError: it fails these requests, not the step
                    errors[lora_id] = e
            failed.append((req.output_id, errors[lora_id]))
        self.release_idle(executor)
        return failed

    def release_idle(self, executor) -> None:
        """Unpin the adapters no live request runs under (at the end of the step that finished
        their last request, or before an adapter is removed)."""
        with self._lock:  # no longer pinned here first: a request that comes meanwhile pins it again
            idle = [i for i in self._pinned if i not in self._users]
            self._pinned.difference_update(idle)
        for lora_id in idle:
            executor.unpin_lora(lora_id)

    def check_integrity(self, requests) -> None:
        """The counts are those of the live requests given."""
        live = Counter(r.lora.lora_int_id for r in requests if r.lora is not None)
        with self._lock:
            assert live == self._users, f"adapter users {dict(self._users)}, live requests {dict(live)}"
