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
                last_tokens: Callable[[list[str]], torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
    """(input ids, positions, metadata, the rows whose logits are sampled). dev: the device's
    uploads (runtime/device.py); lora: the adapter manager, for the step's adapter rows;
    last_tokens: the last step's draws on the device, by request id (StepSampler.last_tokens)."""
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
    upload = dev.upload
    # [B, max blocks] padded with 0, in one numpy assignment: a list of lists through
    # torch.tensor is the slowest part of preparing a large batch
    lens = np.array([len(r.block_ids) for r in out.requests])
    block_tables = np.zeros((len(lens), lens.max()), dtype=np.int32)
    block_tables[np.arange(lens.max()) < lens[:, None]] = \
        np.fromiter(itertools.chain.from_iterable(r.block_ids for r in out.requests), np.int32, lens.sum())
    meta = AttentionMetadata(
        slot_mapping=upload(out.slot_mapping, torch.int64, device),
        query_start_loc=upload(query_start, torch.int32, device),
        seq_lens=upload(seq_lens, torch.int32, device),
        block_tables=upload(block_tables, torch.int32, device),
        max_query_len=max(query_start[i + 1] - query_start[i] for i in range(len(seq_lens))),
        max_seq_len=max(seq_lens),
        lora=None if lora is None else lora.batch(out.requests, len(input_ids)),
    )
    ids = upload(input_ids, torch.int64, device)
    if holes:
        ids.index_copy_(0, upload(holes, torch.int64, device), last_tokens(ahead))
    return ids, upload(positions, torch.int64, device), meta, logits_rows
