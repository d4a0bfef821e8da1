"""The GPU check's quant section (loadtest/gpu_check.py runs it): the quantized linear layers at
Llama-3-8B's MLP shapes (4096 -> 14336 and 14336 -> 4096) for 1, 16 and 256 tokens in bf16.

One random W4A16 layer (groups of 128) is the weight; its dequantized bf16 copy w is the
reference, F.linear(x, w). FP8 and INT8 layers are w quantized per output channel, and
"fp8 block" w in FP8 blocks of 128x128 (Qwen's -FP8 layout, weight-only: the grouped GEMM);
"nvfp4" random FP4 codes with a scale a group of 16 (weight-only, the grouped GEMM), against
its own dequantized bf16 matmul. Each method's largest error relative to the reference's largest value, and its median time against
the bf16 matmul's (CUDA events, after warm-up), launched and replayed from a CUDA graph (as the
engine's decode steps run them, without the host's launch costs). fp8 and int8 run twice: gemm="auto" (torch's
scaled matmul where it applies; the path is reported) and the Triton GEMM alone. Then the W4A16
GEMM's tile sweep at decode sizes (int4_tile_sweep)."""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

GROUP = 128
# the largest error a correct kernel shows here, over the reference's largest value: bf16
# rounding alone for int4; the activations' per-token rounding (3 mantissa bits for fp8,
# 1/254 of the row's maximum for int8) for the others. A wrong kernel is off by about 1.
MAX_REL_ERR = {"int4": 2e-2, "fp4": 2e-2, "int8": 4e-2, "fp8": 1e-1}


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] in 0..15 -> int32 [N, K / 8], column 8i + j in bits 4j..4j+3 of word i."""
    shifts = torch.arange(0, 32, 4, device=q.device)
    words = (q.view(q.shape[0], -1, 8).long() << shifts).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def median_time(fn, iters: int) -> float:
    """Median seconds of one call: CUDA events around each call after warm-up (wall clock on CPU)."""
    for _ in range(3):
        fn()
    times = []
    if not torch.cuda.is_available():
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    torch.cuda.synchronize()
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) / 1e3 for start, end in events)


def graphed(fn):
    """fn captured in a CUDA graph, as a decode step runs it: the returned callable replays it
    (off CUDA: fn itself)."""
    if not torch.cuda.is_available():
        return fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def make_layers(n: int, k: int, device, generator) -> dict:
    """The int4 layer, its dequantized bf16 weight, the fp8 and int8 layers made from it, and an
    NVFP4 layer with its own dequantized bf16 weight."""
    from pageserve.triton_kernels import torch_ops

    q = torch.randint(0, 16, (n, k), generator=generator, device=device, dtype=torch.int32)
    zeros = torch.randint(0, 16, (n, k // GROUP), generator=generator, device=device, dtype=torch.int32)
    # scales that give outputs of about unit size for unit inputs
    scales = (torch.rand(n, k // GROUP, generator=generator, device=device) + 0.5) * (2.0 / (15 * k ** 0.5))
    layers = {"int4": (pack_int4(q), scales, zeros.to(torch.uint8))}
    del q
    w = torch_ops.dequantize_int4(*layers["int4"], GROUP)
    for kind, dtype in (("fp8", torch.float8_e4m3fn), ("int8", torch.int8)):
        qmax = torch_ops.QUANT_MAX[kind]
        w_scale = w.abs().amax(1) / qmax
        wq = (w / w_scale[:, None]).clamp(-qmax, qmax)
        layers[kind] = ((wq if kind == "fp8" else wq.round()).to(dtype), w_scale)
        del wq
    rows = -(-n // GROUP) * GROUP  # the last row block partial (K is a multiple of GROUP)
    padded = torch.zeros(rows, k, device=device)
    padded[:n] = w.abs()
    blocks = padded.view(rows // GROUP, GROUP, k // GROUP, GROUP).amax(dim=(1, 3)) / torch_ops.QUANT_MAX["fp8"]
    del padded
    per32 = blocks.repeat_interleave(GROUP, 0)[:n].repeat_interleave(GROUP // 32, 1)  # [N, K / 32]
    codes = (w / per32.repeat_interleave(32, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    layers["fp8 block"] = (codes, per32.contiguous())
    layers["bf16"] = w.to(torch.bfloat16)
    fp4 = torch.randint(0, 16, (n, k), generator=generator, device=device, dtype=torch.int32)
    fp4_scales = (torch.rand(n, k // 16, generator=generator, device=device) + 0.5) * (1.0 / (3 * k ** 0.5))
    layers["nvfp4"] = (pack_int4(fp4), fp4_scales)
    layers["nvfp4 bf16"] = torch_ops.dequantize_fp4(*layers["nvfp4"], 16).to(torch.bfloat16)
    return layers


def section_quant(args, report, device):
    from pageserve.triton_kernels.grouped_linear import fp4_linear, fp8_group_linear, int4_linear
    from pageserve.triton_kernels.scaled_linear import auto_gemm, scaled_linear

    if args.smoke:
        shapes, batches, iters = [(256, 96)], (1, 5), 2
    else:
        shapes, batches, iters = [(4096, 14336), (14336, 4096)], (1, 16, 256), 50
    g = torch.Generator(device=device).manual_seed(0)
    cases = []
    report["quant"] = {"group_size": GROUP, "dtype": "bfloat16", "cases": cases}  # filled case by case
    for k, n in shapes:
        layers = make_layers(n, k, device, g)
        w = layers["bf16"]
        print(f"  {k} -> {n}, bf16 activations, int4 groups of {GROUP}:")
        for m in batches:
            x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
            want = F.linear(x, w).float()
            t_bf16 = median_time(lambda: F.linear(x, w), iters)
            g_bf16 = median_time(graphed(lambda: F.linear(x, w)), iters)
            methods = {"int4": ("int4", "triton", lambda: int4_linear(x, *layers["int4"], GROUP)),
                       "fp8 block": ("fp8", "triton", lambda: fp8_group_linear(x, *layers["fp8 block"], 32)),
                       "nvfp4": ("fp4", "triton", lambda: fp4_linear(x, *layers["nvfp4"], 16),
                                 F.linear(x, layers["nvfp4 bf16"]).float())}
            for kind in ("fp8", "int8"):
                wq, w_scale = layers[kind]
                methods[kind] = (kind, "auto", lambda wq=wq, ws=w_scale, kind=kind: scaled_linear(x, wq, ws, kind))
                methods[f"{kind} triton"] = (kind, "triton", lambda wq=wq, ws=w_scale, kind=kind:
                                             scaled_linear(x, wq, ws, kind, gemm="triton"))
            print(f"    M {m:4d}: bf16 matmul {t_bf16 * 1e6:9.1f} us (from a CUDA graph {g_bf16 * 1e6:9.1f} us)")
            for name, (kind, gemm, fn, *own) in methods.items():  # own: a reference of the method's own weight
                ref = own[0] if own else want
                err = ((fn().float() - ref).abs().max() / ref.abs().max()).item()
                t, tg = median_time(fn, iters), median_time(graphed(fn), iters)
                path = auto_gemm(m, n, k, kind, x.device, x.dtype, False) if gemm == "auto" else "triton"
                ok = err < MAX_REL_ERR[kind]
                cases.append({"k": k, "n": n, "batch": m, "method": name, "gemm": path, "us": t * 1e6,
                              "bf16_us": t_bf16 * 1e6, "speedup_vs_bf16": t_bf16 / t, "graph_us": tg * 1e6,
                              "graph_bf16_us": g_bf16 * 1e6, "graph_speedup_vs_bf16": g_bf16 / tg,
                              "max_rel_err": err, "ok": ok})
                print(f"      {name:11s} ({path:16s}) {t * 1e6:9.1f} us, {t_bf16 / t:5.2f}x bf16; from a graph "
                      f"{tg * 1e6:9.1f} us, {g_bf16 / tg:5.2f}x; "
                      f"max |err| / max |y| {err:.1e} {'ok' if ok else 'FAILED'}")
        report["quant"].setdefault("int4_tiles", []).extend(int4_tile_sweep(layers, k, n, w, device, g, args.smoke))
        del layers, w
    if not all(c["ok"] for c in cases):
        raise RuntimeError("a quantized linear layer differs from the bf16 matmul beyond its bound")


def int4_tile_sweep(layers: dict, k: int, n: int, w: torch.Tensor, device, generator, smoke: bool) -> list[dict]:
    """The W4A16 GEMM at decode sizes (1 and 16 tokens) over a grid of tiles, warps and K
    splits, replayed from a CUDA graph, against the default configuration and the bf16 matmul:
    what to change in grouped_linear.default_config if its choice is far from the best."""
    from pageserve.triton_kernels.grouped_linear import default_config, int4_linear

    if smoke:
        grid = [dict(block_n=32, block_k=32, num_warps=2, split_k=2)]
        batches, iters = (1,), 2
    else:
        grid = [dict(block_n=bn, block_k=bk, num_warps=4, split_k=sk)
                for bn in (16, 32, 64, 128) for bk in (64, 128) for sk in (1, 4, 8)]
        batches, iters = (1, 16), 30
    rows = []
    for m in batches:
        x = torch.randn(m, k, generator=generator, device=device).to(torch.bfloat16)
        want = F.linear(x, w).float()
        scale = want.abs().max().item()
        t_bf16 = median_time(graphed(lambda: F.linear(x, w)), iters)
        default = default_config(m, n, k, GROUP, x.dtype, x.device)
        found = []
        for config in [None, *grid]:
            fn = (lambda: int4_linear(x, *layers["int4"], GROUP)) if config is None else \
                (lambda c=config: int4_linear(x, *layers["int4"], GROUP, block_m=16, num_stages=4, **c))
            err = ((fn().float() - want).abs().max() / scale).item()
            t = median_time(graphed(fn), iters)
            found.append((t, config or {"default": True, **default}, err))
        (t_default, _, _), (t_best, best, _) = found[0], min(found, key=lambda f: f[0])
        # bytes read: the packed weight, its scales and zeros, x (a lower bound on the traffic)
        weight_bytes = n * k // 2 + n * (k // GROUP) * 5 + m * k * 2
        row = {"k": k, "n": n, "batch": m, "bf16_graph_us": t_bf16 * 1e6, "default": found[0][1],
               "default_us": t_default * 1e6, "best": best, "best_us": t_best * 1e6,
               "best_speedup_vs_bf16": t_bf16 / t_best, "best_gb_s": weight_bytes / t_best / 1e9,
               "max_rel_err_worst": max(f[2] for f in found),
               "all": [{"us": t * 1e6, **c} for t, c, _ in found]}
        rows.append(row)
        print(f"    int4 tiles, M {m:3d}, {k} -> {n}: default {t_default * 1e6:8.1f} us, best {t_best * 1e6:8.1f} us "
              f"({t_bf16 / t_best:4.2f}x the bf16 matmul's {t_bf16 * 1e6:.1f} us, {row['best_gb_s']:.0f} GB/s) "
              f"with {best}")
        if row["max_rel_err_worst"] >= MAX_REL_ERR["int4"]:
            raise RuntimeError(f"int4_linear with some tile of the sweep is off: {row['max_rel_err_worst']:.2e}")
    return rows
