"""The GPU check of the Triton kernels and the engine's GPU paths, one command, in this order
(`--sections` picks and orders them; each writes its figures to gpu_check.json as it ends):

1. graphs: engine decode steps with CUDA graphs (the default on CUDA) against --enforce-eager
   on a random-weight model with Qwen2.5-0.5B's shapes in bf16, at batch 1, 5 (replayed at 8,
   padded) and 64: step times, and the same greedy tokens at the captured sizes;
2. tests: the kernel test suite (tests/kernels) on CUDA, bounded by --tests-timeout;
3. shapes: paged attention in bf16 at larger shapes against dense attention computed in
   float32: a mixed step of ragged prefill chunks and decodes with Llama-8B's heads,
   decode-only steps through the one-pass and split-KV paths, and a cache so large that block
   offsets overflow int32 (float32 kernels are covered by the kernel tests);
4. decode: decode attention at batch 64 x context 4096 (Llama-8B: 32 query heads, 8 KV heads,
   head dim 128, bf16, shuffled 16-token blocks): achieved HBM bandwidth as a fraction of
   4.8 TB/s, and the time against scaled_dot_product_attention on the same data laid out
   contiguously; a sweep of launch settings; the split path at batch 2 x context 32768;
   prefill (loadtest/gpu_prefill_check.py): the same kernel on prompt chunks at scale (8 x 1,024
   tokens; 2 chunks of 2,048 after 6,144) against causal SDPA, Qwen2.5-0.5B's and Llama-8B's heads;
5. engine: offline engine throughput on a random-weight model with Qwen2.5-0.5B's shapes
   against HF `generate` in static batches of 8 (loadtest/bench_offline.py), with the
   device's limits measured in the same run;
6. nano: nano-vllm's offline workload (256 sequences, prompts and outputs of 100..1024 tokens,
   ignore_eos, one timed `generate`) on a random-weight Qwen2.5-0.5B shape in bf16
   (loadtest/bench_nano.py): output and total tok/s beside vLLM's and nano-vllm-triton's
   figures, with async scheduling off and on;
   profile (loadtest/gpu_profile.py): 128 requests decoding on that shape, async scheduling off
   and on: step time, the device's share of it in kernels, host-device syncs a step, and a
   torch profiler trace of each (profile_sync.json.gz, profile_async.json.gz in --out);
   serve (loadtest/bench_serve_host.py): the real server streaming 256 chat completions of 512
   tokens on that shape against the same engine offline: streamed tok/s and the server's CPU
   per token;
7. readiness (loadtest/gpu_readiness.py, in a process of its own): no kernel compiles while
   serving after warm-up, the warm-up time, no out-of-memory at --gpu-memory-utilization 0.95
   under the worst load with the profiled peak covering the serving peak, swap-outs
   overlapping compute;
8. moe: the mixture-of-experts feed-forward at Mixtral-8x7B's expert shapes (8 experts, top 2,
   hidden 4096, intermediate 14336, bf16) for 1, 16, 256 and 2048 tokens: torch_ops.fused_moe
   against the Triton fused_moe, their agreement with a float32 computation, and the expert
   weights the Triton version reads as a fraction of 4.8 TB/s;
9. quant (loadtest/gpu_quant_check.py): W4A16 (groups of 128), FP8 and INT8 linear layers at
   4096 -> 14336 and 14336 -> 4096 for 1, 16 and 256 tokens against the bf16 matmul of the
   dequantized weight: error relative to the output's scale, median time against bf16; the
   W4A16 GEMM at 1 and 16 tokens over 24 tile, K-split configurations against its default;
10. lora (loadtest/gpu_lora_check.py): the multi-LoRA shrink + expand kernels on Llama-3-8B's
   q/k/v projection (4096 -> 4096 + 1024 + 1024), 8 slots of rank 16, for 1, 16 and 256 tokens
   spread over the 8 adapters: error of the delta against float32 torch, median time against
   the base layer's bf16 matmul and the torch grouped path.

    python -m pageserve.loadtest.gpu_check [--out DIR]   # on the GPU machine
    python -m pageserve.loadtest.gpu_check --smoke      # tiny shapes on CPU under TRITON_INTERPRET=1

The GPU machine has torch, triton, transformers and pytest but not outlines-core, which the
engine imports, nor the server's packages (the serve section): `make gpu-wheels` fetches them
into .whl here (about 6 MB); carry .whl and run there
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
    mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/pageserve &&  # the tree as the pageserve package
    PYTHONPATH=/tmp/site:/tmp/pkg PYTHONUNBUFFERED=1 python3 -m pageserve.loadtest.gpu_check --out $OUT

Each section reports its own failure and the next one still runs; the exit code is non-zero
if any failed. The figures go to stdout and to gpu_check.json in --out."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# progress bars would crowd the figures out of the log; tqdm reads this when it is imported
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from pageserve.loadtest.gpu_engine_checks import section_engine, section_graphs, section_nano, section_serve  # noqa: E402
from pageserve.loadtest.gpu_prefill_check import section_prefill  # noqa: E402
from pageserve.loadtest.gpu_profile import section_profile  # noqa: E402
from pageserve.loadtest.gpu_lora_check import section_lora  # noqa: E402
from pageserve.loadtest.gpu_quant_check import section_quant  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HBM_BYTES_PER_S = 4.8e12  # H200


def dense_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale):
    """Float32 attention request by request on K/V gathered out of the cache: independent of
    both paged implementations."""
    num_heads, block_size = q.shape[1], k_cache.shape[2]
    group = num_heads // k_cache.shape[1]
    out = torch.empty_like(q)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, ctx in enumerate(lens):
        s, e = qsl[b], qsl[b + 1]
        blocks = block_tables[b, :-(-ctx // block_size)].long()
        k = k_cache[blocks].transpose(0, 1).flatten(1, 2)[:, :ctx].float().repeat_interleave(group, 0)
        v = v_cache[blocks].transpose(0, 1).flatten(1, 2)[:, :ctx].float().repeat_interleave(group, 0)
        pos = torch.arange(ctx, device=q.device)
        q_pos = ctx - (e - s) + torch.arange(e - s, device=q.device)
        mask = pos[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1).float(), k, v, attn_mask=mask, scale=scale)
        out[s:e] = o.transpose(0, 1).to(q.dtype)
    return out


def paged_batch(q_lens, ctx_lens, heads, block_size, dtype, device, seed, num_blocks=None,
                first_block=0):
    """Noise in a paged cache; each request owns shuffled blocks from first_block on."""
    num_heads, num_kv_heads, head_dim = heads
    g = torch.Generator(device=device).manual_seed(seed)
    per_seq = [-(-c // block_size) for c in ctx_lens]
    num_blocks = num_blocks or first_block + sum(per_seq) + 7
    ids = first_block + torch.randperm(num_blocks - first_block, generator=g, device=device)
    bt = torch.zeros(len(ctx_lens), max(per_seq), dtype=torch.int32, device=device)
    used = 0
    for b, n in enumerate(per_seq):
        bt[b, :n] = ids[used:used + n]
        used += n
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.empty(shape, dtype=dtype, device=device)
    v_cache = torch.empty(shape, dtype=dtype, device=device)
    for cache in (k_cache, v_cache):  # only the blocks in use: huge pools stay cheap to fill
        cache[ids[:used]] = torch.randn((used,) + shape[1:], generator=g, device=device, dtype=dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    sl = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g, device=device, dtype=dtype)
    return q, k_cache, v_cache, bt, qsl, sl


def ragged(num_seqs, max_q, max_ctx, seed, decode_share=0.5):
    g = torch.Generator().manual_seed(seed)
    q_lens, ctx = [], []
    for _ in range(num_seqs):
        q = 1 if torch.rand(1, generator=g) < decode_share else int(torch.randint(2, max_q + 1, (1,), generator=g))
        q_lens.append(q)
        ctx.append(q + int(torch.randint(0, max_ctx - q + 1, (1,), generator=g)))
    return q_lens, ctx


def timed(fn, iters: int) -> float:
    """Mean seconds per call (CUDA events after warm-up; wall clock on CPU)."""
    for _ in range(3):
        fn()
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def section_kernel_tests(args, report):
    # -p no:benchmark: pytest-benchmark's warnings under xdist would fill the tail
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "--maxfail=5", "-p", "no:benchmark",
           "-p", "no:cacheprovider", "tests/kernels"]
    if not args.smoke:
        try:
            import xdist  # noqa: F401  # Triton compiles many variants: compile them in parallel
            cmd += ["-n", "8"]
        except ImportError:
            pass
    else:
        cmd += ["-k", "test_split_heuristic or test_block_tile"]
    t0 = time.perf_counter()
    try:  # a bound, so that the sections after it still run on a lent machine's short lease
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.tests_timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        print("\n".join(out.strip().splitlines()[-15:]))
        report["kernel_tests"] = {"returncode": None, "seconds": time.perf_counter() - t0,
                                  "summary": f"stopped after {args.tests_timeout} s"}
        raise RuntimeError(f"the kernel tests took over {args.tests_timeout} s") from None
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "kernel_tests.log").write_text(proc.stdout + proc.stderr)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    tail = [ln for ln in lines if ln.startswith(("FAILED", "ERROR", "E  "))][:40] + lines[-5:]
    print("\n".join(tail))
    report["kernel_tests"] = {"returncode": proc.returncode, "seconds": time.perf_counter() - t0,
                              "summary": tail[-1] if tail else ""}
    if proc.returncode:
        raise RuntimeError("the kernel tests failed")


def section_large_shapes(args, report, device):
    from pageserve.triton_kernels.paged_attention import paged_attention
    from pageserve.triton_kernels.reshape_and_cache import reshape_and_cache

    results = report["large_shapes"] = []  # filled case by case: a crash keeps what ran

    def check(name, q_lens, ctx, heads, block_size, dtype=torch.bfloat16, **kw):
        build = {k: kw.pop(k) for k in ("num_blocks", "first_block") if k in kw}
        q, kc, vc, bt, qsl, sl = paged_batch(q_lens, ctx, heads, block_size, dtype, device,
                                             len(results), **build)
        scale = heads[2] ** -0.5
        if kw.pop("write_step", False):
            # this step's K/V go in through reshape_and_cache at each request's last positions
            slots = torch.cat([bt[b].long()[torch.arange(c - n, c, device=device) // block_size] * block_size
                               + torch.arange(c - n, c, device=device) % block_size
                               for b, (n, c) in enumerate(zip(q_lens, ctx))])
            new_k = torch.randn(len(slots), heads[1], heads[2], device=device, dtype=dtype)
            new_v = torch.randn_like(new_k)
            reshape_and_cache(new_k, new_v, kc, vc, slots)
            blocks, offsets = slots // block_size, slots % block_size
            assert torch.equal(kc[blocks, :, offsets], new_k) and torch.equal(vc[blocks, :, offsets], new_v)
        out = paged_attention(q, kc, vc, bt, qsl, sl, scale, max(q_lens), max(ctx), **kw)
        want = dense_attention(q, kc, vc, bt, qsl, sl, scale)
        err = (out.float() - want.float()).abs().max().item()
        ok = torch.allclose(out.float(), want.float(), atol=2e-2, rtol=2e-2)
        results.append({"case": name, "max_abs_err": err, "ok": ok})
        print(f"  {name}: max |err| {err:.2e} {'ok' if ok else 'FAILED'}")
        del q, kc, vc

    llama8b = (32, 8, 128)
    if args.smoke:
        q_lens, ctx = ragged(6, 20, 200, 0)
        check("mixed step, smoke", q_lens, ctx, (8, 2, 64), 16)
        check("decode split, smoke", [1] * 3, [200, 64, 130], (8, 2, 64), 16, num_partitions=4,
              partition_size=64, block_n=32)
        check("high blocks, smoke", [3, 1], [40, 70], (8, 2, 64), 16, first_block=50, write_step=True)
    else:
        for block_size in (16, 32):
            q_lens, ctx = ragged(32, 512, 4096, block_size)
            check(f"mixed step, 32 requests, q<=512, ctx<=4096, Llama-8B heads, bs {block_size}",
                  q_lens, ctx, llama8b, block_size)
        for heads in ((28, 4, 128), (14, 2, 64), (24, 8, 96)):
            q_lens, ctx = ragged(24, 300, 2048, heads[0])
            check(f"mixed step, heads {heads}", q_lens, ctx, heads, 16)
        ctx = ragged(16, 1, 8192, 5, decode_share=1.0)[1]
        check("decode, 16 requests, ctx<=8192, one pass", [1] * 16, ctx, llama8b, 16, num_partitions=0)
        check("decode, 16 requests, ctx<=8192, split-KV", [1] * 16, ctx, llama8b, 16, num_partitions=16)
        # 8 KV heads x 16 x 128 = 2^14 elements a block: block 131,072 starts at 2^31 elements
        check("int32-overflowing block offsets (blocks 131,072-140,000, 9 GB cache)",
              [7, 1, 1, 30], [1000, 2048, 17, 700], llama8b, 16, num_blocks=140_000,
              first_block=131_072, write_step=True)
    if not all(r["ok"] for r in results):
        raise RuntimeError("paged attention differs from dense attention")


def sdpa_decode(q, k, v, scale):
    """SDPA on contiguous K/V, the fastest backend that takes GQA as is; (fn, backend name)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        def fn(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
        try:
            fn()
            return fn, f"{backend.name}, enable_gqa"
        except RuntimeError:
            continue
    raise RuntimeError("no SDPA backend ran")


def section_decode_bench(args, report, device):
    from pageserve.triton_kernels.paged_attention import PARTITION_SIZE, paged_attention

    batch, ctx_len, heads, iters = (64, 4096, (32, 8, 128), 50) if not args.smoke else (4, 256, (8, 2, 64), 2)
    num_heads, num_kv_heads, head_dim = heads
    dtype = torch.bfloat16
    q, kc, vc, bt, qsl, sl = paged_batch([1] * batch, [ctx_len] * batch, heads, 16, dtype, device, 0)
    scale = head_dim ** -0.5
    kv_bytes = 2 * batch * ctx_len * num_kv_heads * head_dim * kc.element_size()
    io_bytes = kv_bytes + 2 * q.numel() * q.element_size()  # K and V, plus q read and out written
    result = report["decode_bench"] = {"batch": batch, "context": ctx_len, "heads": heads,
                                       "kv_bytes": kv_bytes, "sweep": []}

    def run(**kw):
        return lambda: paged_attention(q, kc, vc, bt, qsl, sl, scale, 1, ctx_len, **kw)

    out = run()()
    default = timed(run(), iters)
    result.update(paged_us=default * 1e6, hbm_fraction=io_bytes / default / HBM_BYTES_PER_S)
    print(f"  decode attention, batch {batch} x context {ctx_len}, heads {heads}, bf16, 16-token blocks:")
    print(f"    paged (default launch): {default * 1e6:.1f} us = {io_bytes / default / 1e12:.2f} TB/s = "
          f"{result['hbm_fraction'] * 100:.1f}% of 4.8 TB/s (target >= 60%)")
    # the same data laid out contiguously for SDPA: [B, Hkv, L, D]
    blocks = bt.long()
    k = kc[blocks].permute(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, ctx_len, head_dim).contiguous()
    v = vc[blocks].permute(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, ctx_len, head_dim).contiguous()
    sdpa, sdpa_name = sdpa_decode(q.view(batch, num_heads, 1, head_dim), k, v, scale)
    t_sdpa = timed(sdpa, iters)
    err = (sdpa().view_as(out).float() - out.float()).abs().max().item()
    result.update(sdpa_us=t_sdpa * 1e6, paged_over_sdpa=default / t_sdpa, sdpa=sdpa_name,
                  max_abs_err_vs_sdpa=err)
    print(f"    SDPA on contiguous K/V ({sdpa_name}): {t_sdpa * 1e6:.1f} us; paged/SDPA time ratio "
          f"{default / t_sdpa:.2f}; max |paged - SDPA| {err:.2e}")
    del k, v

    settings = [dict(block_n=n, num_warps=w, num_stages=s) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3)]
    for kw in settings if not args.smoke else settings[:1]:
        try:
            same = torch.allclose(run(**kw)().float(), out.float(), atol=2e-2, rtol=2e-2)
            t = timed(run(**kw), iters)
        except Exception as e:  # a setting that does not fit (shared memory): report, go on
            print(f"    {kw}: {type(e).__name__}: {str(e)[:120]}")
            continue
        result["sweep"].append({**kw, "us": t * 1e6, "hbm_fraction": io_bytes / t / HBM_BYTES_PER_S,
                                "same_output": same})
        print(f"    {kw}: {t * 1e6:.1f} us, {io_bytes / t / 1e12:.2f} TB/s{'' if same else ', WRONG OUTPUT'}")
    good = [r for r in result["sweep"] if r["same_output"]]
    if good:
        result["best_setting"] = min(good, key=lambda r: r["us"])
        print(f"    best swept setting: {result['best_setting']}")
    del kc, vc

    # few long decodes: the split path against the one-pass kernel
    batch, ctx_len = (2, 32768) if not args.smoke else (2, 300)
    q, kc, vc, bt, qsl, sl = paged_batch([1] * batch, [ctx_len] * batch, heads, 16, dtype, device, 1)
    partition = PARTITION_SIZE if not args.smoke else 128
    parts = -(-ctx_len // partition)
    kv_bytes = 2 * batch * ctx_len * num_kv_heads * head_dim * kc.element_size()
    one = dict(num_partitions=0)
    split = dict(num_partitions=parts, partition_size=partition)
    one_out, split_out = (paged_attention(q, kc, vc, bt, qsl, sl, scale, 1, ctx_len, **kw) for kw in (one, split))
    split_err = (one_out.float() - split_out.float()).abs().max().item()
    t_one, t_split = (timed(lambda kw=kw: paged_attention(q, kc, vc, bt, qsl, sl, scale, 1, ctx_len, **kw), iters)
                      for kw in (one, split))
    result["split"] = {"batch": batch, "context": ctx_len, "partitions": parts,
                       "one_pass_us": t_one * 1e6, "split_us": t_split * 1e6,
                       "split_hbm_fraction": kv_bytes / t_split / HBM_BYTES_PER_S,
                       "max_abs_diff_vs_one_pass": split_err}
    print(f"    batch {batch} x context {ctx_len}: one pass {t_one * 1e6:.1f} us, split into {parts} "
          f"{t_split * 1e6:.1f} us ({kv_bytes / t_split / 1e12:.2f} TB/s); max |split - one pass| {split_err:.2e}")
    if err > 2e-2 or split_err > 2e-2:
        raise RuntimeError("decode attention differs from SDPA or between its paths")


def moe_routing(tokens: int, experts: int, top_k: int, device, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of a softmax over random logits, the k weights normalised to sum to 1."""
    logits = torch.randn(tokens, experts, generator=generator, device=device)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def section_moe(args, report, device):
    from pageserve.triton_kernels import torch_ops
    from pageserve.triton_kernels.fused_moe import default_config, fused_moe

    if args.smoke:
        experts, top_k, hidden, inter, token_counts, iters = 4, 2, 64, 96, (1, 7), 2
    else:  # Mixtral-8x7B's experts
        experts, top_k, hidden, inter, token_counts, iters = 8, 2, 4096, 14336, (1, 16, 256, 2048), 20
    dtype = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g, device=device) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g, device=device) * inter ** -0.5).to(dtype)
    w13_f, w2_f = w13.float(), w2.float()  # the float32 reference's weights, made once
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    cases = []
    report["moe"] = {"experts": experts, "top_k": top_k, "hidden": hidden, "intermediate": inter,
                     "dtype": "bfloat16", "cases": cases}  # filled case by case: a crash keeps what ran
    print(f"  {experts} experts, top {top_k}, hidden {hidden}, intermediate {inter}, bf16:")
    for tokens in token_counts:
        x = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
        weights, ids = moe_routing(tokens, experts, top_k, device, g)
        out = fused_moe(x, w13, w2, weights, ids)
        want = torch_ops.fused_moe(x.float(), w13_f, w2_f, weights, ids)
        err = ((out.float() - want).norm() / want.norm()).item()
        t_torch = timed(lambda: torch_ops.fused_moe(x, w13, w2, weights, ids), iters)
        t_triton = timed(lambda: fused_moe(x, w13, w2, weights, ids), iters)
        touched = ids.unique().numel()
        hbm = touched * expert_bytes / t_triton / HBM_BYTES_PER_S
        cases.append({"tokens": tokens, "torch_us": t_torch * 1e6, "triton_us": t_triton * 1e6,
                      "speedup": t_torch / t_triton, "experts_touched": touched,
                      "weight_bytes": touched * expert_bytes, "hbm_fraction": hbm, "rel_err": err,
                      "config": default_config(tokens * top_k, experts, dtype), "ok": err < 2e-2})
        print(f"    T {tokens:5d}: torch_ops {t_torch * 1e6:9.1f} us, Triton {t_triton * 1e6:9.1f} us "
              f"({t_torch / t_triton:.2f}x); {touched} experts' weights at "
              f"{touched * expert_bytes / t_triton / 1e12:.2f} TB/s = {hbm * 100:.1f}% of 4.8 TB/s; "
              f"rel err {err:.1e} {'ok' if err < 2e-2 else 'FAILED'}")
        del out, want
    if not all(c["ok"] for c in cases):
        raise RuntimeError("the Triton fused_moe differs from the float32 computation")


def section_readiness(args, report):
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pageserve.loadtest.gpu_readiness", "--out", tmp] + (["--smoke"] if args.smoke else [])
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        path = Path(tmp) / "gpu_readiness.json"
        report["readiness"] = json.loads(path.read_text()) if path.exists() else {}
    if proc.returncode:
        raise RuntimeError(f"readiness checks failed: {report['readiness'].get('failed', 'no report')}")


def check_device(smoke: bool) -> torch.device | None:
    """The GPU, or with --smoke the CPU under Triton's interpreter; None, said on stderr, when
    there is no GPU and no --smoke."""
    if not torch.cuda.is_available():
        if not smoke:
            print("no CUDA device: run on the GPU machine, or pass --smoke", file=sys.stderr)
            return None
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gpu_check.json")
    parser.add_argument("--sections",
                        default="graphs,tests,shapes,decode,prefill,engine,nano,profile,serve,readiness,moe,quant,lora")
    parser.add_argument("--tests-timeout", type=float, default=240, help="seconds for the kernel tests")
    args = parser.parse_args()
    device = check_device(args.smoke)
    if device is None:
        return 2
    import triton

    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
              "torch": torch.__version__, "triton": triton.__version__, "smoke": args.smoke, "failed": []}
    print(f"== gpu_check on {report['device']}, torch {torch.__version__}, triton {triton.__version__} ==")
    sections = {"tests": section_kernel_tests, "shapes": section_large_shapes, "graphs": section_graphs,
                "decode": section_decode_bench, "engine": section_engine, "nano": section_nano,
                "profile": section_profile, "serve": section_serve,
                "prefill": lambda args, report, device: section_prefill(args, report, device, paged_batch, timed),
                "readiness": section_readiness, "moe": section_moe, "quant": section_quant, "lora": section_lora}
    start = time.perf_counter()
    for name in args.sections.split(","):
        print(f"\n-- {name} --", flush=True)
        t0 = time.perf_counter()
        try:
            if name in ("tests", "readiness"):  # in processes of their own
                sections[name](args, report)
            elif name in ("engine", "graphs", "nano", "profile", "serve"):  # the engine manages its own inference mode
                sections[name](args, report, device)
            else:
                with torch.inference_mode():
                    sections[name](args, report, device)
        except Exception:
            traceback.print_exc()
            report["failed"].append(name)
        print(f"-- {name}: {time.perf_counter() - t0:.0f} s", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        report["seconds"] = time.perf_counter() - start
        # after every section, so that a run cut short keeps what it measured
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"\n== done in {report['seconds']:.0f} s; failed sections: {report['failed'] or 'none'} ==")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
