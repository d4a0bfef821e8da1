"""Pipeline parallelism: the decoder layers split into contiguous stages, one group of
tensor-parallel ranks each (ParallelConfig.stage_ranks). The first stage embeds the tokens,
the last one normalizes, computes the logits and samples; between them each step's hidden
states and residual go from a rank to the same TP rank of the next stage by a point-to-point
send (gloo on CPU, NCCL on GPUs), in step order, so that a stage can start the next step while
the one after it finishes this one (the engine keeps several batches in flight)."""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist

PARTITION_ENV = "PAGESERVE_PP_LAYER_PARTITION"  # as vLLM's VLLM_PP_LAYER_PARTITION


def layer_partition(num_layers: int, stages: int, override: str | None = None,
                    head_layers: float = 0.0) -> tuple[int, ...]:
    """Layers per stage: `override` ("13,17"; else $PAGESERVE_PP_LAYER_PARTITION) as given, or a
    split that evens out the stages' work: the last stage also computes the logits, which cost
    `head_layers` decoder layers (a large vocabulary over a small model: several), so it takes
    that many fewer; the others split the rest, the remainder going to the middle stages."""
    if stages == 1:
        return (num_layers,)
    override = override or os.environ.get(PARTITION_ENV)
    if override:
        try:
            parts = tuple(int(p) for p in override.split(","))
        except ValueError:
            raise ValueError(f"--pp-layer-partition {override!r}: layer counts separated by commas") from None
        if len(parts) != stages or sum(parts) != num_layers or min(parts) < 1:
            raise ValueError(f"--pp-layer-partition {override!r}: {stages} counts of at least 1 that add up to "
                             f"the model's {num_layers} layers")
        return parts
    if num_layers < stages:
        raise ValueError(f"--pipeline-parallel-size {stages} is more stages than the model's {num_layers} layers")
    last = min(max(1, math.floor((num_layers + head_layers) / stages - head_layers)), num_layers - stages + 1)
    rest, first = num_layers - last, stages - 1
    parts = [rest // first] * first + [last]
    for i in range(rest % first):
        parts[-2 - i] += 1
    return tuple(parts)


def head_cost(hf: dict) -> float:
    """What the logits cost, in decoder layers: lm_head's weights over one layer's (a step reads
    every weight once when it decodes and multiplies by each when it prefills)."""
    hidden, inter = hf["hidden_size"], hf["intermediate_size"]
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hidden // heads
    kv = hf.get("num_key_value_heads") or heads
    layer = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim + 3 * hidden * inter
    return hf["vocab_size"] * hidden / layer


class StageLink:
    """This rank's sends to the next stage and receives from the previous one. A step's
    (hidden, residual) travel as one [2, tokens, hidden] tensor; the receiver knows the shape
    from the step itself. A send is left in flight until the next one, so that this stage goes
    on to its next step while the next stage is still busy."""

    def __init__(self, prev: int | None, next: int | None, hidden_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.prev, self.next = prev, next  # the same TP rank of the stages before and after (None: none)
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self._sending: tuple[dist.Work, torch.Tensor] | None = None

    def recv(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        buf = torch.empty((2, num_tokens, self.hidden_size), dtype=self.dtype, device=self.device)
        dist.recv(buf, src=self.prev)
        return buf[0], buf[1]

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        self.wait()
        buf = torch.stack([hidden, residual])
        self._sending = (dist.isend(buf, dst=self.next), buf)  # the buffer lives until the send is done

    def wait(self) -> None:
        if self._sending is not None:
            self._sending[0].wait()
            self._sending = None
