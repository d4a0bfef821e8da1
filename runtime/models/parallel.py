"""Tensor parallelism inside the model: which part of each weight a rank holds, and the two
collectives that join the parts (an all-reduce after each row-parallel matmul, a gather of
the vocabulary-parallel logits on rank 0). With one rank every function here is the identity.

The split follows Megatron as vLLM does: q/k/v (by heads) and gate/up are column-parallel
(each rank computes its heads' or its intermediate slice's outputs, no communication),
o_proj and down_proj are row-parallel (each rank multiplies its slice of the inputs and the
partial sums are all-reduced: one all-reduce per attention and one per MLP, per layer; their
biases, where a checkpoint has them, are whole on every rank and added once after it). KV
heads are split like query heads; with fewer KV heads than ranks each rank holds one, the
one its query heads read (replicated on tp / kv ranks). A mixture of experts splits every
expert as a gated MLP (gate/up by column, down by row), keeps the router whole on every rank,
splits its shared expert like a dense MLP, and all-reduces once after the whole block. The
embedding and lm_head are split by vocabulary rows; a vocabulary that does not divide by the
ranks is padded (as vLLM pads it) with zero rows whose logits are cut off after the gather.
The collectives run over this rank's tensor-parallel group (its pipeline stage's ranks),
which runtime/worker.py sets once per process (`set_group`)."""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from torch import nn

from pageserve.runtime.config import ModelConfig
from pageserve.runtime.models.loader import ModelLoadError


_group: dist.ProcessGroup | None = None  # None: torch.distributed's default group


def set_group(group: dist.ProcessGroup | None) -> None:
    """The ranks this process's tensor-parallel collectives run over (a process-wide
    communicator, as torch.distributed's default group is)."""
    global _group
    _group = group


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum the ranks' partial outputs of a row-parallel matmul (in place)."""
    if tp_size > 1:
        dist.all_reduce(x, group=_group)
    return x


VOCAB_PADDING = 64  # as vLLM's DEFAULT_VOCAB_PADDING_SIZE: padded rows per rank stay aligned for matmuls


