"""What the model runner needs of its device besides tensors: streams and events (so that
swap copies overlap the forward), host memory the device can copy from asynchronously,
memory statistics (for the KV-cache profile) and graphs (decode steps replayed as one launch).

`CudaDevice` calls torch.cuda. `HostDevice` is the CPU, where work runs in program order:
its streams and events do nothing and it measures no memory. Both have the same methods, so
the runner runs the same lines on either, and a test can hand it a fake CUDA device."""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable

import numpy as np
import torch


class NullStream:
    """A stream on a device that runs everything in program order."""

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self) -> "NullEvent":
        return NullEvent()


class NullEvent:
    """The point a stream reached: on a device in program order, always passed already."""

    def synchronize(self) -> None:
        pass


class HostDevice:
    type = "cpu"
    _stream = NullStream()

    def new_stream(self) -> NullStream:
        return NullStream()

    def current_stream(self) -> NullStream:
        return self._stream

    def use_stream(self, stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """Tell the allocator that `stream` still reads `tensor` after Python drops it."""

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Plain memory, committed now (zero-filled), as the KV pool is: the swap space costs
        its size from start-up, not a growth of memory in the middle of serving."""
        return torch.zeros(shape, dtype=dtype)

    def upload(self, values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A step's input from host values, a list or a numpy array (on a GPU, copied without
        waiting for the device)."""
        if isinstance(values, np.ndarray):
            return torch.from_numpy(values).to(dtype)
        return torch.tensor(values, dtype=dtype, device=device)

    def upload_many(self, items: list[tuple], device: torch.device) -> list[torch.Tensor]:
        """upload() of each (values, dtype), all in one buffer (pack_uploads)."""
        host, views = pack_uploads(items, pin=False)
        return views(host)

    def download(self, tensor: torch.Tensor) -> tuple[torch.Tensor, NullEvent]:
        """A host copy of `tensor` and the event after which it holds the values."""
        return tensor, NullEvent()

    def synchronize(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def mem_get_info(self) -> tuple[int, int]:
        raise NotImplementedError("memory is profiled on CUDA only; the CPU pool is sized by "
                                  "--kv-cache-memory")

    memory_allocated = max_memory_allocated = reset_peak_memory_stats = mem_get_info

    def new_graph(self) -> "CudaGraph":
        raise NotImplementedError("graphs are CUDA's")


class CudaGraph:
    """One CUDA graph: `capture(fn)` records the kernels fn launches (fn's output tensor stays
    the graph's output), `replay()` launches them again on whatever the captured buffers hold
    now. Graphs of one device share a memory pool: they are replayed one at a time."""

    def __init__(self, pool):
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool
        self.output: torch.Tensor | None = None

    def capture(self, fn) -> torch.Tensor:
        with torch.cuda.graph(self.graph, pool=self.pool):
            self.output = fn()
        return self.output

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


class CudaDevice:
    type = "cuda"

    def __init__(self, device: torch.device):
        self.device = device
        self._graph_pool = None

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def use_stream(self, stream: torch.cuda.Stream) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def record_stream(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        tensor.record_stream(stream)

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Page-locked memory of exactly this size, committed now: registered with CUDA rather
        than taken from torch's pinned allocator, which rounds each block up to a power of two."""
        tensor = torch.empty(shape, dtype=dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes:
            cudart = torch.cuda.cudart()
            err = int(cudart.cudaHostRegister(tensor.data_ptr(), nbytes, 0))
            if err:
                raise RuntimeError(f"could not pin {nbytes / 2 ** 30:.2f} GiB of host memory "
                                   f"(CUDA error {err}): lower --swap-space")
            # unpinned before torch frees the pages, which a later registration may get again
            weakref.finalize(tensor, _unregister, cudart, tensor.data_ptr())
        return tensor

    def upload(self, values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Through pinned memory, not waiting for the stream: a blocking copy would wait for
        the step still running, which async scheduling overlaps with this one's preparation
        (torch's pinned allocator keeps the buffer until the copy is done)."""
        if isinstance(values, np.ndarray):
            return torch.from_numpy(values).to(dtype).pin_memory().to(device, non_blocking=True)
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)

    def upload_many(self, items: list[tuple], device: torch.device) -> list[torch.Tensor]:
        """upload() of each (values, dtype) in one pinned buffer and one copy (pack_uploads):
        each upload of its own costs a pinned allocation and a copy call, ten a step."""
        host, views = pack_uploads(items, pin=True)
        return views(host.to(device, non_blocking=True))

    def download(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Into pinned memory after the work queued so far, and the event that marks it: the
        host waits for this step's values, not for the next step queued behind them."""
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def mem_get_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def new_graph(self) -> CudaGraph:
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        return CudaGraph(self._graph_pool)


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.bool: np.bool_}


def pack_uploads(items: list[tuple], pin: bool) -> tuple[torch.Tensor, Callable]:
    """Host values (lists or numpy arrays, with their torch dtypes) packed into one byte
    buffer, each at an offset aligned to 16 bytes (as torch's allocations are: Triton compiles
    a kernel variant per pointer alignment), and the function that cuts a copy of that buffer
    (on any device) into one tensor per item, of its dtype and shape."""
    arrays = [np.asarray(values, dtype=_NUMPY[dtype]) for values, dtype in items]
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // 16) * 16
    host = torch.empty(max(total, 16), dtype=torch.uint8, pin_memory=pin)
    staging = host.numpy()
    for a, at in zip(arrays, offsets):
        staging[at:at + a.nbytes] = a.reshape(-1).view(np.uint8)

    def views(packed: torch.Tensor) -> list[torch.Tensor]:
        return [packed[at:at + a.nbytes].view(dtype).view(a.shape)
                for a, at, (_, dtype) in zip(arrays, offsets, items)]
    return host, views


def _unregister(cudart, ptr: int) -> None:
    torch.cuda.synchronize()  # no copy may still be reading or writing the pages
    cudart.cudaHostUnregister(ptr)


def device_for(device: torch.device) -> HostDevice | CudaDevice:
    return CudaDevice(device) if device.type == "cuda" else HostDevice()
