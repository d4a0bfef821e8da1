"""A config.json is read as transformers reads it: what it leaves out takes its config class's
default (Gemma 2's real configs have no tie_word_embeddings, and its checkpoints no lm_head);
what the model code cannot run is refused by name; only the weight files a shard index names
are read. The logprobs of every prompt token match HF's float32 forward."""

from __future__ import annotations

import json
import random

import pytest
import torch

from pageserve.loadtest.tiny_model import build_tiny_model
from pageserve.runtime import LLM, SamplingParams
from pageserve.runtime.models.loader import ModelLoadError

pytestmark = pytest.mark.engine

PROMPT = [random.Random(0).randrange(3, 384) for _ in range(80)]


def drop_keys(path, *keys, **set_keys):
    cfg = json.loads((path / "config.json").read_text())
    for key in keys:
        cfg.pop(key, None)
    cfg.update(set_keys)
    (path / "config.json").write_text(json.dumps(cfg))


def logprobs_against_hf(path) -> float:
    """The largest gap between our prompt logprobs and HF's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = model(torch.tensor([PROMPT])).logits[0].log_softmax(-1)
    ref = ref[:-1].gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.01, max_num_batched_tokens=32)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ours = torch.tensor([out.prompt_logprobs[i][PROMPT[i]].logprob for i in range(1, len(PROMPT))])
    return (ours - ref).abs().max().item()


def test_gemma2_without_the_keys_its_class_defaults(tmp_path):
    """No tie_word_embeddings (tied, so no lm_head in the checkpoint), query_pre_attn_scalar
    (256, not head_dim) or rms_norm_eps (1e-6): loaded, and the same logprobs as HF."""
    path = build_tiny_model(tmp_path / "g2", arch="gemma2", tie_word_embeddings=True, rms_norm_eps=1e-6)
    drop_keys(path, "tie_word_embeddings", "query_pre_attn_scalar", "rms_norm_eps")
    assert logprobs_against_hf(path) < 1e-4


def test_gemma3_leaves_attention_soft_capping_out_as_transformers_does(tmp_path):
    path = build_tiny_model(tmp_path / "g3", arch="gemma3_text", attn_logit_softcapping=2.0)
    assert logprobs_against_hf(path) < 1e-4
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.01)
    assert {layer.self_attn.softcap for layer in llm.engine.runner.model.layers} == {0.0}


def test_gemma_without_rope_or_capping_keys_takes_its_class_s(tmp_path):
    """Gemma 3's two RoPE bases (1e6 global, 1e4 on the sliding layers), Gemma 2's caps (50, 30)."""
    from pageserve.runtime.models.loader import read_config

    g3 = build_tiny_model(tmp_path / "g3", arch="gemma3_text")
    drop_keys(g3, "rope_theta", "rope_local_base_freq", "rope_parameters")
    assert [read_config(g3)[k] for k in ("rope_theta", "rope_local_base_freq")] == [1e6, 1e4]
    g2 = build_tiny_model(tmp_path / "g2", arch="gemma2")
    drop_keys(g2, "attn_logit_softcapping", "final_logit_softcapping")
    assert [read_config(g2)[k] for k in ("attn_logit_softcapping", "final_logit_softcapping")] == [50.0, 30.0]
    assert logprobs_against_hf(g2) < 1e-4


def test_mixtral_without_rms_norm_eps_or_rope_theta_takes_its_class_s(tmp_path):
    path = build_tiny_model(tmp_path / "mx", arch="mixtral", rms_norm_eps=1e-5, rope_theta=1e6)
    drop_keys(path, "rms_norm_eps", "rope_theta", "rope_parameters")  # MixtralConfig's: 1e-5 and 1e6
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.01)
    assert (llm.engine.config.model.rms_norm_eps, llm.engine.config.model.rope_theta) == (1e-5, 1e6)


def test_qwen2_moe_reads_its_own_qkv_bias_key(tmp_path):
    """Qwen2-MoE names the q/k/v bias `qkv_bias` (default true), not `attention_bias`."""
    path = build_tiny_model(tmp_path / "q2", arch="qwen2_moe", qkv_bias=False)
    assert logprobs_against_hf(path) < 1e-4


def test_an_activation_the_mlp_does_not_run_is_refused_by_name(tmp_path):
    path = build_tiny_model(tmp_path / "gelu", hidden_act="gelu")
    with pytest.raises(ModelLoadError, match="hidden_act 'gelu' is not served .*runs silu"):
        LLM(str(path), dtype="float32")


def test_only_the_files_the_shard_index_names_are_read(tmp_path):
    """A Mistral repository holds the HF shards with their index and consolidated.safetensors,
    the same weights under Mistral's own names."""
    from safetensors.torch import load_file, save_file

    path = build_tiny_model(tmp_path / "m", arch="mistral")
    tensors = load_file(path / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    (path / "model.safetensors").unlink()
    for i, part in enumerate((names[:half], names[half:])):
        save_file({n: tensors[n] for n in part}, path / f"model-0000{i + 1}-of-00002.safetensors")
    weight_map = {n: f"model-0000{1 + (j >= half)}-of-00002.safetensors" for j, n in enumerate(names)}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    save_file({"layers.0.attention.wq.weight": torch.zeros(4, 4)}, path / "consolidated.safetensors")
    assert logprobs_against_hf(path) < 1e-4
