"""What this machine allows one model, measured in the run that reports against it: memory
read bandwidth (the faster of two probes), the bytes of weights one decode step reads, the
memory floor of a step (those bytes at that bandwidth), and the time of the step's matmuls
alone (every linear layer and the lm_head, through the engine's own matmul path, less the
Python of each call on the CPU) at 1 and 64 rows; then the engine's own decode at 1 and 64
streams as a fraction of each limit."""

from __future__ import annotations

import time

import torch

from pageserve.loadtest.common import distinct_prompts
from pageserve.triton_kernels.cpu_kernels import in_features

GB = 1e9


def _median_rate(nbytes: int, run, reps: int, device: torch.device) -> float:
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return nbytes / sorted(times)[reps // 2]


def read_bandwidth(device: torch.device, nbytes: int = 512 << 20, reps: int = 9, kernels=None) -> dict:
    """Bytes per second that memory can be read at: torch's sum over a buffer far larger than
    any cache, and, where the engine has its C kernels, a one-row C matmul over the same bytes
    in huge pages (a plain stream; it reads faster than torch's sum on some machines). Each the
    median of `reps` (a shared machine has outliers both ways); `best` is the larger."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    r = {"sum": _median_rate(nbytes, lambda: buf.sum().item(), reps, device)}
    del buf
    lib = getattr(kernels, "cpu_lib", None)
    if lib is not None:
        from pageserve.runtime.cpu_env import huge_page_bytes

        raw = huge_page_bytes(nbytes)
        if raw is not None:
            cols = 4096
            w = raw.view(torch.float32).view(-1, cols).fill_(1.0)
            x = torch.ones(1, cols)
            r["stream"] = _median_rate(nbytes, lambda: lib.linear(x, w), reps, device)
            del w, raw
    r["best"] = max(r.values())
    return r


def step_weights(model) -> list[torch.Tensor]:
    """The matrices one decode step multiplies by: every linear layer's and the lm_head (the
    embedding when it is tied). The embedding lookup itself reads only a few rows."""
    mats = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if getattr(model, "lm_head", None) is None:
        mats.append(model.embed_tokens.weight)
    return mats


def step_weight_bytes(model) -> int:
    norms = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if p.dim() == 1)
    return sum(w.numel() * w.element_size() for w in step_weights(model)) + norms


def _pass_time(kernels, weights: list[torch.Tensor], xs: dict, reps: int) -> float:
    """Best of `reps` timed passes (after one to warm caches and kernel choices) of every weight."""
    dev = weights[0].device
    best = float("inf")
    with torch.inference_mode():
        for _ in range(reps + 1):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            for w in weights:
                kernels.linear(xs[in_features(w)], w)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
    return best


def matmul_time(kernels, weights: list[torch.Tensor], rows: int, dtype: torch.dtype, reps: int = 3) -> float:
    """Seconds for one pass of `rows` rows of `dtype` (the activations') through every matrix,
    on the engine's matmul path (best of `reps`). On the CPU, less the Python of one call per
    matrix, timed as the same pass over 32 x 32 matrices: 21 us a call, 2.6 ms of SmolLM2's 121
    matrices at one row, which the engine's decode (the whole stack in one C call wherever the C
    linear is chosen) does not pay; at least half the pass is kept, for models so small that
    the calls are most of it (the tests' tiny one). On CUDA, launches overlap the device's work,
    and nothing is taken out."""
    dev = weights[0].device
    xs = {in_features(w): torch.randn(rows, in_features(w), dtype=dtype, device=dev) for w in weights}
    t = _pass_time(kernels, weights, xs, reps)
    if dev.type != "cpu":
        return t
    small = torch.zeros(32, 32, dtype=weights[0].dtype if weights[0].is_floating_point() else dtype)
    calls = _pass_time(kernels, [small] * len(weights), {32: torch.randn(rows, 32, dtype=dtype)}, reps)
    return max(t - calls, t / 2)


def engine_decode(llm, streams: int, output_len: int = 64, prompt_len: int = 16) -> float:
    """Seconds per decode step of the engine itself at `streams` concurrent requests: the
    time of `output_len` tokens each minus that of one token each (the prefill), per step."""
    from pageserve.runtime import SamplingParams

    prompts = distinct_prompts(llm.engine.config.model.vocab_size, streams, prompt_len)

    def run(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t

    run(2)  # warm-up
    one = min(run(1) for _ in range(2))
    whole = min(run(output_len) for _ in range(2))
    return (whole - one) / (output_len - 1)


def limits(llm) -> dict:
    """The machine's limits for the engine's model: read bandwidth, the memory floor of a
    decode step, and the step's matmuls alone at 1 and 64 rows."""
    runner = llm.engine.runner
    model, dev = runner.model, runner.device
    weights = step_weights(model)
    nbytes = step_weight_bytes(model)
    reads = read_bandwidth(dev, kernels=runner.kernels)
    bandwidth = reads["best"]
    r = {"read_bandwidth_gb_s": bandwidth / GB,
         "read_bandwidth_by_probe_gb_s": {k: v / GB for k, v in reads.items() if k != "best"},
         "step_weight_bytes": nbytes,
         "memory_floor_ms": nbytes / bandwidth * 1e3,
         "matmul_1_ms": matmul_time(runner.kernels, weights, 1, runner.model_cfg.dtype) * 1e3,
         "matmul_64_ms": matmul_time(runner.kernels, weights, 64, runner.model_cfg.dtype) * 1e3}
    r["matmul_ceiling_64_tok_s"] = 64e3 / r["matmul_64_ms"]
    return r


def measure(llm) -> dict:
    """`limits`, and the engine's own decode steps at 1 and 64 streams against them."""
    r = limits(llm)
    r["engine_step_1_ms"] = engine_decode(llm, 1) * 1e3
    r["engine_step_64_ms"] = engine_decode(llm, 64) * 1e3
    r["engine_64_tok_s"] = 64e3 / r["engine_step_64_ms"]
    return r


def serve_summary(r: dict, itl_p50_ms: float, output_tok_s: float) -> list[str]:
    """A served run against the limits measured after it: the streams' median gap between
    tokens against the memory floor, the output rate against the 64-row matmul ceiling."""
    return [
        f"machine: reads {r['read_bandwidth_gb_s']:.1f} GB/s; memory floor {r['memory_floor_ms']:.1f} ms a step; "
        f"matmuls alone at 64 rows {r['matmul_64_ms']:.1f} ms (ceiling {r['matmul_ceiling_64_tok_s']:.0f} tok/s)",
        f"ITL p50 {itl_p50_ms:.1f} ms = {itl_p50_ms / r['memory_floor_ms']:.2f}x the memory floor",
        f"output {output_tok_s:.1f} tok/s = {output_tok_s / r['matmul_ceiling_64_tok_s'] * 100:.0f}% "
        f"of the 64-row matmul ceiling",
    ]


def summary(r: dict) -> list[str]:
    return [
        f"machine: reads {r['read_bandwidth_gb_s']:.1f} GB/s ("
        + ", ".join(f"{k} {v:.1f}" for k, v in r.get("read_bandwidth_by_probe_gb_s", {}).items())
        + f"); a decode step reads "
        f"{r['step_weight_bytes'] / 1e6:.0f} MB of weights: memory floor {r['memory_floor_ms']:.1f} ms a step",
        f"matmuls alone: {r['matmul_1_ms']:.1f} ms at 1 row, {r['matmul_64_ms']:.1f} ms at 64 rows "
        f"(ceiling {r['matmul_ceiling_64_tok_s']:.0f} tok/s at 64 streams)",
        f"engine, 1 stream: {r['engine_step_1_ms']:.1f} ms a step = "
        f"{r['engine_step_1_ms'] / r['memory_floor_ms']:.2f}x the memory floor, "
        f"{r['engine_step_1_ms'] / r['matmul_1_ms']:.2f}x the matmuls",
        f"engine, 64 streams: {r['engine_step_64_ms']:.1f} ms a step = {r['engine_64_tok_s']:.0f} tok/s = "
        f"{r['engine_64_tok_s'] / r['matmul_ceiling_64_tok_s'] * 100:.0f}% of the matmul ceiling",
    ]
