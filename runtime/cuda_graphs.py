"""Decode steps replayed from CUDA graphs.

A decode step of a small model is hundreds of short kernel launches whose launch cost exceeds
their work. At start-up `DecodeGraphs` captures the model's forward of a decode-only step
once per batch size of a fixed set (as vLLM does), reading its inputs from static buffers; a
decode step of n requests then copies its inputs into those buffers and replays the graph of
the smallest captured size >= n. The padding rows have the slot -1 (they write no KV) and a
context of one token (the first of their block-table row, some cached token: a read, for
kernels that would divide by an empty softmax); their hidden states are dropped.

With LoRA adapters the graphs also capture the adapter kernels, which read each step's token
groups (LoRABatch) from static buffers as the attention reads its block tables.

Steps a graph cannot serve run eagerly: any step with a prompt chunk, or more requests than
the largest captured size. Batch sizes small enough for the attention to split long contexts
over the SMs capture the split-KV path with the partitions of the longest context (the
partitions past a request's context exit at once), so that the tail of a long batch, a few
requests with long contexts, still replays. Sampling, logits and grammar masks stay outside
the graph."""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from pageserve.runtime.kernels import AttentionMetadata, LoRABatch

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512  # vLLM's default cap: larger decode batches gain little from a graph


def capture_sizes(sizes: tuple[int, ...] | None, max_num_seqs: int) -> list[int]:
    """The batch sizes to capture, ascending. `sizes`: --cuda-graph-sizes; one number is the
    largest size (then 1, 2, 4 and every multiple of 8 up to it), several are the sizes
    themselves. None: up to max_num_seqs, at most MAX_CAPTURE_SIZE. No size exceeds max_num_seqs."""
    if sizes and len(sizes) > 1:
        chosen = set(sizes)
    else:
        top = min(sizes[0], max_num_seqs) if sizes else min(max_num_seqs, MAX_CAPTURE_SIZE)
        chosen = {s for s in (1, 2, 4) if s <= top} | set(range(8, top + 1, 8)) | {top}
    return sorted(s for s in chosen if 1 <= s <= max_num_seqs)


class DecodeGraphs:
    """Static inputs sized for the largest batch, and one graph per captured batch size."""

    def __init__(self, model, kernels, kv_caches, dev, sizes: list[int], max_blocks: int,
                 device: torch.device, lora_slots: int = 0):
        """lora_slots: --max-loras with --enable-lora: the graphs also hold the adapter kernels,
        which read the step's token groups from static buffers (a group of slot -1 does nothing)."""
        self.model, self.kernels, self.kv_caches, self.dev = model, kernels, kv_caches, dev
        self.device = device
        self.sizes = sizes
        n = sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # one token each
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.lora = None
        if lora_slots:
            int32 = dict(dtype=torch.int32, device=device)
            self.lora = LoRABatch(torch.zeros(0, dtype=torch.int64, device=device), [], torch.zeros(0, 3, dtype=torch.int64),
                                  torch.arange(n, **int32), torch.full((lora_slots,), -1, **int32),
                                  torch.zeros(lora_slots, **int32), torch.zeros(lora_slots, **int32))
        self.graphs: dict[int, object] = {}
        self.replays = 0  # decode steps served by a graph (tests and benchmarks read it)

    def _meta(self, size: int) -> AttentionMetadata:
        max_context = self.block_tables.shape[1] * self.kernels.block_size
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size],
            max_query_len=1, max_seq_len=self.kernels.graph_max_seq_len(size, max_context, self.device),
            lora=None if self.lora is None else dataclasses.replace(self.lora, sorted_tokens=self.lora.sorted_tokens[:size]))

    def _forward(self, size: int) -> torch.Tensor:
        meta = self._meta(size)
        self.kernels.prepare(meta)
        return self.model(self.input_ids[:size], self.positions[:size], meta, self.kv_caches)

    def capture(self) -> None:
        """Largest first, so that the smaller graphs reuse its pool memory. Each size runs
        once eagerly before its capture (kernels compiled, lazy allocations made)."""
        start = time.perf_counter()
        before = self.dev.memory_allocated() if self.dev.type == "cuda" else 0
        for size in reversed(self.sizes):
            self._forward(size)
            self.dev.synchronize()
            graph = self.dev.new_graph()
            graph.capture(lambda size=size: self._forward(size))
            self.graphs[size] = graph
        self.dev.synchronize()
        used = self.dev.memory_allocated() - before if self.dev.type == "cuda" else 0
        logger.info("CUDA graphs: %d decode batch sizes (%s) captured in %.1f s, %.0f MiB",
                    len(self.sizes), _ranges(self.sizes), time.perf_counter() - start, used / 2 ** 20)

    def size_for(self, meta: AttentionMetadata) -> int | None:
        """The captured batch size a step replays, or None when it runs eagerly."""
        num_seqs = meta.seq_lens.shape[0]
        if meta.max_query_len != 1 or num_seqs > self.sizes[-1]:
            return None
        return next(s for s in self.sizes if s >= num_seqs)

    def run(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of the step's n tokens from the graph of `size` >= n."""
        n, width = meta.block_tables.shape
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        if size > n:  # padding rows: no slot, one token of context (ids, positions, tables stale)
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
        if self.lora is not None:  # padding rows are in no group: their rows of sorted_tokens go unread
            if meta.lora is None:
                self.lora.group_slots.fill_(-1)
                self.lora.group_counts.zero_()
            else:
                self.lora.sorted_tokens[:n].copy_(meta.lora.sorted_tokens)
                for name in ("group_slots", "group_starts", "group_counts"):
                    getattr(self.lora, name).copy_(getattr(meta.lora, name))
        self.replays += 1
        return self.graphs[size].replay()[:n]


def _ranges(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 6 else f"{sizes[0]}, {sizes[1]}, ... {sizes[-1]}"
