"""Decode step time at --tensor-parallel-size 1 against N, same model, same batch, in one run.

Each rank does 1 / N of the matmuls but every layer adds two all-reduces (after o_proj and
down_proj), the embedding one more, the logits a gather, and the step itself a pickle to each
worker's pipe and an answer back. On CPU the ranks share the machine's cores (TP 1 gets all
of them as threads, each rank cores / N), so this measures the cost of splitting, not a
speed-up: on one machine of CPU cores TP only pays off for models larger than one process's
memory. Random-weight models are built here (loadtest/tiny_model.py): the tests' tiny one and
a wider one where matmuls weigh more than the collectives."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from pageserve.loadtest.common import save_json
from pageserve.loadtest.tiny_model import build_tiny_model

SHAPES = {
    "tiny": {},  # 2 layers, hidden 64, 4 heads / 2 KV heads, intermediate 128
    "wide": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16,
                 num_key_value_heads=4),
}


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--shapes", default="tiny,wide", help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--tp", type=int, default=2, help="ranks to compare with one")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="running requests")
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed per batch")
    parser.add_argument("--output-json", default=None, metavar="PATH")
    return parser


def decode_step_ms(llm, batch: int, steps: int) -> float:
    """Median wall time of one engine step while `batch` requests decode (prompts done)."""
    from pageserve.runtime import SamplingParams

    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        eng.add_request([3 + (i * 7 + j) % 300 for j in range(16)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.requests.values()) or eng.num_waiting:
        eng.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - start)
    while eng.has_unfinished_requests():
        eng.step()
    return statistics.median(times) * 1e3


def main(args: argparse.Namespace) -> dict:
    from pageserve.runtime import LLM

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            path = build_tiny_model(Path(tmp) / shape, **SHAPES[shape])
            times = {}
            for tp in (1, args.tp):
                llm = LLM(str(path), dtype="float32", tensor_parallel_size=tp, kv_cache_memory=0.05,
                          swap_space=0, max_model_len=512)
                try:
                    times[tp] = {b: decode_step_ms(llm, b, args.steps) for b in args.batch}
                finally:
                    llm.engine.shutdown()
            for b in args.batch:
                row = {"shape": shape, "batch": b, "tp1_ms": times[1][b], f"tp{args.tp}_ms": times[args.tp][b],
                       "ratio": times[args.tp][b] / times[1][b]}
                rows.append(row)
                print(f"{shape:5s} batch {b:3d}: TP 1 {times[1][b]:7.2f} ms/step, TP {args.tp} "
                      f"{times[args.tp][b]:7.2f} ms/step ({row['ratio']:.2f}x)", flush=True)
    result = {"tp": args.tp, "rows": rows}
    if args.output_json:
        save_json(result, args.output_json)
    return result


if __name__ == "__main__":
    main(add_args(argparse.ArgumentParser(description=__doc__.splitlines()[0])).parse_args())
