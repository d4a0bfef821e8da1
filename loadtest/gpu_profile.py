"""The GPU check's profile section: where a decode step's time goes, with async scheduling off
and on. A random-weight model of Qwen2.5-0.5B's shape in bf16 (TINY's on CPU with --smoke), 128
greedy requests decoding together; with async scheduling also sampled at temperature 0.7: with
top-k 50 (which reads nothing back from the device), with top-p 0.9 (where the sampler asks the
device which rows its candidates bound: two syncs a step), and top-p 0.9 drawn the sync-free way
(every top-p row's whole vocabulary sorted each step), to weigh that sort against the syncs
(random weights bound no row within its candidates, so the sync way sorts every row too: the pair
gives the syncs' cost and the sort's, which a trained model's batch pays one or the other of). Per
mode: the wall time per step, the share of it the device spends in kernels (from a torch profiler
trace, kept gzipped beside gpu_check.json), and the host-device synchronizations per step
(torch.cuda's sync debug mode, CUDA only)."""

from __future__ import annotations

import contextlib
import functools
import gzip
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch

from pageserve.loadtest.gpu_engine_checks import QWEN_05B, TINY, qwen_like

# mode: (async scheduling, sampling parameters, draw without a sync forced)
MODES = {
    "sync": (False, {}, False),
    "async": (True, {}, False),
    "async_sampled": (True, {"temperature": 0.7, "top_k": 50}, False),
    "async_top_p": (True, {"temperature": 0.7, "top_p": 0.9}, False),
    "async_top_p_sync_free": (True, {"temperature": 0.7, "top_p": 0.9}, True),
}


def _engine(path: Path, device: torch.device, smoke: bool, async_scheduling: bool, requests: int,
            sampling: dict):
    from pageserve.runtime import SamplingParams
    from pageserve.runtime.engine import LLMEngine
    from pageserve.runtime.engine_args import EngineArgs

    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(path), dtype="float32" if smoke else "bfloat16", device=device.type,
        kv_cache_memory=0.05 if smoke else 8, max_num_seqs=requests, async_scheduling=async_scheduling))
    params = SamplingParams(**{"temperature": 0.0, **sampling}, max_tokens=10_000, ignore_eos=True)
    for i in range(requests):
        engine.add_request([(31 * i + 7 * j) % 997 + 3 for j in range(64 if smoke else 256)], params)
    while engine.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    for _ in range(5):  # past the prompts, both steps of async scheduling's pair in flight
        engine.step()
    return engine


@contextlib.contextmanager
def _sync_free_draws():
    """The sampler draws every batch without reading back from the device (draw(sync_free=True))."""
    from pageserve.sampling import sampler

    draw = sampler.draw
    sampler.draw = functools.partial(draw, sync_free=True)
    try:
        yield
    finally:
        sampler.draw = draw


def _syncs_per_step(engine, steps: int) -> float | None:
    """Host-device synchronizations per engine step (warnings of torch.cuda's sync debug mode)."""
    if not torch.cuda.is_available():
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught) / steps


def _device_busy(prof) -> float:
    """Microseconds the device spent in kernels (self time of device events)."""
    return sum(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0
               for e in prof.key_averages())


def section_profile(args, report, device):
    from torch.profiler import ProfilerActivity, profile

    smoke = args.smoke
    shape, requests, steps = (TINY, 8, 4) if smoke else (QWEN_05B, 128, 30)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = report["profile"] = {"shape": shape, "requests": requests, "steps": steps}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with tempfile.TemporaryDirectory() as tmp:
        path = qwen_like(Path(tmp), shape)
        for mode, (async_scheduling, sampling, sync_free) in MODES.items():
            with _sync_free_draws() if sync_free else contextlib.nullcontext():
                engine = _engine(path, device, smoke, async_scheduling, requests, sampling)
                t0 = time.perf_counter()
                for _ in range(steps):
                    engine.step()
                wall = (time.perf_counter() - t0) / steps
                with profile(activities=activities) as prof:
                    for _ in range(steps):
                        engine.step()
                syncs = _syncs_per_step(engine, steps)
            trace = Path(tmp) / f"profile_{mode}.json"
            prof.export_chrome_trace(str(trace))
            with open(trace, "rb") as src, gzip.open(out / f"profile_{mode}.json.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            busy = _device_busy(prof) / 1e6 / steps if device.type == "cuda" else None
            result[mode] = {"step_ms": wall * 1e3, "device_ms_per_step": None if busy is None else busy * 1e3,
                            "device_busy": None if busy is None else busy / wall,
                            "syncs_per_step": syncs,
                            "trace": f"profile_{mode}.json.gz"}
            r = result[mode]
            kernels = "-" if busy is None else f"{busy * 1e3:.2f} ms ({r['device_busy'] * 100:.0f}%)"
            counted = "-" if r["syncs_per_step"] is None else f"{r['syncs_per_step']:.1f}"
            print(f"  {mode:21s}: {r['step_ms']:.2f} ms a step; device in kernels {kernels}; syncs a step {counted}")
            del engine
            if device.type == "cuda":
                torch.cuda.empty_cache()
    result["async_over_sync_step_time"] = result["async"]["step_ms"] / result["sync"]["step_ms"]
