"""Greedy token ids identical to HF transformers `generate` on the same float32 weights, with
long prompts chunked (max_num_batched_tokens=64) and mixed with other requests' decodes."""

import json
import random

import pytest
import torch

from pageserve.runtime import LLM, SamplingParams
from tests.conftest import assert_pool_clean
from tests.hf_reference import hf_greedy
from tests.test_sliding_window_kv import force_preemptions
from pageserve.loadtest.tiny_model import build_tiny_model

pytestmark = pytest.mark.engine

PROMPT_LENS = [5, 9, 17, 31, 48, 64, 65, 90, 127, 160, 200, 256, 333, 400, 512, 600]
TEXT = ("PagedAttention stores the key-value cache in fixed-size blocks, like pages of virtual "
        "memory, so that requests of any length share one pool without fragmentation. ")


def random_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]


def run_ours(llm: LLM, prompts, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_pool_clean(llm.engine)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 1,
               "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}}),
    ("qwen2", {}),
    ("qwen2", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 256}}),
], ids=["llama-gqa", "llama3-rope-tied-mqa", "qwen2-bias", "qwen2-yarn"])
def test_tiny_model_parity(tmp_path, arch, overrides):
    model_dir = build_tiny_model(tmp_path / arch, arch=arch, **overrides)
    prompts = random_prompts(384)
    expected = hf_greedy(model_dir, prompts, max_new_tokens=24)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=0.01, max_num_batched_tokens=64,
              debug_checks=True)
    got = run_ours(llm, prompts, 24)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} ({len(prompts[i])} tokens) diverges"


def biased_llama(path):
    """A tiny Llama with attention_bias and mlp_bias (q/k/v/o and gate/up/down biases), the
    biases drawn at random (transformers starts them at zero)."""
    from safetensors.torch import load_file, save_file

    build_tiny_model(path, arch="llama", attention_bias=True, mlp_bias=True)
    file = path / "model.safetensors"
    tensors, gen = load_file(file), torch.Generator().manual_seed(5)
    for name, t in tensors.items():
        if name.endswith(".bias"):
            tensors[name] = torch.randn(t.shape, generator=gen) * 0.5
    save_file(tensors, file, metadata={"format": "pt"})
    return path


def test_llama_biases_parity(tmp_path):
    """Llama's attention_bias (q/k/v and o_proj) and mlp_bias (gate, up, down) against HF."""
    model_dir = biased_llama(tmp_path / "llama")
    prompts = random_prompts(384)[:8]
    expected = hf_greedy(model_dir, prompts, max_new_tokens=16)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=0.01, max_num_batched_tokens=64)
    layer = llm.engine.runner.model.layers[0]
    assert layer.self_attn.o_proj.bias is not None and layer.mlp.down_proj.bias is not None
    assert run_ours(llm, prompts, 16) == expected


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "phi3_partial", "mixtral", "qwen2_moe",
                                  "qwen3_moe", "gemma2", "gemma3_text", "mistral"])
def test_architecture_parity_under_pressure(tmp_path, arch):
    """Each architecture of the registry against HF on its tiny model: prompt chunks of 64
    beside decodes, prompts sharing a 48-token prefix (prefix-cache hits), and a pool of 40
    blocks for eight requests of up to 16 blocks, so that requests are preempted (swapped,
    and recomputed once the 6-block swap space is full) in the middle of the run. An all-sliding
    model (Mistral) frees its blocks before the window and never runs short of that pool, so
    its preemptions are forced."""
    model_dir = build_tiny_model(tmp_path / arch, arch=arch)
    rng = random.Random(7)
    shared = [rng.randrange(3, 384) for _ in range(48)]
    prompts = [(shared if i % 2 else []) + [rng.randrange(3, 384) for _ in range(20 + 22 * i)] for i in range(8)]
    expected = hf_greedy(model_dir, prompts, max_new_tokens=20)
    from pageserve.runtime.models.loader import read_config

    hf = read_config(model_dir)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    block_bytes = 2 * hf["num_hidden_layers"] * 16 * hf["num_key_value_heads"] * head_dim * 4
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=24 * block_bytes / 2 ** 30,
              swap_space=4 * block_bytes / 2 ** 30, max_model_len=256, max_num_batched_tokens=64,
              debug_checks=True)
    if llm.engine.kv.sliding_window:
        force_preemptions(llm.engine)
    got = run_ours(llm, prompts, 20)
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0 and llm.engine.kv.prefix_hits > 0
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"{arch}: prompt {i} ({len(prompts[i])} tokens) diverges"


