"""The bytes of the swap space: KV blocks copied between the device pool and host memory on
side streams, so that a step's forward runs while its swap-outs drain to the host.

The host copy is block-major ([swap blocks, layers, K/V, KV heads, block size, head dim]) and
pinned on CUDA, so a run of consecutive swap blocks is one contiguous asynchronous copy,
with no staging buffer and no host-side scatter. The device side is gathered into (or
scattered from) one contiguous block-major tensor per direction."""

from __future__ import annotations

import torch

from pageserve.runtime.device import CudaDevice, HostDevice
from pageserve.triton_kernels.torch_ops import indexable


def runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(position in ids, first id, length) of each run of consecutive ids, in order."""
    out: list[tuple[int, int, int]] = []
    for i, b in enumerate(ids):
        if out and out[-1][1] + out[-1][2] == b:
            at, first, n = out[-1]
            out[-1] = (at, first, n + 1)
        else:
            out.append((i, b, 1))
    return out


class KVSwapper:
    def __init__(self, kv_storage: torch.Tensor, num_swap_blocks: int, dev: CudaDevice | HostDevice):
        """kv_storage: the pool, [layers, K/V, blocks, KV heads, block size, head dim]."""
        self.dev = dev
        kv_storage = indexable(kv_storage)
        self.blocks = kv_storage.movedim(2, 0)  # block-major view of the pool (no copy)
        # the whole --swap-space, committed now (pinned on CUDA)
        self.storage = dev.host_buffer((num_swap_blocks,) + self.blocks.shape[1:], kv_storage.dtype)
        self.out_stream = dev.new_stream()  # device -> host
        self.in_stream = dev.new_stream()  # host -> device
        self._ready = None  # the swap-ins the next forward reads

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Start the step's copies: swap_out (device block, swap block) pairs, then swap_in
        (swap block, device block) pairs. The forward must call `wait_ready` first."""
        if not swap_out and not swap_in:
            return
        dev, main = self.dev, self.dev.current_stream()
        # what each direction issued before this step: a swap block may be read by an earlier
        # swap-in and then written by a swap-out now, or written by an earlier swap-out and
        # read by a swap-in now
        earlier_out, earlier_in = self.out_stream.record_event(), self.in_stream.record_event()
        if swap_out:
            src = torch.tensor([d for d, _ in swap_out], device=self.blocks.device)
            # on the main stream: the blocks are read before this step's forward reuses them
            gathered = self.blocks[src]
            self.out_stream.wait_stream(main)
            self.out_stream.wait_event(earlier_in)
            with dev.use_stream(self.out_stream):
                for at, first, n in runs([s for _, s in swap_out]):
                    self.storage[first:first + n].copy_(gathered[at:at + n], non_blocking=True)
            dev.record_stream(gathered, self.out_stream)
        if swap_in:
            dst = torch.tensor([d for _, d in swap_in], device=self.blocks.device)
            self.in_stream.wait_stream(main)  # the previous forward and this step's gather
            self.in_stream.wait_event(earlier_out)
            dev.record_stream(dst, self.in_stream)
            with dev.use_stream(self.in_stream):
                arrived = torch.empty((len(swap_in),) + self.blocks.shape[1:], dtype=self.blocks.dtype,
                                      device=self.blocks.device)
                for at, first, n in runs([s for s, _ in swap_in]):
                    arrived[at:at + n].copy_(self.storage[first:first + n], non_blocking=True)
                self.blocks[dst] = arrived
            self._ready = self.in_stream.record_event()

    def wait_ready(self) -> None:
        """Make the current stream wait for the swapped-in blocks (not for swap-outs, which
        drain to the host while it runs)."""
        if self._ready is not None:
            self.dev.current_stream().wait_event(self._ready)
            self._ready = None
