"""The GPU check's engine sections (loadtest/gpu_check.py runs them): offline throughput
against HF, nano-vllm's workload, streamed serving against offline, and decode steps with and
without CUDA graphs, on random-weight models with Qwen2.5-0.5B's shapes (or TINY's, with
--smoke); the readiness checks build the same models."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

QWEN_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6)
TINY = dict(hidden_size=112, intermediate_size=256, num_hidden_layers=2, num_attention_heads=7,
            num_key_value_heads=1, vocab_size=1000)


def qwen_like(path: Path, shape: dict) -> Path:
    """A random-weight Qwen2 of `shape` with tied embeddings, weights drawn as a trained
    model's are scaled (so bf16 logits are not all ties)."""
    from pageserve.loadtest.tiny_model import build_tiny_model

    return build_tiny_model(path, arch="qwen2", tie_word_embeddings=True, initializer_range=0.02, **shape)


def section_engine(args, report, device):
    from pageserve.loadtest import bench_offline

    shape = TINY if args.smoke else QWEN_05B
    if args.smoke:
        flags = ["--num-prompts", "6", "--max-prompt-len", "40", "--max-output-len", "8",
                 "--min-output-len", "4", "--kv-cache-memory", "0.05"]
    else:
        flags = ["--num-prompts", "256", "--hf-num-prompts", "64", "--hf-batch-size", "8",
                 "--kv-cache-memory", "16"]
    with tempfile.TemporaryDirectory() as tmp:
        path = qwen_like(Path(tmp), shape)
        ns = bench_offline.add_args(argparse.ArgumentParser()).parse_args(
            ["--model", str(path), "--dtype", "bfloat16", *flags])
        result = bench_offline.main(ns)
    report["engine"] = {"ours_tok_s": result["ours"]["tokens_per_s"],
                        "hf_tok_s": result["hf"]["tokens_per_s"],
                        "ratio": result["ours"]["tokens_per_s"] / result["hf"]["tokens_per_s"],
                        "ours": result["ours"], "hf": result["hf"], "shape": shape}


def section_nano(args, report, device):
    """nano-vllm's offline workload (loadtest/bench_nano.py) on the Qwen2.5-0.5B shape in bf16,
    with async scheduling off and on; its CPU smoke with --smoke."""
    from pageserve.loadtest import bench_offline

    # nano-vllm's own engine settings: a step takes up to 16,384 tokens (its prompts in a few steps)
    flags = ["--smoke"] if args.smoke else ["--shape", "qwen2.5-0.5b", "--dtype", "bfloat16",
                                            "--max-num-batched-tokens", "16384"]
    runs = {}
    for mode, extra in (("sync", ["--no-async-scheduling"]), ("async", ["--async-scheduling"])):
        ns = bench_offline.add_args(argparse.ArgumentParser()).parse_args(["--dataset", "nano", *flags, *extra])
        runs[mode] = bench_offline.main(ns)
    runs["async_over_sync"] = runs["async"]["output_tok_s"] / runs["sync"]["output_tok_s"]
    print(f"async scheduling: {runs['async_over_sync']:.3f}x the output tok/s of synchronous steps")
    report["nano"] = runs


def section_serve(args, report, device):
    """The real server streaming 256 chat completions of 512 tokens at once on the Qwen2.5-0.5B
    shape in bf16, against the same engine offline on the same prompts (loadtest/bench_serve_host.py):
    streamed tokens a second, and the server process's CPU per token; the stubbed CPU version
    with --smoke."""
    from pageserve.loadtest import bench_serve_host

    if args.smoke:
        report["serve"] = bench_serve_host.main(["--requests", "8", "--max-tokens", "16", "--rounds", "1"])
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = qwen_like(Path(tmp), QWEN_05B)
        report["serve"] = bench_serve_host.main([
            "--model", str(path), "--dtype", "bfloat16", "--kv-cache-memory", "16", "--requests", "256",
            "--max-tokens", "512", "--rounds", "2", "--client-procs", "4"])


def decode_steps(engine, batch: int, steps: int, prompt_len: int = 32) -> tuple[list[float], dict]:
    """Greedy requests of `batch` distinct prompts decoding `steps` tokens together: the wall
    time of each decode-only step (engine.step: schedule, forward, sample, detokenize) and the
    tokens of each request."""
    from pageserve.runtime import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    order = [engine.add_request([(7 * i + 3 * j) % 997 + 3 for j in range(prompt_len)], params)
             for i in range(batch)]
    times, tokens = [], {}
    first = True
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()  # returns after sampling's copy to the host: the step is done
        if not first:
            times.append(time.perf_counter() - t0)
        first = False  # the first step holds the prompts
        tokens.update({o.request_id: o.outputs[0].token_ids for o in outs if o.finished})
    return times, [tokens[rid] for rid in order]


