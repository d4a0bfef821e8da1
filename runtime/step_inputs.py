"""A step's input tensors from its SchedulerOutput: token ids, positions and the attention
metadata, built on the host in lists and numpy and uploaded once each (on a GPU through pinned
memory, not waiting for the step in flight). Under async scheduling, a request running ahead has
a placeholder token, filled on the device from the last step's draws."""

from __future__ import annotations

import itertools
from typing import Callable

import numpy as np
import torch

from pageserve.runtime.kernels import AttentionMetadata
from pageserve.runtime.scheduler import SchedulerOutput


def step_inputs(out: SchedulerOutput, dev, device: torch.device, lora=None,
                last_draws: Callable[[list[str]], tuple[torch.Tensor, list[int]]] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], torch.Tensor]:
    """(input ids, positions, metadata, the rows whose logits are sampled, the same rows on the
    device). dev: the device's uploads (runtime/device.py); lora: the adapter manager, for the
    step's adapter rows; last_draws: the last step's draws on the device and the rows of these
    requests in them (StepSampler.last_draws)."""
    input_ids: list[int] = []
    positions: list[int] = []
    query_start = [0]
    seq_lens: list[int] = []
    logits_rows: list[int] = []
    holes, ahead = [], []  # async scheduling: where a token the last step drew goes, and whose
    for r in out.requests:
        n = len(r.token_ids)
        if r.placeholder:
            holes.append(len(input_ids))
            ahead.append(r.request_id)
        input_ids.extend(r.token_ids)
        positions.extend(range(r.start_pos, r.start_pos + n))
        query_start.append(query_start[-1] + n)
        seq_lens.append(r.start_pos + n)
        if r.sample and not r.draft_tokens:
            logits_rows.append(query_start[-1] - 1)
    # [B, max blocks] padded with 0, in one numpy assignment: a list of lists through
    # torch.tensor is the slowest part of preparing a large batch
    lens = np.array([len(r.block_ids) for r in out.requests])
    block_tables = np.zeros((len(lens), lens.max()), dtype=np.int32)
    block_tables[np.arange(lens.max()) < lens[:, None]] = \
        np.fromiter(itertools.chain.from_iterable(r.block_ids for r in out.requests), np.int32, lens.sum())
    draws, rows = last_draws(ahead) if holes else (None, [])
    # one copy to the device for all of them
    slots, qsl, lens_t, tables, ids, pos, rows_t, holes_t, draw_rows = dev.upload_many(
        [(out.slot_mapping, torch.int64), (query_start, torch.int32), (seq_lens, torch.int32),
         (block_tables, torch.int32), (input_ids, torch.int64), (positions, torch.int64),
         (logits_rows, torch.int64), (holes, torch.int64), (rows, torch.int64)], device)
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=qsl, seq_lens=lens_t, block_tables=tables,
        max_query_len=max(query_start[i + 1] - query_start[i] for i in range(len(seq_lens))),
        max_seq_len=max(seq_lens),
        lora=None if lora is None else lora.batch(out.requests, len(input_ids)),
    )
    if holes:
        ids.index_copy_(0, holes_t, draws.index_select(0, draw_rows))
    return ids, pos, meta, logits_rows, rows_t
