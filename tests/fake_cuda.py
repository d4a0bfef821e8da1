"""A CUDA device as the model runner sees it (runtime.device), on the CPU: the runner runs the
lines it runs on a GPU, its streams and events log what is asked of them, and its memory
statistics are whatever the test sets. Tensors stay on the CPU."""

from __future__ import annotations

import contextlib
import itertools

import torch

from pageserve.runtime.device import HostDevice

GiB = 1 << 30


class FakeEvent:
    def __init__(self, name: str, log: list | None = None):
        self.name, self.log = name, log

    def synchronize(self) -> None:
        if self.log is not None:
            self.log.append(("event_sync", self.name))


class FakeStream:
    def __init__(self, name: str, log: list):
        self.name = name
        self.log = log
        self._events = itertools.count()

    def wait_stream(self, stream: "FakeStream") -> None:
        self.log.append(("wait_stream", self.name, stream.name))

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait_event", self.name, event.name))

    def record_event(self) -> FakeEvent:
        event = FakeEvent(f"{self.name}:{next(self._events)}")
        self.log.append(("record", self.name, event.name))
        return event


class FakeGraph:
    """A CUDA graph's contract on the CPU: capture runs the function once and keeps its output
    tensor; replay runs it again (on whatever the captured buffers hold now) into that tensor."""

    def __init__(self, log: list):
        self.log = log
        self.fn = self.output = None

    def capture(self, fn) -> torch.Tensor:
        self.fn, self.output = fn, fn()
        self.log.append(("capture", tuple(self.output.shape)))
        return self.output

    def replay(self) -> torch.Tensor:
        self.output.copy_(self.fn())
        return self.output


class FakeCuda(HostDevice):
    type = "cuda"

    def __init__(self, total: int = 80 * GiB, free: int = 70 * GiB, allocated: int = 2 * GiB,
                 peak: int = 5 * GiB):
        self.log: list[tuple] = []
        self.total, self.free, self.allocated, self.peak = total, free, allocated, peak
        self.main = FakeStream("main", self.log)
        self._current = self.main
        self._streams = itertools.count(1)

    def new_stream(self) -> FakeStream:
        return FakeStream(f"side{next(self._streams)}", self.log)

    def current_stream(self) -> FakeStream:
        return self._current

    @contextlib.contextmanager
    def use_stream(self, stream: FakeStream):
        self.log.append(("enter", stream.name))
        outer, self._current = self._current, stream
        try:
            yield
        finally:
            self._current = outer
            self.log.append(("exit", stream.name))

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        self.log.append(("record_stream", stream.name))

    def host_buffer(self, shape, dtype) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype)
        self.log.append(("pinned", tensor.numel() * tensor.element_size()))
        return tensor

    def upload(self, values, dtype, device) -> torch.Tensor:
        self.log.append(("upload", len(values)))
        return super().upload(values, dtype, device)

    def upload_many(self, items, device) -> list[torch.Tensor]:
        self.log.append(("upload_many", len(items)))
        return super().upload_many(items, device)

    def download(self, tensor: torch.Tensor) -> tuple[torch.Tensor, FakeEvent]:
        """A copy (what the host reads after the event), so that a test sees the host read it
        only after waiting for the event."""
        event = FakeEvent(f"download:{len(self.log)}", self.log)
        self.log.append(("download", event.name))
        return tensor.clone(), event

    def synchronize(self) -> None:
        self.log.append(("synchronize",))

    def empty_cache(self) -> None:
        self.log.append(("empty_cache",))

    def mem_get_info(self) -> tuple[int, int]:
        return self.free, self.total

    def memory_allocated(self) -> int:
        return self.allocated

    def max_memory_allocated(self) -> int:
        return self.peak

    def reset_peak_memory_stats(self) -> None:
        self.log.append(("reset_peak",))

    def new_graph(self) -> FakeGraph:
        return FakeGraph(self.log)
