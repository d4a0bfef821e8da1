"""Tensor parallelism beyond the dense Llama: mixture-of-experts models (every expert split as a
gated MLP, the router whole on each rank, Qwen2-MoE's shared expert split like a dense MLP)
and vocabularies that do not divide by the ranks (padded, the padding's logits cut off) give
the same greedy tokens at TP 2 as at TP 1 (CPU, gloo, float32)."""

import random

import pytest
import torch

from pageserve.loadtest.tiny_model import build_tiny_model
from pageserve.runtime import LLM, SamplingParams
from pageserve.runtime.config import ModelConfig
from pageserve.runtime.executor import ExecutorDeadError
from pageserve.runtime.models import parallel
from tests.test_tensor_parallel import _children

pytestmark = pytest.mark.engine


def greedy(path, tp, prompts, max_tokens=16):
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=tp, max_model_len=512, kv_cache_memory=0.01,
              swap_space=0, max_num_batched_tokens=64, debug_checks=True)
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [sorted(p) for p in o.outputs[0].logprobs]) for o in outs]
    finally:
        llm.engine.shutdown()


def prompts(seed=0, vocab=384):
    """Prompts chunked at 64 tokens, two behind a shared prefix (a prefix hit)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    return [shared + [rng.randrange(3, vocab) for _ in range(n)] for n in (90, 7)] + \
        [[rng.randrange(3, vocab) for _ in range(n)] for n in (150, 12, 33)]


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_tp2_same_tokens_as_tp1(arch, tmp_path):
    # Qwen2-MoE: a dense layer (mlp_only_layers) beside a sparse one with its shared expert
    extra = {"mlp_only_layers": [0]} if arch == "qwen2_moe" else {}
    path = build_tiny_model(tmp_path / arch, arch=arch, **extra)
    ps = prompts()
    tp1, tp2 = greedy(path, 1, ps), greedy(path, 2, ps)
    assert tp2 == tp1
    assert len({tuple(t) for t, _ in tp1}) == len(ps)  # the prompts did not all collapse to one answer


@pytest.mark.parametrize("tied", [False, True], ids=["lm_head", "tied"])
def test_odd_vocabulary_tp2_same_tokens_as_tp1(tied, tmp_path):
    """385 ids over two ranks: 256 rows each (193 rounded up to 64), 127 of them padding."""
    path = build_tiny_model(tmp_path / "odd", vocab_size=385, tie_word_embeddings=tied)
    ps = prompts(vocab=385) + [[384, 384, 5, 384]]  # the last id, held by rank 1 next to its padding
    tp1, tp2 = greedy(path, 1, ps), greedy(path, 2, ps)
    assert tp2 == tp1


def _cfg(tp, rank, vocab):
    return ModelConfig(path="", architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=32,
                       intermediate_size=48, num_layers=1, num_heads=8, num_kv_heads=2, head_dim=4,
                       rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None, max_position_embeddings=64,
                       tie_word_embeddings=False, qkv_bias=False, eos_token_ids=(0,), dtype=torch.float32,
                       max_model_len=64, tp_size=tp, tp_rank=rank)


@pytest.mark.parametrize("vocab,tp,rows", [(385, 2, 256), (64, 2, 32), (1001, 4, 256), (49155, 4, 12352)])
def test_vocabulary_parts_pad_and_cover_the_table(vocab, tp, rows):
    table = torch.randn(vocab, 32)
    parts = [parallel.shard("embed_tokens.weight", table, _cfg(tp, r, vocab)) for r in range(tp)]
    assert all(p.shape == (rows, 32) for p in parts)
    whole = torch.cat(parts)
    assert torch.equal(whole[:vocab], table) and not whole[vocab:].any()


def test_expert_mlps_split_and_router_replicated():
    cfg = [_cfg(2, r, 64) for r in range(2)]
    gate, down = torch.randn(48, 32), torch.randn(32, 48)
    router = torch.randn(4, 32)
    for name, t, dim in (("layers.0.mlp.experts.3.gate_proj.weight", gate, 0),
                         ("layers.0.mlp.experts.3.down_proj.weight", down, 1),
                         ("layers.0.mlp.shared_expert.up_proj.weight", gate, 0),
                         ("layers.0.mlp.shared_expert.down_proj.weight", down, 1)):
        assert torch.equal(torch.cat([parallel.shard(name, t, c) for c in cfg], dim=dim), t), name
        assert parallel.shard(name, t, cfg[1]).shape[dim] == t.shape[dim] // 2
    for name in ("layers.0.mlp.gate.weight", "layers.0.mlp.shared_expert_gate.weight"):
        assert all(parallel.shard(name, router, c) is router for c in cfg)


def test_experts_that_do_not_split_are_refused(tmp_path):
    path = build_tiny_model(tmp_path / "moe", arch="qwen3_moe", moe_intermediate_size=50)
    before = _children()
    with pytest.raises(ExecutorDeadError, match=r"experts' intermediate size \(50\) must be divisible by "
                                                r"--tensor-parallel-size \(4\)"):
        LLM(str(path), dtype="float32", tensor_parallel_size=4, kv_cache_memory=0.01, max_model_len=256)
    assert _children() <= before
