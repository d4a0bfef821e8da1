"""The C linear in bfloat16 arithmetic (--dtype auto on a CPU with AVX512-BF16) over two decoder
layers of the default model (SmolLM2-135M, its GGUF's Q4_1 blocks: qkv, o, gate_up, down), ms
per call of the four matrices at each row count: a base commit's build against this checkout's,
rounds alternated in one process (the machine drifts), medians. Also checks that both builds
give the same bits where they must (rows below 16 against one row at a time). With --modes, this
checkout's build in float32 arithmetic against bfloat16 arithmetic instead (what --dtype float32
and --dtype auto run on such a CPU).

    python -m pageserve.loadtest.bench_linear_rows [--base HEAD | --modes] [--rounds 15] [--rows 1,2,...]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from pageserve.runtime.models.gguf_file import kept_blocks, read_header, read_tensor
from pageserve.runtime.models.loader import default_model_path
from pageserve.triton_kernels import cpu_build, cpu_kernels
from pageserve.triton_kernels.cpu_kernels import blocks

ROOT = Path(__file__).resolve().parent.parent
FILES = [p.name for p in (*cpu_build.SOURCES, *cpu_build.HEADERS)]


def build_at(commit: str | None, out: Path) -> Path:
    """The library from triton_kernels/ at `commit` (None: this checkout) into `out`."""
    src = out / (commit or "work")
    src.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        rel = f"triton_kernels/{name}"
        text = (ROOT / rel).read_bytes() if commit is None else subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{commit}:{rel}"], check=True, capture_output=True).stdout
        (src / name).write_bytes(text)
    so = src / "lib.so"
    subprocess.run(["cc", *cpu_build.FLAGS, *(str(src / p.name) for p in cpu_build.SOURCES), "-o", str(so), "-lm"],
                   check=True)
    return so


def two_layers() -> list[torch.Tensor]:
    """Layers 0 and 1 of the default model's GGUF as the engine keeps them (fused qkv, gate_up)."""
    t = {}
    path = default_model_path()
    for e in read_header(path)[1]:
        if e.name.startswith(("blk.0.", "blk.1.")) and e.block_format() and len(e.shape) == 2:
            t[e.name] = (e.block_format(), e.shape[1], torch.from_numpy(kept_blocks(read_tensor(path, e), e)))
    mats = []
    for b in (0, 1):
        g = lambda n: t[f"blk.{b}.{n}.weight"]  # noqa: E731
        for parts in (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",)):
            fmt, cols, _ = g(parts[0])
            mats.append(blocks(torch.cat([g(p)[2] for p in parts]).contiguous(), fmt, cols))
    return mats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="HEAD", help="commit whose kernels are the A side")
    ap.add_argument("--modes", action="store_true", help="float32 against bfloat16 arithmetic, this checkout's build")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=20, help="calls of the four matrices a round, the best kept")
    ap.add_argument("--rows", default="1,2,3,4,5,6,7,8,9,16,64")
    ap.add_argument("--threads", type=int, default=0, help="OpenMP threads (0: torch's default)")
    ap.add_argument("--layers", type=int, default=2,
                    help="layers' matrices a call goes over: copies of the two (30: the model's bytes, past L3)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = [int(r) for r in a.rows.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench_linear_"))
    if a.modes:
        so = build_at(None, tmp)
        libs = {"f32": cpu_kernels.CpuKernels(so, bf16_dot=False), "bf16": cpu_kernels.CpuKernels(so, bf16_dot=True)}
    else:
        libs = {"base": cpu_kernels.CpuKernels(build_at(a.base, tmp), bf16_dot=True),
                "new": cpu_kernels.CpuKernels(build_at(None, tmp), bf16_dot=True)}
    mats = two_layers()
    mats = [mats[i % len(mats)] if i < len(mats) else blocks(mats[i % len(mats)].detach().clone(),
                                                             mats[i % len(mats)].block_format,
                                                             mats[i % len(mats)].in_features)
            for i in range(len(mats) * a.layers // 2)]
    gen = torch.Generator().manual_seed(0)
    xs = {r: {k: torch.randn(r, k, generator=gen) for k in {m.in_features for m in mats}} for r in rows}
    for r in rows:  # same bits: each build against itself row by row below 16, and the two builds
        for m in mats[:8]:
            x = xs[r][m.in_features]
            ya, yb = (lib(x, m) for lib in libs.values())
            if r < 16:
                alone = torch.cat([list(libs.values())[1](x[i:i + 1], m) for i in range(r)])
                assert torch.equal(yb, alone), f"{list(libs)[1]}: rows {r} not the bits of one row at a time"
            if not a.modes and not torch.equal(ya, yb):
                print(f"rows {r}, {tuple(m.shape)}: the builds differ (max {(ya - yb).abs().max().item():.3g})")
    times = {name: {r: [] for r in rows} for name in libs}
    for _ in range(a.rounds):
        for r in rows:
            best = dict.fromkeys(libs, float("inf"))
            for _ in range(a.reps):  # the builds alternated call by call: the same moments of the machine
                for name, lib in libs.items():
                    t = time.perf_counter()
                    for m in mats:
                        lib(xs[r][m.in_features], m)
                    best[name] = min(best[name], time.perf_counter() - t)
            for name in libs:
                times[name][r].append(best[name] * 1e3)
    med = {name: {r: statistics.median(v) for r, v in d.items()} for name, d in times.items()}
    print(f"ms over {a.layers} layers' matrices, {torch.get_num_threads()} threads (medians of {a.rounds} alternated rounds, best of {a.reps} each)")
    print("rows " + " ".join(f"{r:>6}" for r in rows))
    for name in libs:
        print(f"{name:<5}" + " ".join(f"{med[name][r]:6.3f}" for r in rows))
    for name in libs:
        print(f"{name}/1 " + " ".join(f"{med[name][r] / med[name][1]:6.2f}" for r in rows))


if __name__ == "__main__":
    main()
