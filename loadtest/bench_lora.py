"""Multi-LoRA decode on the default model: a batch of 64 requests spread over 8 different rank-16
adapters (all seven target modules) against the same 64 requests on the base model alone, in
the same run and the same engine, rounds alternated (the machine drifts). A decode step's time
is the difference of two generations (4 and 4 + N tokens after the prompts) over N, so that the
prefills are not in it. Also printed: the engine's start-up with --enable-lora, each adapter's
read from disk, and its copy into a slot (its first one-token request less the base model's).

The adapters are random, written once under $PAGESERVE_CACHE/lora in PEFT's layout.

    pageserve bench lora [--rounds 5] [--tokens 32] [--batch 64] [--adapters 8] [--output-json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pageserve.loadtest.common import provenance, save_json
from pageserve.loadtest.tiny_lora import model_shapes, write_adapter
from pageserve.runtime.models.loader import cache_root, resolve_model


def adapters(model_dir: Path, count: int, rank: int) -> list[Path]:
    config = json.loads((model_dir / "config.json").read_text())
    root = cache_root() / "lora"
    out = []
    for i in range(count):
        path = root / f"{model_dir.name}-r{rank}-{i}"
        if not (path / "adapter_model.safetensors").is_file():
            write_adapter(path, model_shapes(config), config["num_hidden_layers"], rank=rank, seed=i)
        out.append(path)
    return out


def step_ms(llm, prompts, loras, tokens: int) -> float:
    from pageserve.runtime import SamplingParams

    times = []
    for n in (4, 4 + tokens):
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False,
                     lora_request=loras)
        times.append(time.perf_counter() - t)
    return (times[1] - times[0]) / tokens * 1e3


def add_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=32, help="decode steps measured per round")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--output-json", default=None)
    return p


def main(args: argparse.Namespace) -> dict:
    from pageserve.runtime import LLM, LoRARequest, SamplingParams

    model_dir = resolve_model(None)
    paths = adapters(model_dir, args.adapters, args.rank)
    t = time.perf_counter()
    llm = LLM(str(model_dir), dtype=args.dtype, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
              max_num_seqs=args.batch, kv_cache_memory=0.5, max_model_len=1024, enable_prefix_caching=False)
    startup = time.perf_counter() - t
    loras = [LoRARequest(f"bench-{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    one = SamplingParams(temperature=0, max_tokens=1)
    read, fill = [], []
    for lora in loras:  # read, then its first one-token request (the slot copy) against the base model's
        t = time.perf_counter()
        llm.engine.add_lora(lora)
        t1 = time.perf_counter()
        llm.generate([[5, 6, 7]], one, use_tqdm=False, lora_request=lora)
        t2 = time.perf_counter()
        llm.generate([[5, 6, 8]], one, use_tqdm=False)
        read.append(t1 - t)
        fill.append((t2 - t1) - (time.perf_counter() - t2))
    prompts = [[(37 * i + 11 * j) % 4000 + 100 for j in range(24)] for i in range(args.batch)]
    arms = {"base": [None] * args.batch, "adapters": [loras[i % len(loras)] for i in range(args.batch)]}
    for arm in arms.values():
        step_ms(llm, prompts, arm, 4)  # warm-up
    runs: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, arm in arms.items():
            runs[name].append(step_ms(llm, prompts, arm, args.tokens))
    base, mixed = statistics.median(runs["base"]), statistics.median(runs["adapters"])
    result = {"machine": {**provenance(), "threads": torch.get_num_threads()},
              "dtype": str(llm.engine.config.model.dtype), "bf16_matmuls": llm.engine.config.model.bf16_matmuls,
              "batch": args.batch, "adapters": args.adapters, "rank": args.rank, "tokens": args.tokens,
              "rounds": args.rounds, "startup_s": startup, "adapter_read_s": read, "adapter_slot_copy_s": fill,
              "step_ms": runs, "step_ms_median": {"base": base, "adapters": mixed}, "ratio": mixed / base}
    print(f"engine start-up with --enable-lora: {startup:.1f} s; adapter read from disk: "
          f"{statistics.median(read) * 1e3:.0f} ms median ({max(read) * 1e3:.0f} max); copy into a slot (its first "
          f"one-token request less the base model's): {statistics.median(fill) * 1e3:.0f} ms median")
    print(f"{args.batch} requests a decode step, {args.adapters} adapters of rank {args.rank}:")
    for name in arms:
        print(f"  {name:<9} {statistics.median(runs[name]):8.2f} ms a step (median)   "
              f"all rounds: {' '.join(f'{x:.2f}' for x in runs[name])}")
    print(f"  adapters / base: {mixed / base:.2f}x (target <= 1.3x)")
    return save_json(result, args.output_json)


if __name__ == "__main__":
    main(add_args(argparse.ArgumentParser(description=__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)).parse_args())
