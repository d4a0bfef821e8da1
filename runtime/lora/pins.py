"""Which adapters the engine's live requests run under, so that each is held in host memory
(pinned: --max-cpu-loras never lets it go) from before the first step that runs it until its
last request ends. A step then never reads an adapter from disk: an adapter whose files went
away after it left host memory fails only the new requests that name it, before their step."""

from __future__ import annotations

from collections import Counter

from pageserve.runtime.executor import ExecutorDeadError


class AdapterPins:
    def __init__(self):
        self._users: Counter[int] = Counter()  # live requests per adapter id
        self._pinned: set[int] = set()
        self._new: list = []  # requests added under an adapter not pinned yet

    def add(self, req, members: int = 1) -> None:
        """A request (or `members` forked sequences of one) under req.lora is live."""
        lora_id = req.lora.lora_int_id
        self._users[lora_id] += members
        if lora_id not in self._pinned:
            self._new.append(req)

    def finish(self, req) -> None:
        lora_id = req.lora.lora_int_id
        self._users[lora_id] -= 1
        if not self._users[lora_id]:
            del self._users[lora_id]

    @property
    def pending(self) -> bool:
        return bool(self._new) or len(self._pinned) > len(self._users)

    def sync(self, executor) -> list[tuple[str, Exception]]:
        """Between steps: pin the adapters of the requests added since the last call, unpin
        those no live request runs under. Returns (output id, error) for each new request
        whose adapter could not be read (every rank's part)."""
        failed, errors = [], {}
        for req in self._new:
            lora_id = req.lora.lora_int_id
            if req.status.finished or lora_id in self._pinned:
                continue
            if lora_id not in errors:
                try:
                    executor.add_lora(req.lora, pin=True)
                    self._pinned.add(lora_id)
                    continue
                except ExecutorDeadError:
                    raise
                except Exception as e:  # noqa: BLE001 - most often a LoRAError: it fails these requests, not the step
                    errors[lora_id] = e
            failed.append((req.output_id, errors[lora_id]))
        self._new.clear()
        for lora_id in [i for i in self._pinned if i not in self._users]:
            executor.unpin_lora(lora_id)
            self._pinned.discard(lora_id)
        return failed