def _batch_key(batch: int, prompt_len: int) -> str:
    return str(batch) if prompt_len == 32 else f"{batch}x{prompt_len}"


def section_graphs(args, report, device):
    """Decode steps with and without CUDA graphs (the engine's default on CUDA against
    --enforce-eager) on a random-weight model with Qwen2.5-0.5B's shapes in bf16, engine
    steps timed end to end at batch 1, 5 (replayed at 8, padded) and 64 with prompts of 32
    tokens, and at batch 4 with prompts of 1,200 (the split-KV attention, captured with the
    partitions of the longest context), and their tokens compared: at the captured sizes
    (1, 64, 4) a replay launches what the eager step launches (more, empty, partitions for the
    split), so the tokens must be the same; a padded batch runs its matmuls on more rows and
    may differ in the last bits, so it is reported."""
    from pageserve.runtime.engine import LLMEngine
    from pageserve.runtime.engine_args import EngineArgs

    if args.smoke:
        shape, batches, steps, dtype = TINY, ((1, 32), (5, 32)), 4, "float32"
    else:  # a 4096-token context keeps the static block tables small
        shape, batches, steps, dtype = ({**QWEN_05B, "max_position_embeddings": 4096},
                                        ((1, 32), (5, 32), (64, 32), (4, 1200)), 64, "bfloat16")
    result = report["graphs"] = {"shape": shape, "dtype": dtype, "steps": steps, "batches": {}}
    with tempfile.TemporaryDirectory() as tmp:
        path = qwen_like(Path(tmp), shape)
        runs = {}
        for mode in ("eager", "graphs"):
            t0 = time.perf_counter()
            engine = LLMEngine.from_engine_args(EngineArgs(
                model=str(path), dtype=dtype, device=device.type, attention_backend="triton",
                kv_cache_memory=2 if not args.smoke else 0.01,
                max_num_seqs=64, enforce_eager=mode == "eager", async_scheduling=False))  # step by step
            graphs = engine.runner.graphs
            result[f"{mode}_start_s"] = time.perf_counter() - t0
            if mode == "graphs":
                result["captured"] = sorted(graphs.graphs) if graphs is not None else []
                if device.type == "cuda" and graphs is None:
                    raise RuntimeError("no CUDA graphs were captured")
            for batch, prompt_len in batches:
                replays = graphs.replays if graphs is not None else 0
                times, tokens = decode_steps(engine, batch, steps, prompt_len)
                times.sort()
                runs[mode, batch] = tokens
                entry = result["batches"].setdefault(_batch_key(batch, prompt_len), {})
                entry[f"{mode}_step_ms_p50"] = times[len(times) // 2] * 1e3
                entry[f"{mode}_step_ms_min"] = times[0] * 1e3
                if graphs is not None:
                    entry["replays"] = graphs.replays - replays
            del engine, graphs
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(f"  {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, {dtype}; captured sizes "
          f"{result.get('captured')}; start-up eager {result['eager_start_s']:.1f} s, with graphs "
          f"{result['graphs_start_s']:.1f} s")
    mismatched = []
    for batch, prompt_len in batches:
        entry = result["batches"][_batch_key(batch, prompt_len)]
        a, b = runs["eager", batch], runs["graphs", batch]
        same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
        entry["same_tokens"] = same / sum(len(r) for r in a)
        entry["speedup"] = entry["eager_step_ms_p50"] / entry["graphs_step_ms_p50"]
        print(f"  batch {batch:3d}, prompts of {prompt_len:4d}: decode step p50 eager "
              f"{entry['eager_step_ms_p50']:.2f} ms, graphs "
              f"{entry['graphs_step_ms_p50']:.2f} ms ({entry['speedup']:.2f}x; {entry.get('replays', 0)} "
              f"replays); same tokens {entry['same_tokens'] * 100:.1f}%")
        if batch in (1, 64, 4) and entry["same_tokens"] < 1:
            mismatched.append(batch)
    if mismatched:
        raise RuntimeError(f"graph replays changed greedy tokens at captured batch sizes {mismatched}")