@pytest.mark.slow
def test_real_model_parity():
    llm = LLM(dtype="float32", kv_cache_memory=0.25, max_model_len=1024, max_num_batched_tokens=64,
              debug_checks=True)
    text_ids = llm.tokenizer.encode(TEXT * 60)
    rng = random.Random(1)
    prompts = []
    for i, n in enumerate(PROMPT_LENS):
        if i % 2:  # half natural text, half random tokens
            start = rng.randrange(0, len(text_ids) - n)
            prompts.append(text_ids[start:start + n])
        else:
            prompts.append([rng.randrange(100, 49000) for _ in range(n)])
    got = run_ours(llm, prompts, 16)
    expected = hf_greedy(llm.engine.config.model.path, prompts, max_new_tokens=16, dtype=torch.float32)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} ({len(prompts[i])} tokens) diverges"


@pytest.mark.parametrize("scaling", [
    {"factor": 4.0, "original_max_position_embeddings": 256},
    {"factor": 40.0, "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.707,
     "beta_fast": 16, "beta_slow": 2, "truncate": False},
    {"factor": 8.0, "attention_factor": 1.25, "original_max_position_embeddings": 128},
], ids=["qwen2.5", "mscale-untruncated", "attention-factor"])
def test_yarn_table_is_hfs(tmp_path, scaling):
    """YaRN's frequencies and attention factor against transformers' own, in each form its
    configs take; the context the engine serves is the original times the factor."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pageserve.runtime.engine_args import EngineArgs
    from pageserve.runtime.models.rope import rope_cos_sin_cache, yarn_parameters
    from pageserve.runtime.models.loader import load_tokenizer, read_config

    params = {"rope_type": "yarn", "rope_theta": 10000.0, **scaling}
    model_dir = build_tiny_model(tmp_path / "qwen2", arch="qwen2", rope_parameters=params)
    hf_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](AutoConfig.from_pretrained(model_dir), torch.device("cpu"))
    args = EngineArgs(model=str(model_dir), dtype="float32", device="cpu")
    cfg = args.model_config(model_dir, read_config(model_dir), load_tokenizer(model_dir), torch.device("cpu"))
    freq, factor = yarn_parameters(cfg)
    assert torch.equal(freq, hf_freq) and factor == pytest.approx(hf_factor, rel=1e-12)
    assert cfg.max_model_len == int(scaling["original_max_position_embeddings"] * scaling["factor"])
    table, angles = rope_cos_sin_cache(cfg), 300 * hf_freq
    torch.testing.assert_close(table[300], torch.cat([angles.cos(), angles.sin()]) * hf_factor)


@pytest.mark.parametrize("max_model_len, factors", [(256, "short"), (512, "long")])
def test_longrope_factors_follow_the_served_context(tmp_path, max_model_len, factors):
    """The short factors while --max-model-len fits the original context (256), the long ones
    for every position past it; both scaled by sqrt(1 + ln(1024 / 256) / ln 256)."""
    import math

    from pageserve.runtime.engine_args import EngineArgs
    from pageserve.runtime.models.rope import rope_cos_sin_cache
    from pageserve.runtime.models.loader import load_tokenizer, read_config

    model_dir = build_tiny_model(tmp_path / "phi3", arch="phi3")
    args = EngineArgs(model=str(model_dir), dtype="float32", device="cpu", max_model_len=max_model_len)
    cfg = args.model_config(model_dir, read_config(model_dir), load_tokenizer(model_dir), torch.device("cpu"))
    table = rope_cos_sin_cache(cfg)
    scale = math.sqrt(1 + math.log(4) / math.log(256))
    base = 1.0 / 10000.0 ** (torch.arange(0, 16, 2).float() / 16)
    chosen = [1.0 + 0.15 * i for i in range(8)] if factors == "short" else [2.0 + i for i in range(8)]
    for pos in (3, 255):
        angles = pos * base / torch.tensor(chosen)
        torch.testing.assert_close(table[pos], torch.cat([angles.cos(), angles.sin()]) * scale)


def test_partial_rotary_parity_in_transformers_4s_layout(tmp_path):
    """Phi-4-mini's config.json as it ships (transformers 4's layout: partial_rotary_factor at the
    top, LongRoPE under rope_scaling, its factors covering the turned half of each head, a
    sliding window longer than its context): the table's frequencies are over that half, the
    other half of each head passes unturned, past the original context (the long factors) as HF
    runs it, and no layer takes the window. The C kernels turn the half through a view of each
    head; the decoder stack is not taken."""
    model_dir = build_tiny_model(tmp_path / "phi3", arch="phi3_partial")
    cfg = json.loads((model_dir / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg.update(partial_rotary_factor=0.5, rope_theta=params["rope_theta"], sliding_window=2048,
               rope_scaling={"type": "longrope", "short_factor": params["short_factor"],
                             "long_factor": params["long_factor"]})
    (model_dir / "config.json").write_text(json.dumps(cfg))
    rng = random.Random(12)
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in (257, 300)]
    expected = hf_greedy(model_dir, prompts, max_new_tokens=12)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=0.01, max_model_len=512,
              max_num_batched_tokens=64, debug_checks=True)
    model = llm.engine.runner.model
    assert model.cfg.rotary_dim == 8 and model.cos_sin_cache.shape == (512, 8) and model.stack_weights() is None
    assert model.cfg.sliding_window == 0 and not any(layer.self_attn.sliding_window for layer in model.layers)
    assert run_ours(llm, prompts, 12) == expected
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    positions = torch.tensor([[0, 5, 257, 300, 511]])
    cos, sin = Phi3RotaryEmbedding(AutoConfig.from_pretrained(model_dir))(torch.zeros(1), positions)
    table = model.cos_sin_cache[positions[0]].cpu()
    assert torch.equal(table, torch.cat([cos[0, :, :4], sin[0, :, :4]], -1))  # HF's LongRoPE table, to the bit


def test_partial_rotary_factor_where_transformers_reads_it(tmp_path):
    """transformers reads partial_rotary_factor from the RoPE parameters before the top level
    of config.json; LongRoPE factors of another length than the turned pairs: one clear error."""
    from pageserve.runtime.engine_args import EngineArgs
    from pageserve.runtime.models.loader import load_tokenizer, read_config

    model_dir = build_tiny_model(tmp_path / "phi3", arch="phi3_partial")
    tokenizer = load_tokenizer(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["partial_rotary_factor"] = 0.75  # the RoPE parameters' 0.5 stands, as in transformers
    (model_dir / "config.json").write_text(json.dumps(cfg))
    args = EngineArgs(model=str(model_dir), dtype="float32", device="cpu")
    assert args.model_config(model_dir, read_config(model_dir), tokenizer, torch.device("cpu")).rotary_dim == 8
    # 12 values turn, and 4 factors do not cover them (transformers' own config check says so too)
    cfg["rope_parameters"]["partial_rotary_factor"] = 0.75
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="LongRoPE's short_factor has 4 values; RoPE over 12 values of each head "
                                         "takes 6"):
        args.model_config(model_dir, read_config(model_dir), tokenizer, torch.device("cpu"))


def test_longrope_parity_past_the_original_context(tmp_path):
    """Prompts longer than the original 256 positions, served with --max-model-len 512: HF
    takes the long factors for such sequences, and so does every position of ours."""
    model_dir = build_tiny_model(tmp_path / "phi3", arch="phi3")
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in (257, 300, 420)]
    expected = hf_greedy(model_dir, prompts, max_new_tokens=12)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=0.01, max_model_len=512,
              max_num_batched_tokens=64, debug_checks=True)
    assert run_ours(llm, prompts, 12) == expected
