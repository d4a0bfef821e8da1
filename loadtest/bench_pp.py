"""Pipeline parallelism on one machine: tokens per second of N concurrent requests with the
layers in P stages, one batch in flight against P batches in flight, in one run, rounds
alternated; one process with every core beside them for scale.

With one batch in flight a stage waits while the others compute, so P stages of one core each
do no better than one core; with P batches in flight every stage has a step to run. On CPU the
stages share the machine's cores (cores / P threads each), so this measures what the batch
queue buys, not a speed-up over one process: pipeline parallelism pays off across machines,
for models larger than one machine's memory."""

from __future__ import annotations

import argparse
import statistics
import time

from pageserve.loadtest.common import save_json

TEXT = ("Paged attention keeps the key-value cache in fixed-size blocks, so requests of any length share "
        "one pool and a prefix is computed once. ")


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages")
    parser.add_argument("--streams", type=int, default=16, help="concurrent requests")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--output-json", default=None, metavar="PATH")
    return parser


def tokens_per_second(llm, streams: int, max_tokens: int, salt: int) -> float:
    """Output tokens / wall time of `streams` requests generated together (prompts of about 60
    tokens, distinct per round so that no prefix is cached)."""
    from pageserve.runtime import SamplingParams

    prompts = [f"{salt}-{i}: " + TEXT * 2 for i in range(streams)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds


def main(args: argparse.Namespace) -> dict:
    from pageserve.runtime import LLM

    arms = {"one process": dict(),
            f"PP {args.pp}, 1 batch in flight": dict(pipeline_parallel_size=args.pp, max_batches_in_flight=1),
            f"PP {args.pp}, {args.pp} batches in flight": dict(pipeline_parallel_size=args.pp,
                                                               max_batches_in_flight=args.pp)}
    engines = {}
    try:
        for name, kw in arms.items():
            engines[name] = LLM(args.model, dtype=args.dtype, max_model_len=1024, swap_space=0, kv_cache_memory=0.5, **kw)
            tokens_per_second(engines[name], args.streams, 8, salt=-1)  # first use
        rates: dict[str, list[float]] = {name: [] for name in arms}
        for r in range(args.rounds):
            for name, llm in engines.items():
                rates[name].append(tokens_per_second(llm, args.streams, args.max_tokens, salt=r))
            print(f"round {r + 1}: " + ", ".join(f"{name} {rates[name][-1]:.1f} tok/s" for name in arms), flush=True)
    finally:
        for llm in engines.values():
            llm.engine.shutdown()
    one, many = f"PP {args.pp}, 1 batch in flight", f"PP {args.pp}, {args.pp} batches in flight"
    per_round = [b / a for a, b in zip(rates[one], rates[many])]
    print(f"{args.streams} streams, {args.max_tokens} tokens each: {many} / {one} = "
          + ", ".join(f"{x:.2f}x" for x in per_round) + f" (median {statistics.median(per_round):.2f}x)")
    result = {"streams": args.streams, "max_tokens": args.max_tokens, "pp": args.pp, "dtype": args.dtype,
              "model": args.model or "default", "tok_per_s": rates, "in_flight_ratio_per_round": per_round}
    if args.output_json:
        save_json(result, args.output_json)
    return result


if __name__ == "__main__":
    main(add_args(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args())
