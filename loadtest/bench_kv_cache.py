"""The KV cache's dtype on a CPU: --kv-cache-dtype auto (bfloat16 where the C kernels multiply in
bfloat16) against float32, or any two (`--arms`). Two engines of the same model side by side in
one process: the tokens each pool holds in the same memory, the decode step of N requests with
long contexts, and the time to the first token of one long prompt, in alternated rounds (the
machine drifts), medians. Both arms run the same arithmetic; only what the cache holds differs.

    python -m pageserve.loadtest.bench_kv_cache [--model M] [--arms auto,float32] [--requests 64]
        [--context 600] [--rounds 5] [--steps 8] [--long-prompt 3000] [--output-json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from pageserve.runtime import SamplingParams
from pageserve.runtime.config import cpu_flags
from pageserve.runtime.engine import LLMEngine
from pageserve.runtime.engine_args import EngineArgs
from pageserve.sampling.params import RequestOutputKind


def engine_for(model: str | None, kv_cache_dtype: str, args) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(
        model=model, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=args.requests, max_model_len=max(args.context, args.long_prompt) + 512,
        enable_prefix_caching=False))


def fill(engine: LLMEngine, args) -> None:
    """`requests` requests with prompts of `context` tokens, all past their prompts."""
    rng = random.Random(0)
    # none finishes while the rounds run: each step the same batch
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    for _ in range(args.requests):
        engine.add_request([rng.randrange(100, 40000) for _ in range(args.context)], params)
    s = engine.scheduler
    while s.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in s.running):
        engine.step()


def decode_steps(engine: LLMEngine, steps: int) -> float:
    """ms a decode step of the filled engine"""
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps * 1e3


def first_token(engine: LLMEngine, ids: list[int]) -> float:
    """ms to the first token of one prompt on an idle engine"""
    rid = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True,
                                                 output_kind=RequestOutputKind.FINAL_ONLY))
    start = time.perf_counter()
    while not any(o.request_id == rid and o.finished for o in engine.step()):
        pass
    return (time.perf_counter() - start) * 1e3


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--arms", default="auto,float32", help="two --kv-cache-dtype values; ratios are first / second")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--context", type=int, default=600, help="each decoding request's prompt, tokens")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed a round")
    ap.add_argument("--long-prompt", type=int, default=3000, help="tokens of the prompt timed to its first token")
    ap.add_argument("--kv-cache-memory", type=float, default=2.5, help="GiB for each engine's pool")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    first, second = args.arms.split(",")
    arms = {name: engine_for(args.model, name, args) for name in (first, second)}
    result = {"cpu": "avx512_bf16" if "avx512_bf16" in cpu_flags() else "avx512f" if "avx512f" in cpu_flags()
              else "avx2", "args": vars(args), "arms": {}}
    for name, engine in arms.items():
        cfg = engine.config
        result["arms"][name] = {"kv_cache_dtype": str(cfg.model.kv_cache_dtype).removeprefix("torch."),
                                "bf16_matmuls": cfg.model.bf16_matmuls,
                                "pool_tokens": cfg.cache.num_blocks * cfg.cache.block_size,
                                "decode_ms": [], "first_token_ms": []}
    rng = random.Random(1)
    long_ids = [rng.randrange(100, 40000) for _ in range(args.long_prompt)]
    for name, engine in arms.items():  # the long prompt once each first: nothing is compiled or faulted in mid-round
        first_token(engine, long_ids)
    for round_ in range(args.rounds):
        for name in ((first, second) if round_ % 2 == 0 else (second, first)):
            result["arms"][name]["first_token_ms"].append(first_token(arms[name], long_ids))
    for engine in arms.values():
        fill(engine, args)
        assert not engine.scheduler.num_preemptions, "the pool is too small for the decodes: raise --kv-cache-memory"
    for round_ in range(args.rounds):
        for name in ((first, second) if round_ % 2 == 0 else (second, first)):
            result["arms"][name]["decode_ms"].append(decode_steps(arms[name], args.steps))
    a, f = result["arms"][first], result["arms"][second]
    for arm in (a, f):
        arm["decode_ms_median"] = statistics.median(arm["decode_ms"])
        arm["first_token_ms_median"] = statistics.median(arm["first_token_ms"])
    result["ratios"] = {"pool_tokens": a["pool_tokens"] / f["pool_tokens"],
                        "decode_step": a["decode_ms_median"] / f["decode_ms_median"],
                        "first_token": a["first_token_ms_median"] / f["first_token_ms_median"]}
    print(f"CPU: {result['cpu']}; {args.requests} requests of {args.context}-token contexts; "
          f"a {args.long_prompt}-token prompt")
    for name, arm in result["arms"].items():
        print(f"{name:8} KV {arm['kv_cache_dtype']:9} pool {arm['pool_tokens']:7} tokens  decode step "
              f"{arm['decode_ms_median']:7.1f} ms {[round(x, 1) for x in arm['decode_ms']]}  first token "
              f"{arm['first_token_ms_median']:7.0f} ms {[round(x) for x in arm['first_token_ms']]}")
    print(f"{first} / {second}: " + ", ".join(f"{k} {v:.2f}x" for k, v in result["ratios"].items()))
    if args.output_json:
        with open(args.output_json, "w") as fh:
            json.dump(result, fh, indent=1)
    return result


if __name__ == "__main__":
    main()
