"""Adapters in host memory and in device slots, per model runner. `load` reads an adapter into
host memory (up to --max-cpu-loras, least recently used out, never one pinned because a live
request runs under it: see pins.py); `batch` puts the step's adapters
in slots (at most --max-loras, which the scheduler keeps a step within; a slot no request of
the step uses is rewritten, least recently used first) and maps each token to its slot. A slot
is written between steps, so an adapter's arrival costs its own copy and never a stall of the
others' steps beyond it."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import torch
from torch import nn

from pageserve.runtime.config import LoRAConfig, ModelConfig
from pageserve.runtime.kernels import LoRABatch
from pageserve.runtime.lora.adapter import LoRAAdapter, LoRAError, load_adapter, lora_targets
from pageserve.runtime.lora.request import LoRARequest
from pageserve.runtime.lora.slots import LoRASlots
from pageserve.runtime.models import parallel

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, model_cfg: ModelConfig, device: torch.device):
        self.config, self.device = config, device
        self._shard = None if model_cfg.tp_size == 1 else lambda name, t: parallel.shard(name, t, model_cfg)
        dtype = model_cfg.dtype
        self.targets = lora_targets(model)
        self.slots = LoRASlots(model, self.targets, config.max_loras, config.max_lora_rank, device, dtype)
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # by lora_int_id, least recent first
        self._slot_ids: list[int | None] = [None] * config.max_loras  # the adapter id in each slot
        self._slot_used = [0.0] * config.max_loras  # when each slot last served a step
        self._pinned: set[int] = set()  # adapter ids kept in host memory whatever --max-cpu-loras says
        self._removed: set[int] = set()  # pinned adapters removed meanwhile: they go when unpinned
        self._lock = threading.RLock()  # load() runs in the server's threads, batch() in the step's
        logger.info("LoRA: %d slots of rank %d, %.1f MiB of adapter weights beside the model", config.max_loras,
                    config.max_lora_rank, self.slots.nbytes / 2 ** 20)

    def load(self, lora: LoRARequest, pin: bool = False) -> LoRAAdapter:
        """The adapter read into host memory (LoRAError if it cannot be served), or found there;
        with `pin`, held there until `unpin`."""
        lora_id = lora.lora_int_id
        with self._lock:
            adapter = self._host.get(lora_id)
            if adapter is not None:
                self._host.move_to_end(lora_id)
                self._hold(lora_id, pin)
                return adapter
        started = time.perf_counter()
        adapter = load_adapter(lora.lora_name, lora.lora_path, self.targets, self.config.max_lora_rank, self._shard)
        with self._lock:
            self._host[lora_id] = adapter
            self._host.move_to_end(lora_id)
            self._hold(lora_id, pin)
            self._trim()
        logger.info("LoRA adapter %s (rank %d, %.1f MiB) read from %s in %.3f s", lora.lora_name, adapter.rank,
                    adapter.nbytes / 2 ** 20, lora.lora_path, time.perf_counter() - started)
        return adapter

    @property
    def in_host(self) -> list[int]:
        """The ids of the adapters in host memory, least recently used first."""
        with self._lock:
            return list(self._host)

    def _hold(self, lora_id: int, pin: bool) -> None:
        self._removed.discard(lora_id)  # loaded again: served again
        if pin:
            self._pinned.add(lora_id)

    def _trim(self) -> None:
        """Least recently used first, out of host memory down to --max-cpu-loras, pins kept."""
        excess = len(self._host) - self.config.max_cpu_loras
        for lora_id in [i for i in self._host if i not in self._pinned][:max(0, excess)]:
            del self._host[lora_id]

    def unpin(self, lora_int_id: int) -> None:
        """No live request runs under the adapter any more."""
        with self._lock:
            self._pinned.discard(lora_int_id)
            if lora_int_id in self._removed:
                self._forget(lora_int_id)
            self._trim()

    def remove(self, lora_int_id: int) -> None:
        """Forget the adapter: out of host memory, its slot free (once its live requests end,
        when it is pinned)."""
        with self._lock:
            if lora_int_id in self._pinned:
                self._removed.add(lora_int_id)
            else:
                self._forget(lora_int_id)

    def _forget(self, lora_int_id: int) -> None:
        self._removed.discard(lora_int_id)
        self._host.pop(lora_int_id, None)
        for i, held in enumerate(self._slot_ids):
            if held == lora_int_id:
                self._slot_ids[i] = None

    def _slot_for(self, lora: LoRARequest, needed: set[int]) -> int:
        ids = self._slot_ids
        if lora.lora_int_id in ids:
            return ids.index(lora.lora_int_id)
        free = [i for i, held in enumerate(ids) if held is None or held not in needed]
        if not free:
            raise RuntimeError(f"more adapters in one step than --max-loras ({len(ids)})")
        slot = min(free, key=lambda i: (ids[i] is not None, self._slot_used[i]))
        # in host memory: the engine pins its requests' adapters (load() would also undo a removal)
        adapter = self._host.get(lora.lora_int_id)
        if adapter is not None:
            self._host.move_to_end(lora.lora_int_id)
        self.slots.fill(slot, adapter if adapter is not None else self.load(lora))
        ids[slot] = lora.lora_int_id
        return slot

    def batch(self, requests: list, num_tokens: int) -> LoRABatch | None:
        """The step's LoRABatch for its scheduled requests (each with `lora` and `token_ids`),
        None when none has an adapter."""
        if not any(r.lora is not None for r in requests):
            return None
        needed = {r.lora.lora_int_id for r in requests if r.lora is not None}
        now = time.monotonic()
        spans: dict[int, list[range]] = {}  # slot -> the token ranges it runs
        start = 0
        with self._lock:
            for r in requests:
                n = len(r.token_ids)
                if r.lora is not None:
                    slot = self._slot_for(r.lora, needed)
                    self._slot_used[slot] = now
                    spans.setdefault(slot, []).append(range(start, start + n))
                start += n
        rows, groups = [], []
        for slot, ranges in spans.items():
            groups.append((slot, len(rows), sum(len(s) for s in ranges)))
            for span in ranges:
                rows.extend(span)
        in_rows = set(rows)
        order = rows + [t for t in range(num_tokens) if t not in in_rows]
        padding = [(-1, 0, 0)] * (self.config.max_loras - len(groups))
        slots, starts, counts = zip(*(groups + padding))
        dev = self.device
        return LoRABatch(torch.tensor(rows, dtype=torch.int64, device=dev), groups,
                         torch.tensor(groups, dtype=torch.int64), torch.tensor(order, dtype=torch.int32, device=dev),
                         torch.tensor(slots, dtype=torch.int32, device=dev),
                         torch.tensor(starts, dtype=torch.int32, device=dev),
                         torch.tensor(counts, dtype=torch.int32, device=dev))


__all__ = ["LoRAError", "LoRAManager"]
