"""The engine's host work per decode step, with the model's forward and logits stubbed out: what
a GPU step must hide behind (async scheduling) or wait for. A tiny random-weight model, N
requests with prompts of 100-600 tokens all decoding greedily; engines with async scheduling
off and on built side by side in one process and timed in alternated rounds.

    python -m pageserve.loadtest.bench_host [--requests 256] [--rounds 7] [--steps 50] [--stream] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import itertools
import json
import pstats
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pageserve.loadtest.tiny_model import build_tiny_model
from pageserve.runtime import SamplingParams
from pageserve.runtime.engine import LLMEngine
from pageserve.runtime.engine_args import EngineArgs
from pageserve.sampling.params import RequestOutputKind


def stubbed_engine(model_dir: Path, requests: int, async_scheduling: bool, seed: int = 0,
                   stream: bool = False) -> LLMEngine:
    """An engine whose model returns zeros for hidden states and fixed random logits, with
    `requests` requests past their prompts, decoding (stream: each reporting its new text every
    step, as the server's streamed requests do; else only its final one)."""
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(model_dir), dtype="float32", max_num_seqs=requests, max_num_batched_tokens=8192,
        max_model_len=1024, kv_cache_memory=2, async_scheduling=async_scheduling, seed=seed))
    stub_model(engine, seed)
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True, output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)
    for _ in range(requests):
        engine.add_request([rng.randrange(3, 300) for _ in range(rng.randrange(100, 600))], params)
    s = engine.scheduler
    while s.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in s.running):
        engine.step()
    for _ in range(3):
        engine.step()
    return engine


def stub_model(engine: LLMEngine, seed: int = 0) -> None:
    """The engine's model from now on returns zeros for hidden states and rows of a fixed bank
    of random logits, other rows each step (a request's tokens vary, as a model's do)."""
    model = engine.runner.model
    width, vocab = model.embed_tokens.weight.shape[1], engine.config.model.vocab_size
    bank = torch.rand(1024, vocab, generator=torch.Generator().manual_seed(seed))
    calls = itertools.count()

    def compute_logits(hidden):
        return bank[(torch.arange(hidden.shape[0]) * 7 + next(calls)) % len(bank)]

    model.forward = lambda ids, pos, meta, kv, *a, **k: torch.zeros(len(ids), width)
    model.compute_logits = compute_logits


def ms_per_step(engine: LLMEngine, steps: int) -> float:
    gc.collect()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) / steps * 1e3


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=50, help="decode steps a round")
    parser.add_argument("--stream", action="store_true", help="requests stream their text (DELTA outputs)")
    parser.add_argument("--profile", action="store_true", help="then print where one engine's steps spend it")
    parser.add_argument("--output-json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny")
        engines = {"sync": stubbed_engine(model_dir, args.requests, False, stream=args.stream),
                   "async": stubbed_engine(model_dir, args.requests, True, stream=args.stream)}
        times = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                times[name].append(ms_per_step(engine, args.steps))
        result = {"requests": args.requests, "steps_per_round": args.steps, "stream": args.stream,
                  "ms_per_step": times, "median_ms": {k: statistics.median(v) for k, v in times.items()}}
        print(f"host work per decode step, {args.requests} {'streamed ' if args.stream else ''}requests, "
              f"{args.rounds} rounds of {args.steps} steps:")
        for name, ms in times.items():
            print(f"  {name:5s} median {statistics.median(ms):.2f} ms  (rounds: {', '.join(f'{t:.2f}' for t in ms)})")
        if args.profile:
            profile = cProfile.Profile()
            profile.runcall(ms_per_step, engines["async"], args.steps)
            pstats.Stats(profile).sort_stats("tottime").print_stats(20)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
