"""A speculative verification step on the CPU (1 + k rows of one sequence at consecutive
positions, through the C decoder stack) against a 1-row decode, of the default model at a few
context lengths: ms per `runner.execute` of synthetic steps (the context's K/V random values), a base commit's C kernels against
this checkout's, swapped into one engine (the machine drifts: rounds alternated, medians).

    python -m pageserve.loadtest.bench_verify_rows [--base HEAD] [--rounds 7] [--rows 1,9] [--ctx 500,2500]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pageserve.loadtest.bench_linear_rows import build_at
from pageserve.runtime import LLM
from pageserve.runtime.synthetic_steps import GREEDY_PARAMS, build_step
from pageserve.triton_kernels import cpu_kernels


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="HEAD", help="commit whose kernels are the A side")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=5, help="steps a round per shape, the median kept")
    ap.add_argument("--rows", default="1,9")
    ap.add_argument("--ctx", default="500,2500")
    a = ap.parse_args()
    llm = LLM(None, max_model_len=4096, kv_cache_memory=1.0, enable_prefix_caching=False)
    runner = llm.engine.runner
    kernels = runner.kernels
    mine = kernels.cpu_lib
    tmp = Path(tempfile.mkdtemp(prefix="bench_verify_"))
    libs = {"base": cpu_kernels.CpuKernels(build_at(a.base, tmp), bf16_dot=mine.bf16_dot),
            "new": cpu_kernels.CpuKernels(build_at(None, tmp), bf16_dot=mine.bf16_dot)}
    block_size = kernels.block_size
    num_blocks = runner.kv_caches[0][0].shape[0]
    vocab = runner.model.cfg.vocab_size
    shapes = [(r, c) for c in map(int, a.ctx.split(",")) for r in map(int, a.rows.split(","))]
    # the context's K/V as a prefill would leave them: values in memory (an untouched cache is
    # the kernel's one zero page, always in cache), bfloat16 ones as that arithmetic writes
    used = -(-max(c for _, c in shapes) // block_size)
    gen = torch.Generator().manual_seed(0)
    for pair in runner.kv_caches:
        for cache in pair:
            cache[:used] = torch.randn(cache[:used].shape, generator=gen).bfloat16().float()
    steps = {s: build_step([(s[0], s[1], 1)], [GREEDY_PARAMS], block_size, num_blocks, vocab, (), name=f"v{s}")
             for s in shapes}
    print(f"ISA {mine.isa}, bf16 arithmetic {mine.bf16_dot}, block size {block_size}, {num_blocks} blocks")
    times = {(name, s): [] for name in libs for s in shapes}
    for _ in range(2):  # warm-up: the stack built, pages faulted in
        for name, lib in libs.items():
            kernels.cpu_lib = lib
            for s in shapes:
                runner.execute(steps[s])
    for _ in range(a.rounds):
        for name, lib in libs.items():
            kernels.cpu_lib = lib
            for s in shapes:
                reps = []
                for _ in range(a.reps):
                    t = time.perf_counter()
                    runner.execute(steps[s])
                    reps.append(time.perf_counter() - t)
                times[(name, s)].append(statistics.median(reps))
    kernels.cpu_lib = mine
    print(f"{'rows':>4} {'ctx':>5} {'base ms':>8} {'new ms':>8}")
    for s in shapes:
        b, n = (statistics.median(times[(name, s)]) * 1e3 for name in libs)
        print(f"{s[0]:>4} {s[1]:>5} {b:8.2f} {n:8.2f}")
    for c in sorted({c for _, c in shapes}):
        rows = sorted(r for r, cc in shapes if cc == c)
        if len(rows) > 1 and rows[0] == 1:
            for name in libs:
                one = statistics.median(times[(name, (1, c))])
                ratios = ", ".join(f"{r} rows {statistics.median(times[(name, (r, c))]) / one:.2f}x"
                                   for r in rows[1:])
                print(f"ctx {c} {name}: {ratios} of 1 row")


if __name__ == "__main__":
    main()
