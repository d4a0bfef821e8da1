"""One stream of the default model's shapes in bfloat16 against its quantized copies, in the same
run: the bytes of the matrices a decode step reads, and the decode step's time.

The copies (written once under $PAGESERVE_CACHE/quant by bf16_copy.py and quantized_copy.py):
bfloat16, compressed-tensors W4A16 in groups of 64 (576 columns do not make groups of 128),
INT8 W8A8 and FP8, scales in bfloat16 as llm-compressor writes them for a bfloat16 model, and
NVFP4 (FP8 scales a group of 16), and bitsandbytes' NF4 (written by bitsandbytes, which
must be installed for that copy). Each model is loaded once; rounds alternate between them (the machine drifts),
and a step's time is the difference of two generations (16 and 16 + N tokens after one prompt)
over N, so that the prompt's prefill is not in it.

    pageserve bench quant [--rounds 5] [--tokens 128] [--output-json PATH]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

from pageserve.loadtest.bf16_copy import bf16_copy
from pageserve.loadtest.common import save_json
from pageserve.loadtest.quantized_copy import quantized_copy
from pageserve.runtime.models.loader import cache_root, resolve_model

COPIES = {"bf16": None, "w4a16-g64": ("ct-w4a16", 64), "int8": ("ct-int8", 0), "fp8": ("ct-fp8", 0),
          "nvfp4": ("ct-nvfp4", 16), "bnb-nf4": ("bnb-nf4", 64)}


def copies(which: list[str]) -> dict[str, Path]:
    src, root = resolve_model(None), cache_root() / "quant"
    out = {}
    for name in which:
        path = root / f"smollm2-{name}-bf16-scales"
        if not (path / "config.json").is_file():
            if COPIES[name] is None:
                bf16_copy(src, path)
            else:
                fmt, group = COPIES[name]
                quantized_copy(src, path, fmt, group_size=group or 128, scale_dtype=torch.bfloat16)
        out[name] = path
    return out


def matrix_bytes(model) -> int:
    """Bytes of every matrix a decode step multiplies by: the linear layers and the lm_head (the
    embedding where it is tied)."""
    from pageserve.runtime.models.weight_formats import matrix_owners

    return sum(m.weight.numel() * m.weight.element_size() for m in matrix_owners(model))


def step_ms(llm, tokens: int) -> float:
    from pageserve.runtime import SamplingParams

    prompt = [[(17 * i) % 4000 + 100 for i in range(32)]]
    times = []
    for n in (16, 16 + tokens):
        t = time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        times.append(time.perf_counter() - t)
    return (times[1] - times[0]) / tokens * 1e3


def add_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--copies", default=",".join(COPIES), help=f"some of {', '.join(COPIES)}")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--output-json", default=None)
    return p


def main(args: argparse.Namespace) -> dict:
    from pageserve.runtime import LLM
    from pageserve.runtime.config import cpu_flags

    paths = copies(args.copies.split(","))
    llms = {name: LLM(str(path), dtype=args.dtype, max_num_seqs=1, kv_cache_memory=0.1,
                      max_model_len=1024) for name, path in paths.items()}
    for llm in llms.values():
        step_ms(llm, 8)  # warm-up
    runs: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(args.rounds):
        for name, llm in llms.items():
            runs[name].append(step_ms(llm, args.tokens))
    base = statistics.median(runs["bf16"]) if "bf16" in runs else None
    bytes_base = matrix_bytes(llms["bf16"].engine.runner.model) if "bf16" in llms else None
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "units": sorted(f for f in cpu_flags() if f.startswith(("avx", "amx"))),
                          "threads": torch.get_num_threads()}, "tokens": args.tokens, "rounds": args.rounds, "copies": {}}
    print(f"{'copy':<10} {'MB a step':>10} {'vs bf16':>8} {'ms a step (median)':>20} {'vs bf16':>8}   all rounds")
    for name, llm in llms.items():
        b, ms = matrix_bytes(llm.engine.runner.model), statistics.median(runs[name])
        result["copies"][name] = {"matrix_bytes": b, "step_ms": runs[name], "step_ms_median": ms}
        print(f"{name:<10} {b / 1e6:>10.1f} {b / bytes_base if bytes_base else 0:>8.2f} {ms:>20.2f} "
              f"{ms / base if base else 0:>8.2f}   {' '.join(f'{t:.2f}' for t in runs[name])}")
    return save_json(result, args.output_json)


if __name__ == "__main__":
    main(add_args(argparse.ArgumentParser(description=__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)).parse_args())
