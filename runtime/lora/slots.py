"""The device memory adapters run from: for every projection an adapter may change, `max_loras`
slots of A [slices * R, in] and B transposed, [R, out] (R = --max-lora-rank; the expand then
runs along the output's rows), allocated with the model so that the memory profile counts them.
A slot holds one adapter at a time, zero-padded to R (a zero slice changes nothing)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pageserve.runtime.lora.adapter import ATTENTION, LoRAAdapter, Target


@dataclass(slots=True)
class LinearLoRA:
    """One projection's slots, hung on its weight as `weight.lora` for Kernels.linear."""
    a: torch.Tensor  # [S, len(slices) * R, in]
    bt: torch.Tensor  # [S, R, out]
    # per slice: (its columns of the shrunk activations, its first output row, its rows)
    slices: tuple[tuple[int, int, int], ...]
    slice_table: torch.Tensor  # the same, int64 [slices, 3] on the host (the C kernel's)


class LoRASlots:
    def __init__(self, model: nn.Module, targets: dict[str, Target], num_slots: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype):
        self.num_slots, self.max_rank = num_slots, max_rank
        self.layers: dict[str, LinearLoRA] = {}
        for key, target in targets.items():
            layer, projection = key.split(".")
            offsets = [sum(target.slices[:i]) for i in range(len(target.slices))]
            slices = tuple((i * max_rank, off, size) for i, (off, size) in enumerate(zip(offsets, target.slices)))
            lora = LinearLoRA(
                torch.zeros(num_slots, len(slices) * max_rank, target.in_features, dtype=dtype, device=device),
                torch.zeros(num_slots, max_rank, sum(target.slices), dtype=dtype, device=device), slices,
                torch.tensor(slices, dtype=torch.int64))
            self.layers[key] = lora
            module = model.layers[int(layer)].get_submodule("self_attn" if projection in ATTENTION else "mlp")
            getattr(module, projection).weight.lora = lora

    @property
    def nbytes(self) -> int:
        return sum(lora.a.nbytes + lora.bt.nbytes for lora in self.layers.values())

    def fill(self, slot: int, adapter: LoRAAdapter) -> None:
        """Write the adapter into the slot, over whatever was there."""
        for key, lora in self.layers.items():
            a, bt = lora.a[slot], lora.bt[slot]
            a.zero_()
            bt.zero_()
            for piece, (col, off, size) in zip(adapter.weights.get(key, ()), lora.slices):
                if piece is not None:
                    rank = piece[0].shape[0]
                    a[col:col + rank].copy_(piece[0])
                    bt[:rank, off:off + size].copy_(piece[1].t())
