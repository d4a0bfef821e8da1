"""No kernel compiles a new variant when only the step's shape changes: the batch size, the
token count, the block-table width or the partition count. Each launch's specialization key is
the one Triton's CUDA launcher computes (triton_kernels.variants), so this runs under the
interpreter too. Head dims 80 and 24: one token's views of the fused QKV output and of the
RoPE table then report token strides of another divisibility by 16 than several tokens' do."""

from __future__ import annotations

import pytest
import torch

from pageserve.triton_kernels import torch_ops
from pageserve.triton_kernels.apply_token_bitmask import apply_token_bitmask
from pageserve.triton_kernels.paged_attention import paged_attention
from pageserve.triton_kernels.reshape_and_cache import reshape_and_cache
from pageserve.triton_kernels.rms_norm import rms_norm
from pageserve.triton_kernels.rotary_embedding import rotary_embedding
from pageserve.triton_kernels.silu_and_mul import silu_and_mul
from pageserve.triton_kernels.variants import VariantLog, compiled_variants, launched_kernels

pytestmark = pytest.mark.unit

BLOCK = 16
# (query lengths, context lengths, block-table width): batch sizes 1, 2 and 3, token counts
# 1, 2, 16 and 17, tables 16 and 17 blocks wide (so divisible by 16 or not)
STEPS = [([1], [9], 16), ([1, 1], [40, 200], 17), ([16], [16], 16), ([9, 1, 7], [30, 5, 60], 17)]


def run_step(q_lens, ctx_lens, width, heads, device, split=False):
    """Every launcher once, on tensors laid out as the model lays them out."""
    num_heads, num_kv_heads, head_dim = heads
    tokens = sum(q_lens)
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g).to(device)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    q = q.reshape(tokens, num_heads, head_dim)
    k = k.reshape(tokens, num_kv_heads, head_dim)
    v = v.reshape(tokens, num_kv_heads, head_dim)
    table = torch.arange(80, dtype=torch.int32)
    cache = torch.zeros(2, 80, num_kv_heads, BLOCK, head_dim, device=device)
    positions = torch.tensor([c - n + i for n, c in zip(q_lens, ctx_lens) for i in range(n)])
    freqs = torch.randn(256, head_dim, generator=g).to(device)
    cos, sin = torch_ops.rope_cos_sin(positions.to(device), freqs, torch.float32)
    rotary_embedding(q, k, cos, sin)
    slots = (positions + BLOCK).to(device)
    reshape_and_cache(k, v, cache[0], cache[1], slots)
    block_tables = table[:width].repeat(len(q_lens), 1).to(device)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    seq_lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    parts = -(-max(ctx_lens) // 16) if split else 0
    paged_attention(q, cache[0], cache[1], block_tables, qsl, seq_lens, head_dim ** -0.5, max(q_lens),
                    max(ctx_lens), num_partitions=parts, partition_size=16, block_n=16)
    hidden = torch.randn(tokens, 64, generator=g).to(device)
    weight = torch.ones(64, device=device)
    rms_norm(hidden, weight, 1e-6)
    rms_norm(hidden, weight, 1e-6, hidden)
    silu_and_mul(torch.randn(tokens, 128, generator=g).to(device))
    logits = torch.randn(len(q_lens), 100, generator=g).to(device)
    apply_token_bitmask(logits, torch.full((len(q_lens), 4), -1, dtype=torch.int32, device=device))


@pytest.mark.parametrize("heads", [(4, 2, 80), (2, 1, 24)])
def test_step_shapes_compile_no_new_variant(device, heads):
    with VariantLog() as log:
        for q_lens, ctx_lens, width in STEPS:
            run_step(q_lens, ctx_lens, width, heads, device)
        for ctx_lens, width in (([40], 16), ([40, 200], 17), ([100, 3, 7], 16)):  # split decodes
            run_step([1] * len(ctx_lens), ctx_lens, width, heads, device, split=True)
    counts = {name: len(keys) for name, keys in log.keys.items()}
    # paged attention: its prefill (mixed), decode and split-decode paths; rms_norm: with and
    # without the residual; every other kernel: one variant
    want = {name: 1 for name in launched_kernels()}
    want.update(_paged_attention_kernel=3, _rms_norm_kernel=2)
    assert counts == want


def test_every_launched_kernel_is_watched():
    """A kernel added without the `_kernel` suffix would escape the variant counts."""
    import pageserve.triton_kernels.variants as variants

    jitted = {name for module in variants.KERNEL_MODULES for name, obj in vars(module).items()
              if hasattr(obj, "pre_run_hooks") and hasattr(obj, "fn")}
    helpers = {"_find_seq", "_dot"}  # device functions, called from kernels, never launched
    assert jitted - helpers == set(launched_kernels())
    assert len(launched_kernels()) == 7


def test_compiled_variants_reads_the_jit_caches(device):
    """On CUDA the count comes from Triton's own caches; the interpreter keeps none."""
    run_step([1], [9], 16, (4, 2, 80), device)
    run_step([1], [40], 16, (4, 2, 80), device, split=True)  # the reduce too
    counts = compiled_variants()
    assert set(counts) == set(launched_kernels())
    if device == "cuda":
        assert all(n >= 1 for n in counts.values())
    else:
        assert all(n == 0 for n in counts.values())
