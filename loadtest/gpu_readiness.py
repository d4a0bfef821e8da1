"""GPU readiness checks of the engine, run by loadtest/gpu_check.py in a process of their own (so
that Triton's compile caches start empty and the memory check has the GPU to itself):

1. variants: after kernel warm-up, a mixed load (chunked prefills beside decodes, long decodes
   alone on the split-KV path, a grammar-constrained request) compiles no new kernel variant;
   the warm-up time; the variant keys computed by triton_kernels.variants (what the CPU tests
   count) against the variants Triton really compiled;
2. memory: an engine at --gpu-memory-utilization 0.95 serves the worst load the scheduler can
   build (256 requests, every sampling path, logprobs and prompt logprobs) without running out
   of memory, and the profiled peak covers the peak while serving;
3. swap: swap-outs drain to the host while the GPU computes (their time overlaps a matmul
   loop), and blocks swapped out and back in are unchanged.

    python -m pageserve.loadtest.gpu_readiness [--smoke] [--out DIR]

On CPU (--smoke, under TRITON_INTERPRET=1) the same code runs at tiny shapes; the memory check
needs CUDA and is skipped, and nothing can overlap."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from pageserve.loadtest.gpu_check import check_device
from pageserve.loadtest.gpu_engine_checks import QWEN_05B, TINY, qwen_like

GiB = 1 << 30


def engine(path: Path, smoke: bool, **kw):
    from pageserve.runtime import LLM

    kw.setdefault("kv_cache_memory", 0.05 if smoke else 8)
    kw.setdefault("max_num_seqs", 8 if smoke else 256)  # the interpreter is slow: a small warm-up
    return LLM(str(path), dtype="float32" if smoke else "bfloat16", attention_backend="triton",
               max_model_len=1024 if smoke else 8192, seed=0, **kw)


def mixed_load(llm, smoke: bool) -> None:
    from pageserve.sampling.params import SamplingParams, StructuredOutputsParams

    n, long_ctx = (4, 600) if smoke else (64, 6000)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [[5 + i % 50] * (3 + 37 * i % 300) for i in range(n)]
    llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    llm.generate([{"prompt_token_ids": [7] * long_ctx}] * 2, greedy, use_tqdm=False)  # split-KV decodes
    choice = SamplingParams(temperature=0.0, max_tokens=4,
                            structured_outputs=StructuredOutputsParams(choice=["ab", "ba"]))
    llm.generate([{"prompt_token_ids": [4, 5]}], choice, use_tqdm=False)


def check_variants(args, report, path):
    from pageserve.triton_kernels.variants import VariantLog, compiled_variants

    result = report["variants"] = {}
    with VariantLog() as log:
        t0 = time.perf_counter()
        llm = engine(path, args.smoke)
        result["engine_start_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        llm.engine.runner.warm_up_kernels()  # again if the engine's warm-up ran it: then cheap
        result["warm_up_s"] = time.perf_counter() - t0
        warmed, compiled_warm = log.snapshot(), compiled_variants()
        t0 = time.perf_counter()
        mixed_load(llm, args.smoke)
        result["load_s"] = time.perf_counter() - t0
        added = {k: len(v - warmed.get(k, frozenset())) for k, v in log.snapshot().items()}
    compiled = compiled_variants()
    result.update(keys_after_warm_up={k: len(v) for k, v in warmed.items()}, keys_added_by_load=added,
                  compiled_after_warm_up=compiled_warm, compiled_after_load=compiled)
    print(f"  engine start {result['engine_start_s']:.1f} s, warm-up call {result['warm_up_s']:.1f} s, "
          f"load {result['load_s']:.1f} s")
    print(f"  variant keys after warm-up {sum(map(len, warmed.values()))}, added by the load {sum(added.values())}; "
          f"compiled after warm-up {sum(compiled_warm.values())}, after the load {sum(compiled.values())}")
    del llm
    if any(added.values()) or compiled != compiled_warm:
        raise RuntimeError(f"the load compiled new variants: keys {added}, caches {compiled_warm} -> {compiled}")
    if torch.cuda.is_available() and sum(compiled.values()) != log.count():
        raise RuntimeError(f"computed keys ({log.count()}) differ from compiled variants ({compiled})")


def check_memory(args, report, path):
    """With CUDA graphs (the default) and with --enforce-eager: the profiled peak (and the
    graphs' reserve) must cover what serving the worst load then allocates besides the pool."""
    if not torch.cuda.is_available():
        report["memory"] = "skipped: needs CUDA"
        print("  skipped: needs CUDA")
        return
    report["memory"] = {}
    over = [mode for mode in ("graphs", "eager") if not memory_in_profile(args, report["memory"], path, mode)]
    if over:
        raise RuntimeError(f"serving went past the profiled peak ({', '.join(over)})")


def memory_in_profile(args, report, path, mode: str) -> bool:
    from pageserve.runtime.model_runner import ModelRunner, kv_block_bytes
    from pageserve.runtime.synthetic_steps import WORST_CASE_PARAMS

    gc.collect()
    torch.cuda.empty_cache()
    steps = []  # per step: what it held, allocated before it, the running peak after it
    real_execute = ModelRunner.execute

    def traced(runner, out):
        before = torch.cuda.memory_allocated()
        result = real_execute(runner, out)
        steps.append((len(out.requests), out.num_tokens, sum(r.sampling_params.logprobs is not None
                                                             for r in out.requests),
                      before, torch.cuda.max_memory_allocated()))
        return result
    ModelRunner.execute = traced
    try:
        llm = engine(path, args.smoke, kv_cache_memory=None, gpu_memory_utilization=0.95, max_num_seqs=256,
                     max_num_batched_tokens=2048, enforce_eager=mode == "eager")
    finally:
        ModelRunner.execute = real_execute
    runner, config = llm.engine.runner, llm.engine.config
    start_steps, steps[:] = list(steps), []
    ModelRunner.execute = traced
    free, total = torch.cuda.mem_get_info()
    pool = config.cache.num_blocks * kv_block_bytes(config.model, config.cache.block_size)
    at_rest = torch.cuda.memory_allocated() - pool  # weights and what start-up keeps
    worst = dataclasses.replace(WORST_CASE_PARAMS, max_tokens=4, ignore_eos=True)  # every sampling path
    t0 = time.perf_counter()
    peaks = []
    try:
        for prompts in ([[3 + i % 900] * 8 for i in range(256)], [list(range(100, 2100))]):
            torch.cuda.reset_peak_memory_stats()
            llm.generate([{"prompt_token_ids": p} for p in prompts], worst, use_tqdm=False)
            peaks.append(torch.cuda.max_memory_allocated() - pool)
    finally:
        ModelRunner.execute = real_execute
    serving_peak = max(peaks)
    result = report[mode] = {
        "total_gib": total / GiB, "free_after_start_gib": free / GiB, "kv_pool_gib": pool / GiB,
        "profiled_peak_gib": runner.profiled_peak / GiB, "graph_pool_gib": runner.profiled_graph_pool / GiB,
        "at_rest_gib": at_rest / GiB, "serving_peaks_gib": [p / GiB for p in peaks],
        "serving_peak_gib": serving_peak / GiB,
        "reserved_peak_fraction": torch.cuda.max_memory_reserved() / total, "load_s": time.perf_counter() - t0,
        # (requests, tokens, requests with logprobs, allocated before, peak so far after): start-up
        # (the profile with its temporary cache, then warm-up) and serving
        "start_steps": start_steps, "serving_steps": list(steps)}
    print(f"  {mode}: 0.95 of {total / GiB:.1f} GiB: KV pool {pool / GiB:.1f} GiB; besides the pool: at rest "
          f"{result['at_rest_gib']:.2f} GiB, profiled peak {result['profiled_peak_gib']:.2f} GiB + "
          f"{result['graph_pool_gib']:.2f} GiB for CUDA graphs, serving peaks "
          f"{', '.join(f'{p / GiB:.2f}' for p in peaks)} GiB (256 short prompts, one of 2000 tokens); "
          f"reserved peak {result['reserved_peak_fraction']:.3f} of the device")
    kv = runner._kv_storage.untyped_storage().data_ptr()
    big = sorted(((t.numel() * t.element_size(), tuple(t.shape), str(t.dtype)) for t in gc.get_objects()
                  if type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_cuda
                  and t.numel() * t.element_size() >= 32 << 20 and t.untyped_storage().data_ptr() != kv),
                 reverse=True)
    result["tensors_at_rest"] = big[:12]
    for name, rows in (("start-up", start_steps), ("serving", steps)):
        print(f"    {name} steps (requests, tokens, with logprobs: allocated before -> peak so far, GiB): " +
              "; ".join(f"{n}, {t}, {lp}: {b / GiB:.2f} -> {m / GiB:.2f}" for n, t, lp, b, m in rows[:14]))
    print("    tensors of 32 MiB and more at rest besides the KV pool: " + "; ".join(f"{s} {d} {b / GiB:.2f} GiB" for b, s, d in big[:12]))
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    return serving_peak <= (result["profiled_peak_gib"] + result["graph_pool_gib"]) * GiB + 64 * (1 << 20)


def check_swap(args, report, device):
    from pageserve.runtime.device import device_for
    from pageserve.runtime.kv_swap import KVSwapper

    layers, blocks, n = (2, 64, 16) if args.smoke else (24, 4096, 2048)
    kv = torch.randn(layers, 2, blocks, 2, 16, 64, device=device, dtype=torch.bfloat16)
    dev = device_for(device)
    swapper = KVSwapper(kv, n, dev)
    pairs = [(b, b) for b in range(n)]
    size = 512 if args.smoke else 8192
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)

    def compute():
        for _ in range(4 if args.smoke else 10):
            a @ a

    def timed(fn):
        dev.synchronize()
        t0 = time.perf_counter()
        fn()
        dev.synchronize()
        return time.perf_counter() - t0

    timed(compute)  # first-use costs out of the way
    timed(lambda: swapper.swap(pairs, []))
    t_copy = timed(lambda: swapper.swap(pairs, []))
    t_compute = timed(compute)
    t_both = timed(lambda: (swapper.swap(pairs, []), compute()))
    before = kv[:, :, :n].clone()
    kv[:, :, :n] = 0
    swapper.swap([], [(s, d) for d, s in pairs])
    swapper.wait_ready()
    same = torch.equal(kv[:, :, :n], before)
    nbytes = n * kv[:, :, 0].numel() * kv.element_size()
    # 1: the shorter of the two hid entirely behind the other; 0: they ran one after the other
    overlap = (t_copy + t_compute - t_both) / min(t_copy, t_compute) if device.type == "cuda" else None
    report["swap"] = {"blocks": n, "bytes": nbytes, "d2h_gb_s": nbytes / t_copy / 1e9, "copy_s": t_copy,
                      "compute_s": t_compute, "both_s": t_both, "overlap": overlap, "round_trip_same": same}
    print(f"  swap-out of {nbytes / GiB:.2f} GiB: {t_copy * 1e3:.1f} ms ({nbytes / t_copy / 1e9:.1f} GB/s); "
          f"compute {t_compute * 1e3:.1f} ms; both {t_both * 1e3:.1f} ms: overlap "
          f"{'n/a on CPU' if overlap is None else f'{overlap:.2f}'}; round trip {'unchanged' if same else 'CHANGED'}")
    if not same:
        raise RuntimeError("blocks changed on their way through the swap space")
    if overlap is not None and overlap < 0.5:
        raise RuntimeError("swap-outs do not overlap compute")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    device = check_device(args.smoke)
    if device is None:
        return 2
    report = {"failed": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = qwen_like(Path(tmp), TINY if args.smoke else QWEN_05B)
        checks = {"variants": lambda: check_variants(args, report, path),
                  "memory": lambda: check_memory(args, report, path),
                  "swap": lambda: check_swap(args, report, device)}
        for name, check in checks.items():
            print(f"- {name}", flush=True)
            try:
                check()
            except Exception:
                traceback.print_exc()
                report["failed"].append(name)
    (Path(args.out) / "gpu_readiness.json").write_text(json.dumps(report, indent=2, default=str))
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
