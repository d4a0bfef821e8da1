"""Offline throughput: our engine vs. Hugging Face transformers `generate` on one synthetic workload
(`--dataset nano`: nano-vllm's benchmark on our engine alone, loadtest/bench_nano.py).

Both run the same random prompts (random token ids, fixed seed) with greedy decoding and a fixed
number of output tokens each. HF runs static batches in prompt order; its throughput counts only the
tokens each request asked for, not the padding tokens a batch decodes for its shorter members.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import time
from pathlib import Path

import torch

from pageserve.loadtest import bench_nano, machine_limits
from pageserve.loadtest.common import save_json
from pageserve.loadtest.model_shapes import SHAPES, build_shape

GiB = 1 << 30


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=None, help="model directory or .gguf (default: the default model)")
    parser.add_argument("--shape", default=None, choices=list(SHAPES),
                        help="instead of --model: random weights of this model's shape, built once into the cache")
    parser.add_argument("--dataset", default="random", choices=["random", "nano"],
                        help="random: ours against HF on --num-prompts; nano: nano-vllm's bench, ours only")
    parser.add_argument("--num-seqs", type=int, default=256, help="--dataset nano: sequences")
    parser.add_argument("--min-len", type=int, default=100, help="--dataset nano: shortest prompt and output")
    parser.add_argument("--max-len", type=int, default=1024, help="--dataset nano: longest prompt and output")
    parser.add_argument("--smoke", action="store_true",
                        help="--dataset nano in seconds on the CPU: {num_seqs} sequences of {min_len}..{max_len} "
                             "tokens, the {shape} shape".format(**bench_nano.SMOKE))
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto: what the engine picks for this machine (HF then loads the same)")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--min-prompt-len", type=int, default=32)
    parser.add_argument("--max-prompt-len", type=int, default=512)
    parser.add_argument("--min-output-len", type=int, default=16)
    parser.add_argument("--max-output-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--skip-hf", action="store_true", help="run only our engine")
    parser.add_argument("--hf-num-prompts", type=int, default=None,
                        help="run HF on the first N prompts only (default: all) and compare tokens/s")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-memory", type=float, default=None,
                        help="GiB for the KV pool (default: 4 on CPU; on CUDA, what --gpu-memory-utilization leaves)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="schedule each step while the one before runs (the engine's --async-scheduling; "
                             "default: the engine's, on CUDA with one rank)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="torch's own ops only (no C kernels on CPU): the A side of an A/B")
    parser.add_argument("--skip-limits", action="store_true",
                        help="do not measure the machine's limits (bandwidth, matmul time) beside the run")
    parser.add_argument("--output-json", default=None, metavar="PATH")
    return parser


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def make_workload(args, vocab_size: int, special_ids) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request, the same for a given seed and vocabulary."""
    rng = random.Random(args.seed)
    special = set(special_ids)
    allowed = [t for t in range(vocab_size) if t not in special]
    work = []
    for _ in range(args.num_prompts):
        n = rng.randint(args.min_prompt_len, args.max_prompt_len)
        work.append(([rng.choice(allowed) for _ in range(n)],
                     rng.randint(args.min_output_len, args.max_output_len)))
    return work


def run_ours(args, llm, work) -> dict:
    from pageserve.runtime import SamplingParams

    # warm-up: first-call allocations and lazy inits stay out of the timing
    tiny = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([[1, 2, 3], [4, 5, 6, 7]], [tiny, tiny], use_tqdm=False)
    llm.engine.reset_stats()
    kv = llm.engine.runner._kv_storage
    pool = kv.numel() * kv.element_size()
    rss0 = rss_bytes()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params, use_tqdm=True)
    elapsed = time.perf_counter() - t0
    rss1 = rss_bytes()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = llm.engine.stats()
    return {"output_tokens": tokens, "elapsed_s": elapsed, "tokens_per_s": tokens / elapsed,
            "steps": stats.steps, "kv_waste": stats.kv_waste, "kv_pool_bytes": pool,
            "rss_after_warmup_bytes": rss0, "rss_after_bench_bytes": rss1,
            "rss_growth_of_pool": (rss1 - rss0) / pool}


