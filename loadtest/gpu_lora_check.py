"""The GPU check's lora section (loadtest/gpu_check.py runs it): the multi-LoRA Triton kernels on
Llama-3-8B's fused q/k/v projection (4096 -> 4096 + 1024 + 1024) in bf16, 8 adapter slots of
rank 16, for 1, 16 and 256 tokens spread over the 8 adapters.

The reference is the LoRA delta computed group by group in float32 with torch. Reported: the
largest error of the kernels' delta (shrink then expand into zeros) relative to the reference's
largest value, and the median time of shrink + expand (launched, and replayed from a CUDA graph
as decode steps run it) against the bf16 matmul of the base layer and against the torch grouped
path (torch_ops.lora_delta), all measured in the same run."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pageserve.loadtest.gpu_quant_check import graphed, median_time

SLOTS, RANK = 8, 16
# bf16 rounding of the delta is 2^-8 of its scale; a wrong kernel is off by about 1
MAX_REL_ERR = 1e-2


def make_groups(num_tokens: int, num_slots: int, device, generator):
    """Tokens assigned to the slots at random, grouped by slot: (slot of each token,
    sorted_tokens, group_slots, group_starts, group_counts), the group tensors int32 [S]."""
    slot = torch.randint(0, num_slots, (num_tokens,), generator=generator, device=device)
    order = slot.argsort(stable=True)
    counts = torch.bincount(slot, minlength=num_slots)
    starts = counts.cumsum(0) - counts
    as_int = dict(dtype=torch.int32)
    return (slot, order.to(**as_int), torch.arange(num_slots, device=device, **as_int), starts.to(**as_int),
            counts.to(**as_int))


def reference_delta(x, lora_a, lora_b, slices, slot) -> torch.Tensor:
    """The delta [T, N] in float32, one slot's tokens at a time."""
    rank = lora_b.shape[2]
    delta = torch.zeros(x.shape[0], lora_b.shape[1], device=x.device)
    for s in slot.unique().tolist():
        rows = (slot == s).nonzero().squeeze(1)
        y = x[rows].float() @ lora_a[s].float().t()
        for col, off, size in slices:
            delta[rows, off:off + size] = y[:, col:col + rank] @ lora_b[s, off:off + size].float().t()
    return delta


def section_lora(args, report, device):
    from pageserve.triton_kernels import torch_ops
    from pageserve.triton_kernels.lora import lora_expand, lora_shrink

    if args.smoke:
        k, sizes, batches, iters = 96, (64, 16, 16), (1, 5), 2
    else:  # Llama-3-8B: 32 query heads, 8 KV heads, head dim 128
        k, sizes, batches, iters = 4096, (4096, 1024, 1024), (1, 16, 256), 50
    n = sum(sizes)
    slices = tuple((j * RANK, sum(sizes[:j]), size) for j, size in enumerate(sizes))
    dtype = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    w = (torch.randn(n, k, generator=g, device=device) * k ** -0.5).to(dtype)
    # adapters whose delta is about as large as the base output, so that an error in it shows
    lora_a = (torch.randn(SLOTS, len(sizes) * RANK, k, generator=g, device=device) * k ** -0.5).to(dtype)
    # B as the slots keep it, [S, R, N]; the expand kernel reads it as [S, N, R] through its strides
    lora_bt = (torch.randn(SLOTS, RANK, n, generator=g, device=device) * RANK ** -0.5).to(dtype)
    lora_b = lora_bt.transpose(1, 2)
    cases = []
    report["lora"] = {"k": k, "slices": sizes, "slots": SLOTS, "rank": RANK, "dtype": "bfloat16",
                      "cases": cases}  # filled case by case
    print(f"  q/k/v {k} -> {'+'.join(map(str, sizes))}, {SLOTS} slots of rank {RANK}, bf16:")
    for m in batches:
        x = torch.randn(m, k, generator=g, device=device).to(dtype)
        slot, *groups = make_groups(m, SLOTS, device, g)
        rows = groups[0].long()
        host_groups = [(s, start, count) for s, start, count in
                       zip(groups[1].tolist(), groups[2].tolist(), groups[3].tolist()) if count]

        def triton_lora(out):
            lora_expand(out, lora_shrink(x, lora_a, *groups), lora_b, slices, *groups)

        def torch_lora(out):
            torch_ops.lora_delta(out, x, lora_a, lora_bt, slices, rows, host_groups)

        want = reference_delta(x, lora_a, lora_b, slices, slot)
        delta = torch.zeros(m, n, device=device, dtype=dtype)
        triton_lora(delta)
        err = ((delta.float() - want).abs().max() / want.abs().max()).item()
        out = F.linear(x, w)
        t_bf16 = median_time(lambda: F.linear(x, w), iters)
        t_triton = median_time(lambda: triton_lora(out), iters)
        t_graph = median_time(graphed(lambda: triton_lora(out)), iters)
        t_torch = median_time(lambda: torch_lora(out), iters)
        ok = err < MAX_REL_ERR
        cases.append({"batch": m, "adapters_used": len(host_groups), "lora_us": t_triton * 1e6,
                      "lora_graph_us": t_graph * 1e6, "torch_lora_us": t_torch * 1e6, "bf16_us": t_bf16 * 1e6,
                      "lora_over_bf16": t_triton / t_bf16, "lora_graph_over_bf16": t_graph / t_bf16,
                      "speedup_vs_torch": t_torch / t_triton, "max_rel_err": err, "ok": ok})
        print(f"    M {m:4d} ({len(host_groups)} of {SLOTS} adapters): bf16 matmul {t_bf16 * 1e6:.1f} us; "
              f"shrink + expand {t_triton * 1e6:.1f} us = {t_triton / t_bf16:.2f}x the matmul "
              f"(from a CUDA graph {t_graph * 1e6:.1f} us = {t_graph / t_bf16:.2f}x); torch grouped "
              f"{t_torch * 1e6:.1f} us = {t_torch / t_triton:.2f}x shrink + expand; "
              f"max |err| / max |delta| {err:.1e} {'ok' if ok else 'FAILED'}")
    if not all(c["ok"] for c in cases):
        raise RuntimeError("the LoRA kernels' delta differs from the float32 reference beyond its bound")
