"""nano-vllm's offline benchmark on our engine (`pageserve bench offline --dataset nano`).

Its workload: sequences of random token ids, prompt and output lengths uniform in 100..1024, every
output run to its length (ignore_eos), one `generate` call timed. Its figure is the output tokens
over that time; prompt + output tokens over the same time stand beside it. Seed 0 with a
vocabulary past 10,000 ids runs exactly the lists nano-vllm's bench.py draws."""

from __future__ import annotations

import gc
import json
import random
import subprocess
import time
from pathlib import Path
from typing import Callable

import torch

from pageserve.loadtest.common import distinct_prompts, provenance
from pageserve.loadtest.model_shapes import shape_of

MAX_TOKEN_ID = 10000  # nano-vllm draws ids in 0..10000
# --smoke: seconds on a CPU
SMOKE = {"num_seqs": 8, "min_len": 8, "max_len": 32, "shape": "tiny", "kv_cache_memory": 0.05}
# the figures to stand beside: Qwen2.5-0.5B on this workload, and ours on an H200
PUBLIC_FIGURES = {
    "model": "Qwen2.5-0.5B", "hardware": "NVIDIA A800",
    "vllm_output_tok_s": 17700, "nano_vllm_triton_output_tok_s": 24100,
    "target": {"hardware": "NVIDIA H200", "output_tok_s": 30000},
}


