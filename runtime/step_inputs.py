"""A step's input tensors from its SchedulerOutput: token ids, positions and the attention
metadata, built on the host in lists and numpy and uploaded once each (on a GPU through pinned
memory, not waiting for the step in flight). Under async scheduling, a request running ahead has
a placeholder token, filled on the device from the last step's draws. Block tables are kept
between steps (BlockTables): a step brings only what changed in them."""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np
import torch

from pageserve.runtime.kernels import AttentionMetadata
from pageserve.runtime.scheduler import SchedulerOutput


class BlockTables:
    """The block tables of the requests a runner has seen, one row each, kept on the host
    between steps: each step writes only the ids that changed (ScheduledRequest.block_ids_start
    and new_block_ids, from KVCacheManager.block_update), so building a step's tables costs
    by what changed, not by every request's whole context. Entries past a row's length are 0."""

    def __init__(self):
        self.rows: dict[str, int] = {}
        self.free: list[int] = []
        self.table = np.zeros((8, 16), dtype=np.int32)
        self.lens = np.zeros(8, dtype=np.int64)

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget finished or preempted requests (a preempted one is sent whole when it runs again)."""
        for rid in request_ids:
            row = self.rows.pop(rid, None)
            if row is not None:
                self.table[row, :self.lens[row]] = 0
                self.lens[row] = 0
                self.free.append(row)

    def update(self, requests) -> np.ndarray:
        """Apply the step's changes; the requests' rows, in order."""
        get = self.rows.get
        rows = [get(r.request_id) for r in requests]
        # the requests with a change: new ids, or the whole table (a request new to this runner)
        for i in [i for i, r in enumerate(requests) if r.new_block_ids or not r.block_ids_start]:
            r = requests[i]
            row = rows[i]
            start, new = r.block_ids_start, r.new_block_ids
            if row is None:
                if start:
                    break  # refused below
                row = rows[i] = self.rows[r.request_id] = self.free.pop() if self.free else self._new_row()
            end = start + len(new)
            if end > self.table.shape[1]:
                width = max(end, 2 * self.table.shape[1])
                self.table = np.pad(self.table, ((0, 0), (0, width - self.table.shape[1])))
            self.table[row, start:end] = new
            if end < self.lens[row]:  # a rewritten table that got shorter
                self.table[row, end:self.lens[row]] = 0
            self.lens[row] = end
        if None in rows:  # only ids past the start of a table it was never sent
            r = requests[rows.index(None)]
            raise RuntimeError(f"request {r.request_id}: a block table update from index "
                               f"{r.block_ids_start} for a table this runner does not hold")
        return np.array(rows, dtype=np.int64)

    def _new_row(self) -> int:
        row = len(self.rows) + len(self.free)
        if row == len(self.lens):
            self.table = np.pad(self.table, ((0, len(self.lens)), (0, 0)))
            self.lens = np.pad(self.lens, (0, len(self.lens)))
        return row

    def block_id(self, request_id: str, index: int) -> int:
        return int(self.table[self.rows[request_id], index])

    def of(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows), the longest row's length] block ids, padded with 0."""
        return self.table[rows, :max(1, int(self.lens[rows].max(initial=0)))]


def step_inputs(out: SchedulerOutput, dev, device: torch.device, tables: BlockTables, lora=None,
                last_draws: Callable[[list[str]], tuple[torch.Tensor, list[int] | None]] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], torch.Tensor]:
    """(input ids, positions, metadata, the rows whose logits are sampled, the same rows on the
    device). dev: the device's uploads (runtime/device.py); tables: the runner's block tables,
    brought up to date with the step's; lora: the adapter manager, for the step's adapter rows;
    last_draws: the last step's draws on the device and the rows of these requests in them
    (StepSampler.last_draws)."""
    reqs = out.requests
    chunks = [r.token_ids for r in reqs]
    if chunks and min(map(len, chunks)) == max(map(len, chunks)) == 1:  # one token each (most steps)
        end, max_query_len = len(reqs), 1
        positions = [r.start_pos for r in reqs]
        input_ids = [c[0] for c in chunks]
        query_start = list(range(end + 1))
        seq_lens = [p + 1 for p in positions]
        logits_rows = [i for i, r in enumerate(reqs) if r.sample]  # (drafts come with a token)
        # async scheduling: where a token the last step drew goes, and whose
        holes = [i for i, r in enumerate(reqs) if r.placeholder]
        ahead = [reqs[i].request_id for i in holes]
    else:
        input_ids, positions, query_start, seq_lens, logits_rows = [], [], [0], [], []
        holes, ahead = [], []
        end = max_query_len = 0
        for r in reqs:
            start, ids = r.start_pos, r.token_ids
            n = len(ids)
            if n == 1:
                if r.placeholder:
                    holes.append(end)
                    ahead.append(r.request_id)
                input_ids.append(ids[0])
                positions.append(start)
            else:
                input_ids.extend(ids)
                positions.extend(range(start, start + n))
                max_query_len = max(max_query_len, n)
            end += n
            query_start.append(end)
            seq_lens.append(start + n)
            if r.sample and not r.draft_tokens:
                logits_rows.append(end - 1)
    block_tables = tables.of(tables.update(out.requests))  # [B, max blocks], padded with 0
    draws, rows = last_draws(ahead) if holes else (None, [])
    # every token a decode run ahead, in the order of the last step's draws (a steady batch):
    # the draws are the input ids as they are, with no upload or scatter
    ids_are_draws = rows is None and len(holes) == end
    if ids_are_draws:
        input_ids, holes, rows = [], [], []
    elif rows is None:
        rows = list(range(len(ahead)))
    # one copy to the device for all of them
    slots, qsl, lens_t, tables_t, ids, pos, rows_t, holes_t, draw_rows = dev.upload_many(
        [(out.slot_mapping, torch.int64), (query_start, torch.int32), (seq_lens, torch.int32),
         (block_tables, torch.int32), (input_ids, torch.int64), (positions, torch.int64),
         (logits_rows, torch.int64), (holes, torch.int64), (rows, torch.int64)], device)
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=qsl, seq_lens=lens_t, block_tables=tables_t,
        max_query_len=max(max_query_len, 1),
        max_seq_len=max(seq_lens),
        lora=None if lora is None else lora.batch(out.requests, end),
    )
    if ids_are_draws:
        ids = draws
    elif holes:
        ids.index_copy_(0, holes_t, draws.index_select(0, draw_rows))
    return ids, pos, meta, logits_rows, rows_t