def run_hf(args, path: str, device: torch.device, work) -> dict:
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(os.cpu_count() or 1)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    from pageserve.runtime.models.gguf_file import dense_copy

    model = AutoModelForCausalLM.from_pretrained(dense_copy(Path(path)), dtype=getattr(torch, args.dtype))
    model = model.to(device).eval()
    with torch.inference_mode():  # warm-up, as for our engine
        model.generate(torch.tensor([[1, 2, 3]], device=device), max_new_tokens=2, do_sample=False,
                       pad_token_id=tok.pad_token_id)
    useful = 0
    t0 = time.perf_counter()
    for i in tqdm(range(0, len(work), args.hf_batch_size), desc="HF batches", unit="batch"):
        batch = work[i:i + args.hf_batch_size]
        enc = tok.pad({"input_ids": [p for p, _ in batch]}, return_tensors="pt").to(device)
        n = max(o for _, o in batch)
        # min_new_tokens == max_new_tokens keeps EOS from ending a row early: HF's ignore_eos
        with torch.inference_mode():
            model.generate(**enc, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                           pad_token_id=tok.pad_token_id)
        useful += sum(o for _, o in batch)
    elapsed = time.perf_counter() - t0
    return {"num_prompts": len(work), "useful_tokens": useful, "elapsed_s": elapsed,
            "tokens_per_s": useful / elapsed}


def main(args: argparse.Namespace) -> dict:
    from pageserve.runtime import LLM

    if args.smoke:
        if args.dataset != "nano" or args.model:
            raise SystemExit("--smoke runs --dataset nano on its own tiny shape (no --model)")
        vars(args).update(bench_nano.SMOKE)
    if args.shape:
        if args.model:
            raise SystemExit("give --model or --shape, not both")
        args.model = str(build_shape(args.shape))
    if args.dataset == "nano":
        result = bench_nano.run(args)
        bench_nano.print_summary(result)
        return save_json(result, args.output_json)
    for what in ("prompt", "output"):
        lo, hi = getattr(args, f"min_{what}_len"), getattr(args, f"max_{what}_len")
        if not 1 <= lo <= hi:
            raise SystemExit(f"need 1 <= --min-{what}-len ({lo}) <= --max-{what}-len ({hi})")
    llm = LLM(model=args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              seed=args.seed, enforce_eager=args.enforce_eager)
    cfg = llm.engine.config
    # HF loads what the engine runs (bfloat16 matmuls: HF's bfloat16)
    args.dtype = "bfloat16" if cfg.model.bf16_matmuls else str(cfg.model.dtype).removeprefix("torch.")
    vocab = min(cfg.model.vocab_size, len(llm.tokenizer))  # ids both the model and the tokenizer know
    work = make_workload(args, vocab, llm.tokenizer.all_special_ids)
    result = {"model": cfg.model.path, "dtype": args.dtype, "device": str(cfg.device.device),
              "enforce_eager": args.enforce_eager,
              "num_prompts": len(work), "prompt_tokens": sum(len(p) for p, _ in work),
              "ours": run_ours(args, llm, work), "hf": None,
              "limits": None if args.skip_limits else machine_limits.measure(llm)}
    path, device = cfg.model.path, cfg.device.device
    del llm, cfg
    gc.collect()
    if not args.skip_hf:
        n = args.hf_num_prompts or len(work)
        result["hf"] = run_hf(args, path, device, work[:n])
    print_summary(result)
    return save_json(result, args.output_json)


def print_summary(r: dict) -> None:
    ours, hf = r["ours"], r["hf"]
    eager = ", --enforce-eager" if r.get("enforce_eager") else ""
    print(f"\n== offline bench: {r['model']} ({r['dtype']}, {r['device']}{eager}) ==")
    print(f"requests: {r['num_prompts']}, prompt tokens: {r['prompt_tokens']}")
    print(f"ours: {ours['output_tokens']} output tokens in {ours['elapsed_s']:.2f} s "
          f"= {ours['tokens_per_s']:.1f} tok/s ({ours['steps']} steps)")
    if hf is not None:
        subset = "" if hf["num_prompts"] == r["num_prompts"] else (
            f" [HF ran only the first {hf['num_prompts']} of {r['num_prompts']} prompts;"
            " its tok/s is taken as the rate for all]")
        print(f"HF:   {hf['useful_tokens']} useful tokens in {hf['elapsed_s']:.2f} s "
              f"= {hf['tokens_per_s']:.1f} tok/s{subset}")
        print(f"ratio ours/HF: {ours['tokens_per_s'] / hf['tokens_per_s']:.2f}x")
    for line in machine_limits.summary(r["limits"]) if r.get("limits") else ():
        print(line)
    print(f"KV waste: {ours['kv_waste'] * 100:.1f}% of allocated slots (mean over steps)")
    print(f"KV pool: {ours['kv_pool_bytes'] / GiB:.3f} GiB")
    print(f"RSS: {ours['rss_after_warmup_bytes'] / GiB:.3f} GiB after warm-up, "
          f"{ours['rss_after_bench_bytes'] / GiB:.3f} GiB after bench, "
          f"growth {ours['rss_growth_of_pool'] * 100:.1f}% of the pool")


if __name__ == "__main__":
    main(add_args(argparse.ArgumentParser(description=__doc__)).parse_args())