def nano_workload(num_seqs: int, min_len: int, max_len: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """(prompts as token ids in 0..MAX_TOKEN_ID, output lengths), drawn in nano-vllm's order."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= --min-len ({min_len}) <= --max-len ({max_len})")
    rng = random.Random(seed)
    prompts = [[rng.randint(0, MAX_TOKEN_ID) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_seqs)]
    return prompts, [rng.randint(min_len, max_len) for _ in range(num_seqs)]


def _nvidia_driver() -> str | None:
    """The NVIDIA driver's version, as nvidia-smi reports it (None without it)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


def device_info(device: torch.device) -> dict:
    """The GPU (driver and CUDA versions) or the CPU model, and the torch and Triton versions."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    info = {"type": device.type, "torch": torch.__version__, "triton": triton_version}
    if device.type == "cuda":
        return {**info, "name": torch.cuda.get_device_name(device), "driver": _nvidia_driver(),
                "cuda": torch.version.cuda}
    return {**info, "name": provenance()["cpu"]}


def _time_steps(engine, event: Callable | None = None) -> list[list]:
    """Times each engine step from here on: [requests, tokens, seconds, device events] of the
    step scheduled in it (under async scheduling a call also collects the step before).
    `event`: where given (torch.cuda.Event on a GPU), a pair of timing events brackets the
    device's work of the step's execution: from its inputs on the device to its sampled tokens
    (read after the run, so that nothing waits for them while it runs)."""
    timeline, step, schedule = [], engine.step, engine.scheduler.schedule
    scheduled, events = [], []

    def spied_schedule(*args):
        out = schedule(*args)
        scheduled.append((len(out.requests), out.num_tokens))
        return out

    def timed_step():
        scheduled.clear()
        events.clear()
        t0 = time.perf_counter()
        outs = step()
        timeline.append([*(scheduled[-1] if scheduled else (0, 0)), time.perf_counter() - t0, list(events)])
        return outs
    engine.step, engine.scheduler.schedule = timed_step, spied_schedule
    if event is not None:
        runner = engine.runner
        prepare, execute = runner._prepare, runner.execute

        def marked_prepare(*args):
            inputs = prepare(*args)
            events.append(event(enable_timing=True))
            events[-1].record()
            return inputs

        def marked_execute(*args):
            result = execute(*args)
            if len(events) % 2:  # it prepared inputs: a forward ran
                events.append(event(enable_timing=True))
                events[-1].record()
            return result
        runner._prepare, runner.execute = marked_prepare, marked_execute
    return timeline


def _untime_steps(engine) -> None:
    """The classes' methods again."""
    for obj, names in ((engine, ("step",)), (engine.scheduler, ("schedule",)), (engine.runner, ("_prepare", "execute"))):
        for name in names:
            obj.__dict__.pop(name, None)


def _summarize_steps(timeline) -> dict:
    """Step counts and mean milliseconds: steps with a prompt chunk, decode-only steps by
    number of requests, and steps that ran no request; with device events, the device's mean milliseconds from a step's
    inputs to its sampled tokens too (a step's wall time well above it: the host is the bound)."""
    kinds: dict[str, list] = {}
    for requests, tokens, seconds, events in timeline:
        if not requests:  # ran no forward (async scheduling's last collection): not a decode step
            kind = "no requests"
        elif tokens > requests:
            kind = "with prompts"
        else:
            kind = next(f"decode <= {b}" for b in (16, 64, 128, 192, 256, 10 ** 9) if requests <= b)
        kinds.setdefault(kind, []).append((seconds, events))
    summary = {}
    for kind, steps in kinds.items():
        seconds = [s for s, _ in steps]
        summary[kind] = {"steps": len(steps), "mean_ms": 1e3 * sum(seconds) / len(steps), "total_s": sum(seconds)}
        device = [sum(e[i].elapsed_time(e[i + 1]) for i in range(0, len(e) - 1, 2)) for _, e in steps if len(e) >= 2]
        if device:
            summary[kind]["device_mean_ms"] = sum(device) / len(device)
    return summary


def run(args) -> dict:
    """Warm up, then time one `generate` over the whole workload; the result for the JSON."""
    from pageserve.runtime import LLM, SamplingParams

    prompts, out_lens = nano_workload(args.num_seqs, args.min_len, args.max_len, args.seed)
    llm = LLM(model=args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=2 * args.max_len, seed=args.seed, enforce_eager=args.enforce_eager,
              async_scheduling=args.async_scheduling,
              device="cpu" if args.smoke else "auto")
    cfg = llm.engine.config
    if cfg.model.vocab_size <= MAX_TOKEN_ID:  # a small model: ids wrap around its vocabulary, lengths stay
        prompts = [[t % cfg.model.vocab_size for t in p] for p in prompts]
    # nano-vllm warms up with one request; a few reach the batched paths, none fills a cached block
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(distinct_prompts(cfg.model.vocab_size, 4, 8), warm, use_tqdm=False)
    llm.engine.reset_stats()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    graphs = llm.engine.runner.graphs
    replays = graphs.replays if graphs is not None else 0
    timeline = _time_steps(llm.engine, torch.cuda.Event if cfg.device.device.type == "cuda" else None)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    replays = graphs.replays - replays if graphs is not None else 0
    _untime_steps(llm.engine)
    if cfg.device.device.type == "cuda":
        torch.cuda.synchronize()  # the timing events are all done
    prompt_tokens = sum(map(len, prompts))
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if output_tokens != sum(out_lens):  # nano-vllm counts what was asked for: the same, or no figure
        raise RuntimeError(f"asked for {sum(out_lens)} output tokens, got {output_tokens}")
    dtype = "bfloat16" if cfg.model.bf16_matmuls else str(cfg.model.dtype).removeprefix("torch.")
    config = json.loads((Path(cfg.model.path) / "config.json").read_text())
    result = {"workload": "nano-vllm offline bench", "model": str(cfg.model.path), "shape": args.shape,
              "model_shape": shape_of(config), "dtype": dtype,
              "device": device_info(cfg.device.device), "seed": args.seed, "num_seqs": args.num_seqs,
              "min_len": args.min_len, "max_len": args.max_len, "prompt_tokens": prompt_tokens,
              "output_tokens": output_tokens, "seconds": seconds,
              "output_tok_s": output_tokens / seconds, "total_tok_s": (prompt_tokens + output_tokens) / seconds,
              "steps": llm.engine.stats().steps, "enforce_eager": args.enforce_eager,
              "async_scheduling": cfg.scheduler.async_scheduling, "graph_replays": replays,
              "steps_by_kind": _summarize_steps(timeline),
              "public_figures": PUBLIC_FIGURES}
    del llm, cfg, outs, graphs
    gc.collect()  # the engine is cyclic garbage: its KV pool goes now, before whatever runs next
    return result


def print_summary(r: dict) -> None:
    """The figures, and the public ones beside them."""
    dev, pub = r["device"], r["public_figures"]
    print(f"\n== nano-vllm workload: {r['shape'] or r['model']} ({r['dtype']}, {dev['name']}) ==")
    print(f"{r['num_seqs']} sequences, {r['min_len']}..{r['max_len']} tokens in and out (seed {r['seed']}): "
          f"{r['prompt_tokens']} prompt + {r['output_tokens']} output tokens in {r['seconds']:.2f} s, "
          f"{r['steps']} steps ({r['graph_replays']} from CUDA graphs), "
          f"async scheduling {'on' if r['async_scheduling'] else 'off'}")
    print("  steps: " + "; ".join(
        f"{k}: {v['steps']} x {v['mean_ms']:.2f} ms = {v['total_s']:.2f} s"
        + (f" (device {v['device_mean_ms']:.2f} ms)" if "device_mean_ms" in v else "")
        for k, v in r["steps_by_kind"].items()))
    print(f"output: {r['output_tok_s']:,.0f} tok/s (nano-vllm's figure); prompt + output: {r['total_tok_s']:,.0f} tok/s")
    print(f"beside: {pub['model']} on an {pub['hardware']}: vLLM {pub['vllm_output_tok_s']:,}, nano-vllm-triton "
          f"{pub['nano_vllm_triton_output_tok_s']:,} tok/s; target on an {pub['target']['hardware']}: "
          f"{pub['target']['output_tok_s']:,} tok/s")
