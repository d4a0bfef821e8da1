"""Prefix caching and preemption benchmarks, each side measured in the same run.

1. Shared system prompt: requests sharing a long system prompt, each with its own short
   question; mean time to first token with prefix caching on vs off, and the hit rate. Run
   twice: all requests submitted at once (burst), and one at a time (a chat front end).
2. Pool overflow: long prompts into a KV pool that holds only a couple of them; output
   throughput with --preemption-mode swap vs recompute.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pageserve.loadtest.common import save_json

GiB = 1 << 30


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--system-len", type=int, default=1024)
    parser.add_argument("--question-len", type=int, default=32)
    parser.add_argument("--overflow-requests", type=int, default=16)
    parser.add_argument("--overflow-prompt-len", type=int, default=1280)
    parser.add_argument("--overflow-output-len", type=int, default=128)
    parser.add_argument("--overflow-pool", type=float, default=0.07, help="KV pool GiB for part 2")
    parser.add_argument("--skip-prefix", action="store_true")
    parser.add_argument("--skip-overflow", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None, metavar="PATH")
    return parser


def _random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def _ttft(outs) -> float:
    return statistics.mean(o.metrics.time_to_first_token for o in outs)


def bench_prefix(args) -> dict:
    from pageserve.runtime import LLM, SamplingParams

    result = {}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for caching in (True, False):
        llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=caching, seed=args.seed)
        vocab = llm.engine.config.model.vocab_size
        rng = random.Random(args.seed)
        system = _random_ids(rng, args.system_len, vocab)
        prompts = [system + _random_ids(rng, args.question_len, vocab) for _ in range(args.num_requests)]
        side = {}
        # burst: everything at once
        outs = llm.generate(prompts, params, use_tqdm=False)
        side["burst_mean_ttft_s"] = _ttft(outs)
        side["burst_hit_rate"] = llm.engine.stats().prefix_cache_hit_rate
        # one at a time, with a fresh question each (the system prompt stays cached, if on)
        singles = [system + _random_ids(rng, args.question_len, vocab) for _ in range(16)]
        outs = [llm.generate(p, params, use_tqdm=False)[0] for p in singles]
        side["sequential_mean_ttft_s"] = _ttft(outs)
        result["caching_on" if caching else "caching_off"] = side
        del llm
    on, off = result["caching_on"], result["caching_off"]
    result["burst_ttft_ratio"] = off["burst_mean_ttft_s"] / on["burst_mean_ttft_s"]
    result["sequential_ttft_ratio"] = off["sequential_mean_ttft_s"] / on["sequential_mean_ttft_s"]
    return result


def bench_overflow(args) -> dict:
    from pageserve.runtime import LLM, SamplingParams

    result = {}
    for mode in ("swap", "recompute"):
        llm = LLM(args.model, dtype=args.dtype, kv_cache_memory=args.overflow_pool,
                  max_model_len=args.overflow_prompt_len + args.overflow_output_len + 16,
                  preemption_mode=mode, swap_space=1.0, enable_prefix_caching=False, seed=args.seed)
        vocab = llm.engine.config.model.vocab_size
        rng = random.Random(args.seed + 1)
        prompts = [_random_ids(rng, args.overflow_prompt_len, vocab) for _ in range(args.overflow_requests)]
        params = SamplingParams(temperature=0, max_tokens=args.overflow_output_len, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        sched = llm.engine.scheduler
        result[mode] = {"tokens_per_s": tokens / elapsed, "elapsed_s": elapsed,
                        "kv_pool_tokens": llm.engine.config.cache.num_blocks * llm.engine.config.cache.block_size,
                        "preemptions": sched.num_preemptions, "recomputed": sched.num_recomputed,
                        "swapped_out_blocks": sched.num_swapped_out_blocks,
                        "outputs": [o.outputs[0].token_ids for o in outs]}
        del llm
    result["same_outputs"] = result["swap"].pop("outputs") == result["recompute"].pop("outputs")
    result["swap_over_recompute"] = result["swap"]["tokens_per_s"] / result["recompute"]["tokens_per_s"]
    return result


def main(args: argparse.Namespace) -> dict:
    result = {}
    if not args.skip_prefix:
        r = result["prefix"] = bench_prefix(args)
        on, off = r["caching_on"], r["caching_off"]
        print(f"\n== shared {args.system_len}-token system prompt, {args.num_requests} requests "
              f"with {args.question_len}-token questions ==")
        print(f"burst:      mean TTFT {off['burst_mean_ttft_s']:.2f} s without caching, "
              f"{on['burst_mean_ttft_s']:.2f} s with: {r['burst_ttft_ratio']:.1f}x lower; "
              f"hit rate {on['burst_hit_rate'] * 100:.1f}%")
        print(f"sequential: mean TTFT {off['sequential_mean_ttft_s'] * 1000:.0f} ms without caching, "
              f"{on['sequential_mean_ttft_s'] * 1000:.0f} ms with: {r['sequential_ttft_ratio']:.1f}x lower")
    if not args.skip_overflow:
        r = result["overflow"] = bench_overflow(args)
        print(f"\n== pool overflow: {args.overflow_requests} prompts of {args.overflow_prompt_len} tokens, "
              f"{args.overflow_output_len} output tokens each, pool of {r['swap']['kv_pool_tokens']} tokens ==")
        for mode in ("swap", "recompute"):
            m = r[mode]
            print(f"{mode:9s}: {m['tokens_per_s']:.1f} tok/s ({m['elapsed_s']:.1f} s), "
                  f"{m['preemptions']} preemptions ({m['recomputed']} recomputed, "
                  f"{m['swapped_out_blocks']} blocks swapped out)")
        note = "" if r["same_outputs"] or args.dtype == "float32" else (
            " (recomputed KV is rounded differently from the original in reduced precision, so "
            "greedy paths may part; the float32 tests assert identical outputs)")
        print(f"swap / recompute throughput: {r['swap_over_recompute']:.2f}x; "
              f"identical outputs: {r['same_outputs']}{note}")
    return save_json(result, args.output_json)


if __name__ == "__main__":
    main(add_args(argparse.ArgumentParser(description=__doc__)).parse_args())
