"""The GPU check's prefill section: the paged Triton attention on prompt chunks at scale against
SDPA (flash where it runs) on the same data laid out contiguously, causal. Qwen2.5-0.5B's heads
(14 query, 2 KV, head dim 64) and Llama-8B's (32, 8, 128), bf16, 16-token blocks: a step of 8
whole prompts of 1,024 tokens (a nano-vllm step's budget), and 2 chunks of 2,048 after 6,144
tokens already cached (a chunked long prompt). Reported: time, effective TFLOP/s (the causal
half of QK^T and PV), the ratio to SDPA, and the largest difference from it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _contiguous(cache: torch.Tensor, blocks: torch.Tensor, seq: int, ctx: int) -> torch.Tensor:
    """[Hkv, ctx, D] of one request's cached K or V."""
    kv = cache[blocks[seq].long()]  # [blocks, Hkv, bs, D]
    return kv.permute(1, 0, 2, 3).reshape(kv.shape[1], -1, kv.shape[3])[:, :ctx]


def _sdpa_prefill(q, kc, vc, bt, q_lens, ctx_lens, scale):
    """Per request: its new tokens' queries against its whole context, causal at the end."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ks = [_contiguous(kc, bt, i, c).unsqueeze(0) for i, c in enumerate(ctx_lens)]
    vs = [_contiguous(vc, bt, i, c).unsqueeze(0) for i, c in enumerate(ctx_lens)]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    qs = [q[starts[i]:starts[i + 1]].transpose(0, 1).unsqueeze(0) for i in range(len(q_lens))]
    masks = []
    for n, c in zip(q_lens, ctx_lens):  # query i (at position c - n + i) sees keys up to it
        masks.append(None if n == c else
                     torch.arange(c, device=q.device)[None, :] <= torch.arange(c - n, c, device=q.device)[:, None])

    def run(backend):
        with sdpa_kernel(backend):
            return [F.scaled_dot_product_attention(qi, ki, vi, attn_mask=m, is_causal=m is None, scale=scale,
                                                   enable_gqa=True)
                    for qi, ki, vi, m in zip(qs, ks, vs, masks)]
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        try:
            run(backend)
        except RuntimeError:
            continue
        return (lambda: run(backend)), backend.name, qs
    raise RuntimeError("no SDPA backend ran")


def section_prefill(args, report, device, paged_batch, timed):
    """paged_batch, timed: gpu_check's helpers (a paged cache of noise; seconds per call)."""
    from pageserve.triton_kernels.paged_attention import paged_attention

    if args.smoke:
        cases = [("tiny, 2 prompts of 48", (4, 2, 32), [48, 48], [48, 48]),
                 ("tiny, chunk of 32 after 64", (4, 2, 32), [32], [96])]
        iters = 1
    else:
        cases = [("Qwen2.5-0.5B heads, 8 prompts of 1024", (14, 2, 64), [1024] * 8, [1024] * 8),
                 ("Qwen2.5-0.5B heads, 2 chunks of 2048 after 6144", (14, 2, 64), [2048] * 2, [8192] * 2),
                 ("Llama-8B heads, 8 prompts of 1024", (32, 8, 128), [1024] * 8, [1024] * 8),
                 ("Llama-8B heads, 2 chunks of 2048 after 6144", (32, 8, 128), [2048] * 2, [8192] * 2)]
        iters = 20
    results = report["prefill"] = []
    for name, heads, q_lens, ctx_lens in cases:
        num_heads, _, head_dim = heads
        q, kc, vc, bt, qsl, sl = paged_batch(q_lens, ctx_lens, heads, 16, torch.bfloat16, device, 3)
        scale = head_dim ** -0.5

        def paged():
            return paged_attention(q, kc, vc, bt, qsl, sl, scale, max(q_lens), max(ctx_lens))

        sdpa, backend, _ = _sdpa_prefill(q, kc, vc, bt, q_lens, ctx_lens, scale)
        ours = paged()
        theirs = torch.cat([o[0].transpose(0, 1) for o in sdpa()])
        err = (ours.float() - theirs.float()).abs().max().item()
        t_paged, t_sdpa = timed(paged, iters), timed(sdpa, iters)
        # causal: each query sees (context before the chunk) + (its place in the chunk)
        pairs = sum(n * (c - n) + n * (n + 1) / 2 for n, c in zip(q_lens, ctx_lens))
        flops = 4 * pairs * num_heads * head_dim
        r = {"case": name, "heads": heads, "q_lens": q_lens, "ctx_lens": ctx_lens, "paged_us": t_paged * 1e6,
             "sdpa_us": t_sdpa * 1e6, "sdpa": backend, "paged_tflops": flops / t_paged / 1e12,
             "sdpa_tflops": flops / t_sdpa / 1e12, "paged_over_sdpa_time": t_paged / t_sdpa, "max_abs_err": err}
        results.append(r)
        print(f"  {name}: paged {t_paged * 1e6:.0f} us ({r['paged_tflops']:.1f} TFLOP/s), SDPA {backend} "
              f"{t_sdpa * 1e6:.0f} us ({r['sdpa_tflops']:.1f}); time ratio {r['paged_over_sdpa_time']:.2f}; "
              f"max |diff| {err:.1e}")
        if err > 3e-2:
            raise RuntimeError(f"prefill attention differs from SDPA: {name}")
        del q, kc, vc, bt
