"""Swap copies (runtime.kv_swap) through the device layer: the bytes come back as they left,
the copies run on side streams in the order the data needs, and the forward waits for the
swap-ins only, not for swap-outs draining to the host. The GPU's own lines run here over a fake
CUDA device (tests.fake_cuda)."""

from __future__ import annotations

import pytest
import torch

from pageserve.runtime import model_runner
from pageserve.runtime.device import CudaDevice, HostDevice
from pageserve.runtime.kv_swap import KVSwapper, runs
from tests.fake_cuda import FakeCuda
from tests.test_prefix_and_swap import TINY_BLOCK_BYTES, tiny, token_ids, workload

pytestmark = pytest.mark.engine

SHAPE = (2, 2, 12, 2, 4, 8)  # layers, K/V, blocks, KV heads, block size, head dim


def test_runs_of_consecutive_ids():
    assert runs([4, 5, 6, 9, 2, 3]) == [(0, 4, 3), (3, 9, 1), (4, 2, 2)]
    assert runs([7]) == [(0, 7, 1)] and runs([]) == []


@pytest.mark.parametrize("dev", [HostDevice(), FakeCuda()], ids=["cpu", "fake-cuda"])
def test_blocks_come_back_as_they_left(dev):
    kv = torch.randn(SHAPE)
    original = kv.clone()
    swapper = KVSwapper(kv, 8, dev)
    swapper.swap([(3, 0), (1, 1), (4, 5)], [])  # two runs of swap blocks: 0-1 and 5
    kv[:, :, [3, 1, 4]] = 0
    swapper.swap([], [(5, 7), (0, 2), (1, 6)])
    swapper.wait_ready()
    for src, dst in ((4, 7), (3, 2), (1, 6)):
        assert torch.equal(kv[:, :, dst], original[:, :, src])
    assert swapper.nbytes == 8 * kv[:, :, 0].numel() * kv.element_size()


def test_copies_run_on_side_streams_in_the_order_the_data_needs():
    dev = FakeCuda()
    swapper = KVSwapper(torch.zeros(SHAPE), 8, dev)
    assert dev.log == [("pinned", 8 * 2 * 2 * 2 * 4 * 8 * 4)]  # the whole swap space, at once
    out_s, in_s = swapper.out_stream.name, swapper.in_stream.name
    dev.log.clear()
    swapper.swap([(3, 0)], [])  # step 1: a swap-out only
    swapper.wait_ready()
    assert ("wait_stream", out_s, "main") in dev.log  # after the forward that wrote the block
    assert ("record_stream", out_s) in dev.log  # the gathered blocks outlive Python's reference
    assert not any(e[0] == "wait_event" and e[1] == "main" for e in dev.log)  # nothing waited
    inner = dev.log[dev.log.index(("enter", out_s)) + 1:dev.log.index(("exit", out_s))]
    assert inner == []  # only copies inside the stream: no waits, no records
    dev.log.clear()
    swapper.swap([(1, 1)], [(0, 4)])  # step 2: reads swap block 0, written by step 1
    earlier_out = next(e[2] for e in dev.log if e[:2] == ("record", out_s))
    assert ("wait_event", in_s, earlier_out) in dev.log
    assert dev.log.index(("wait_event", in_s, earlier_out)) < dev.log.index(("enter", in_s))
    earlier_in = next(e[2] for e in dev.log if e[:2] == ("record", in_s))
    assert ("wait_event", out_s, earlier_in) in dev.log  # swap blocks freed by a swap-in
    ready = [e[2] for e in dev.log if e[:2] == ("record", in_s)][-1]
    assert dev.log.index(("exit", in_s)) < dev.log.index(("record", in_s, ready))
    assert not any(e[:2] == ("wait_event", "main") for e in dev.log)  # not yet: only the forward
    swapper.wait_ready()
    assert dev.log[-1] == ("wait_event", "main", ready)
    swapper.wait_ready()
    assert dev.log[-1] == ("wait_event", "main", ready)  # waited once


def test_engine_swaps_through_the_cuda_code_path(tiny_model_dir, monkeypatch):
    """The whole engine under preemption with the CUDA device layer faked: same tokens as
    without pressure, and each forward after a swap-in waits for exactly that swap-in."""
    prompts, params = workload(10, seed=4)
    expected = token_ids(tiny(tiny_model_dir, blocks=2000).generate(prompts, params, use_tqdm=False))
    dev = FakeCuda()
    monkeypatch.setattr(model_runner, "device_for", lambda device: dev)
    llm = tiny(tiny_model_dir, blocks=40, swap_blocks=30)
    runner = llm.engine.runner
    assert runner.dev is dev and ("pinned", 30 * TINY_BLOCK_BYTES) in dev.log
    forward = runner.model.forward
    monkeypatch.setattr(runner.model, "forward", lambda *a: dev.log.append(("forward",)) or forward(*a))
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
    sched = llm.engine.scheduler
    assert sched.num_swapped_in_blocks > 0
    in_s = runner.swapper.in_stream.name
    ready = [i for i, e in enumerate(dev.log) if e[:2] == ("record", in_s) and dev.log[i - 1] == ("exit", in_s)]
    assert ready
    for i in ready:
        nxt = dev.log.index(("forward",), i)
        assert ("wait_event", "main", dev.log[i][2]) in dev.log[i:nxt]
    main_waits = [e[2] for e in dev.log if e[:2] == ("wait_event", "main")]
    assert len(main_waits) == len(ready) and all(w.startswith(in_s) for w in main_waits)


class FakeCudart:
    def __init__(self, error: int = 0):
        self.error = error
        self.calls: list[tuple] = []

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append(("register", ptr, size))
        return self.error

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0


def test_cuda_pinned_memory_is_registered_at_its_exact_size(monkeypatch):
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    tensor = CudaDevice(torch.device("cuda")).host_buffer((3, 5), torch.float32)
    ptr = tensor.data_ptr()
    assert cudart.calls == [("register", ptr, 60)]  # not rounded up to a power of two
    del tensor
    assert cudart.calls[-1] == ("unregister", ptr)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(error=2))
    with pytest.raises(RuntimeError, match="lower --swap-space"):
        CudaDevice(torch.device("cuda")).host_buffer((4,), torch.float32)
