"""The engine at two commits on this machine, each in its own processes: the first token of one
long prompt and the decode step of N requests with long contexts (the default model unless
--model), rounds alternated (the machine drifts), medians. The base commit is checked out into a
temporary worktree; this checkout is the other arm. The measuring code is this file's, run
against each arm's package, so the base needs only the engine's public API.

    python -m pageserve.loadtest.bench_commits --base HEAD~1 [--rounds 3] [--long-prompt 3000]
        [--requests 64] [--context 600] [--output-json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # this checkout: the package `pageserve`


def measure(args: argparse.Namespace) -> dict:
    """In the arm's process: ms to the first token of `long_prompt` tokens (best of two, an idle
    engine, no prefix cache), then ms a decode step of `requests` requests past prompts of
    `context` tokens."""
    from pageserve.runtime import SamplingParams
    from pageserve.runtime.engine import LLMEngine
    from pageserve.runtime.engine_args import EngineArgs
    from pageserve.sampling.params import RequestOutputKind

    engine = LLMEngine.from_engine_args(EngineArgs(
        model=args.model, max_num_seqs=args.requests, max_model_len=max(args.context, args.long_prompt) + 512,
        enable_prefix_caching=False, kv_cache_memory=args.kv_cache_memory))
    once = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    rng = random.Random(1)
    firsts = []
    for _ in range(3):  # the first one pages the model and the kernels in: not counted
        rid = engine.add_request([rng.randrange(100, 40000) for _ in range(args.long_prompt)], once)
        start = time.perf_counter()
        while not any(o.request_id == rid and o.finished for o in engine.step()):
            pass
        firsts.append((time.perf_counter() - start) * 1e3)
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    for _ in range(args.requests):
        engine.add_request([rng.randrange(100, 40000) for _ in range(args.context)], long)
    start = time.perf_counter()
    s = engine.scheduler
    while s.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in s.running):
        engine.step()
    prefill_s = time.perf_counter() - start
    engine.step()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    return {"first_token_ms": min(firsts[1:]), "decode_ms": (time.perf_counter() - start) / args.steps * 1e3,
            "prefill_tok_s": args.requests * args.context / prefill_s}


def run_arm(package: Path, args: argparse.Namespace) -> dict:
    """measure() in a fresh process whose `pageserve` is `package`"""
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "pageserve").symlink_to(package)
        env = {**os.environ, "PYTHONPATH": d}
        out = subprocess.run([sys.executable, __file__, "--measure", json.dumps(vars(args))], env=env, check=True,
                             capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="HEAD~1", help="the commit this checkout is measured against")
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--long-prompt", type=int, default=3000)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--kv-cache-memory", type=float, default=2.5, help="GiB for the pool")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--measure", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(argparse.Namespace(**json.loads(args.measure)))))
        return {}
    base = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.base], check=True,
                          capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="bench_commits_") as tmp:
        tree = Path(tmp) / base
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), base], check=True,
                       capture_output=True)
        try:
            arms = {base: tree, "this": ROOT}
            for path in arms.values():  # each arm's kernels built and its files read once, not in a round
                run_arm(path, argparse.Namespace(**{**vars(args), "requests": 1, "steps": 1}))
            runs: dict[str, list[dict]] = {name: [] for name in arms}
            for r in range(args.rounds):
                for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
                    runs[name].append(run_arm(arms[name], args))
                    print(name, runs[name][-1], flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    med = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for name, rs in runs.items()}
    result = {"base": base, "args": {k: v for k, v in vars(args).items() if k != "measure"}, "runs": runs,
              "medians": med, "ratios": {k: med["this"][k] / med[base][k] for k in med["this"]}}
    for name, m in med.items():
        print(f"{name:8} first token of {args.long_prompt} tokens {m['first_token_ms']:7.0f} ms  decode step of "
              f"{args.requests} {m['decode_ms']:6.1f} ms  prefill {m['prefill_tok_s']:6.0f} tok/s")
    print("this / base: " + ", ".join(f"{k} {v:.2f}x" for k, v in result["ratios"].items()))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