def vocab_rows(cfg: ModelConfig) -> int:
    """Vocabulary rows each rank holds: an exact share when the vocabulary divides by the
    ranks, else its share rounded up to a multiple of 64 (the last ranks' tail is padding)."""
    if cfg.vocab_size % cfg.tp_size == 0:
        return cfg.vocab_size // cfg.tp_size
    share = -(-cfg.vocab_size // cfg.tp_size)
    return -(-share // VOCAB_PADDING) * VOCAB_PADDING


def gather_logits(logits: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """[rows, vocab_rows] on each rank -> [rows, vocab] on TP rank 0, which samples (the
    padded rows' logits cut off); the other ranks get [rows, 0] (they sample nothing)."""
    if cfg.tp_size == 1:
        return logits
    logits = logits.contiguous()
    if cfg.tp_rank != 0:
        dist.gather(logits, group=_group, group_dst=0)
        return logits.new_empty((logits.shape[0], 0))
    parts = [torch.empty_like(logits) for _ in range(cfg.tp_size)]
    dist.gather(logits, parts, group=_group, group_dst=0)
    return torch.cat(parts, dim=-1)[:, :cfg.vocab_size]


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding (vocab_rows consecutive ids, the padding past the
    vocabulary included): ids elsewhere look up zeros, and the all-reduce gives every rank
    every token's row."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tp_size = cfg.tp_size
        rows = vocab_rows(cfg)
        self.start, self.end = cfg.tp_rank * rows, (cfg.tp_rank + 1) * rows
        self.weight = nn.Parameter(torch.empty(rows, cfg.hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        x = nn.functional.embedding((ids - self.start).masked_fill(outside, 0), self.weight)
        return all_reduce(x.masked_fill_(outside[:, None], 0), self.tp_size)


def embedding(cfg: ModelConfig) -> nn.Module:
    """The token embedding: the whole table on one rank, this rank's rows above one."""
    if cfg.tp_size == 1:
        return nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    return VocabParallelEmbedding(cfg)


def check_supported(model: nn.Module, cfg: ModelConfig) -> None:
    """Refuse, before any weight loads, expert MLPs that do not split over the ranks."""
    if cfg.tp_size == 1:
        return
    from pageserve.runtime.models.layers import SparseMoE  # layers imports this module

    for m in model.modules():
        if not isinstance(m, SparseMoE):
            continue
        for name, size in (("the experts' intermediate size", m.intermediate_size),
                           ("the shared expert's intermediate size", m.shared_intermediate_size)):
            if size % cfg.tp_size:
                raise ModelLoadError(f"{cfg.architecture}: {name} ({size}) must be divisible by "
                                     f"--tensor-parallel-size ({cfg.tp_size})")


# checkpoint names (in CausalLM's layout, without "model.") and how each is split
_HEADS = re.compile(r".+\.([qkv])_proj\.(?:weight|bias)")
_FUSED_QKV = re.compile(r".+\.qkv_proj\.(?:weight|bias)")  # Phi-3 stores q/k/v as one tensor
_COLUMN = re.compile(r".+\.(?:gate|up)_proj\.(?:weight|bias)")  # dense, shared-expert and each expert's
_VOCAB = re.compile(r"embed_tokens\.weight|lm_head\.weight")
_FUSED_GATE_UP = re.compile(r".+\.gate_up_proj\.(?:weight|bias)")
_ROW = re.compile(r".+\.(?:o|down)_proj\.weight")  # the router (mlp.gate) and these biases match nothing: replicated


def shard(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """This rank's part of a checkpoint tensor (a view: nothing is copied before the load
    writes it into the parameter); the whole tensor with one rank or for a replicated one."""
    if cfg.tp_size == 1:
        return tensor
    if m := _HEADS.fullmatch(name):
        return _head_rows(tensor, m.group(1), cfg)
    if _FUSED_QKV.fullmatch(name):
        d = cfg.head_dim
        q, k, v = tensor.split([cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d])
        return torch.cat([_head_rows(q, "q", cfg), _head_rows(k, "k", cfg), _head_rows(v, "v", cfg)])
    if _COLUMN.fullmatch(name):
        return _part(tensor, 0, cfg)
    if _VOCAB.fullmatch(name):
        return _vocab_part(tensor, cfg)
    if _FUSED_GATE_UP.fullmatch(name):
        gate, up = tensor.chunk(2)
        return torch.cat([_part(gate, 0, cfg), _part(up, 0, cfg)])
    if _ROW.fullmatch(name):
        return _part(tensor, 1, cfg)
    return tensor  # norms, routers: every rank holds all of it


def _head_rows(tensor: torch.Tensor, part: str, cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    if part == "q":
        heads, first = cfg.heads_per_rank, cfg.tp_rank * cfg.heads_per_rank
    else:  # rank r reads KV head floor(r * kv / tp): its own when kv >= tp, shared when fewer
        heads, first = cfg.kv_heads_per_rank, cfg.tp_rank * cfg.num_kv_heads // cfg.tp_size
    return tensor.narrow(0, first * d, heads * d)


def _part(tensor: torch.Tensor, dim: int, cfg: ModelConfig) -> torch.Tensor:
    size, rem = divmod(tensor.shape[dim], cfg.tp_size)
    if rem:
        raise ValueError(f"a dimension of {tensor.shape[dim]} does not split over {cfg.tp_size} ranks")
    return tensor.narrow(dim, cfg.tp_rank * size, size)


def _vocab_part(tensor: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """This rank's vocab_rows rows; past the vocabulary's end, zero rows (a copy, only on the
    ranks that hold padding)."""
    rows = vocab_rows(cfg)
    start = min(cfg.tp_rank * rows, tensor.shape[0])
    part = tensor.narrow(0, start, min(rows, tensor.shape[0] - start))
    if part.shape[0] == rows:
        return part
    return torch.cat([part, part.new_zeros(rows - part.shape[0], *part.shape[1:])])
