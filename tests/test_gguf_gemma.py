"""Gemma 2 and Gemma 3 from GGUF files: a tiny random-weight model written with the `gguf`
package under llama.cpp's tensor names and keys (norms stored as 1 + w, as llama.cpp's
converter writes them), its config and tokenizer read once through transformers into the cache,
its weights streamed from the file, then served with greedy parity against HF on the same dense
weights."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from pageserve.loadtest.tiny_model import build_tiny_model
from pageserve.runtime import LLM, SamplingParams
from pageserve.runtime.models.loader import ModelLoadError, resolve_model
from tests.conftest import assert_pool_clean
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.engine

gguf = pytest.importorskip("gguf")


def sentencepiece_vocab(size: int) -> tuple[list[str], list[int]]:
    """Gemma's layout in small: <pad> <eos> <bos> <unk>, the 256 byte tokens, letters and a few
    words (merges are derived from them), then unused slots up to `size`."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.UNKNOWN] + [gguf.TokenType.BYTE] * 256
    words = ["\u2581"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + [
        "he", "ll", "llo", "hello", "\u2581w", "or", "orl", "orld", "\u2581world", "\u2581h", "\u2581hello", "th",
        "\u2581th", "\u2581the", "in", "an", "er", "on", "re", "at"]
    for word in words:
        if word not in tokens:
            tokens.append(word)
            types.append(gguf.TokenType.NORMAL)
    while len(tokens) < size:
        tokens.append(f"<unused{len(tokens)}>")
        types.append(gguf.TokenType.USER_DEFINED)
    return tokens, types


def add_model_keys(w, cfg: dict, head_dim: bool = False) -> None:
    """An HF config's shape as llama.cpp's keys (and the head size, where it is not hidden /
    heads), with a Gemma-style sentencepiece vocabulary of its size."""
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if head_dim:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    tokens, types = sentencepiece_vocab(cfg["vocab_size"])
    w.add_tokenizer_model("llama")  # Gemma's files: a sentencepiece vocabulary, no merges
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores([-float(i) for i in range(len(tokens))])
    w.add_pad_token_id(0)
    w.add_eos_token_id(1)
    w.add_bos_token_id(2)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)


def write_gguf(model_dir: Path, out: Path, arch: str, qtype_of=None) -> Path:
    """The HF model in `model_dir` as a GGUF file of llama.cpp architecture `arch`, with a
    Gemma-style sentencepiece vocabulary of its size; each tensor float32, or quantized by gguf
    to `qtype_of(its GGUF name)` where that is not None."""
    from safetensors.torch import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    w = gguf.GGUFWriter(str(out), arch=arch)
    add_model_keys(w, cfg, head_dim=arch.startswith("gemma"))
    if arch.startswith("gemma"):
        w.add_sliding_window(cfg["sliding_window"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    names = gguf.TensorNameMap(getattr(gguf.MODEL_ARCH, arch.upper()), cfg["num_hidden_layers"])
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        gguf_name = names.get_name(name, try_suffixes=(".weight",))
        assert gguf_name, f"no GGUF name for {name}"
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            tensor = tensor + 1  # Gemma's (1 + w) norms, stored shifted by llama.cpp
        qtype = qtype_of(gguf_name) if qtype_of else None
        if qtype is None:
            w.add_tensor(gguf_name, tensor.float().numpy())
        else:
            w.add_tensor(gguf_name, gguf.quants.quantize(tensor.float().numpy(), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def hf_from_gguf(path: Path):
    """HF's model read from the GGUF, dequantized (the dense form both sides compute with)."""
    from transformers import AutoModelForCausalLM, GgufConfig

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                quantization_config=GgufConfig(dequantize=True))


# GGUF keeps no query_pre_attn_scalar, soft-caps or layer plan: transformers reads the configs'
# defaults for them (scalar 256; Gemma 2 caps 50 and 30; Gemma 3 five sliding layers to one
# global, so both of a 2-layer model slide). The tiny Gemma 2 takes those values, so that its
# GGUF is the same model; Gemma 3's GGUF is a model of its own, its reference read from it.
CASES = {
    "gemma2": ("gemma2", "Gemma2ForCausalLM", dict(query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                                                   final_logit_softcapping=30.0)),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM", {}),
}


@pytest.mark.parametrize("arch", list(CASES))
def test_gemma_gguf_greedy_parity(tmp_path, own_cache, arch):
    tiny, architecture, overrides = CASES[arch]
    model_dir = build_tiny_model(tmp_path / "hf", arch=tiny, **overrides)
    path = write_gguf(model_dir, tmp_path / f"tiny-{arch}.gguf", arch)
    rng = random.Random(11)
    shared = [rng.randrange(3, 384) for _ in range(40)]
    prompts = [(shared if i % 2 else []) + [rng.randrange(3, 384) for _ in range(15 + 30 * i)] for i in range(5)]
    hf = hf_from_gguf(path)
    expected = hf_greedy(None, prompts, max_new_tokens=16, hf_model=hf)
    if arch == "gemma2":  # lossless: the same tokens as the safetensors model it was written from
        assert expected == hf_greedy(model_dir, prompts, max_new_tokens=16)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.01, max_num_batched_tokens=64, debug_checks=True)
    converted = list((own_cache / "gguf").iterdir())
    assert len(converted) == 1 and not list(converted[0].glob("*.safetensors"))  # the weights stay in the file
    cfg = json.loads((converted[0] / "config.json").read_text())
    assert cfg["architectures"] == [architecture] and llm.engine.config.model.architecture == architecture
    assert resolve_model(str(path)) == converted[0]  # later starts read the cache
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert_pool_clean(llm.engine)
    assert llm.engine.kv.prefix_hits > 0
    for i, (o, e) in enumerate(zip(outs, expected)):
        assert o.outputs[0].token_ids == e, f"{arch}: prompt {i} ({len(prompts[i])} tokens) diverges"
    # the tokenizer came through the GGUF and the cache too
    text = "hello world, the end"
    assert llm.engine.tokenizer(text).input_ids == hf_tokenizer_ids(path, text)
    assert llm.engine.tokenizer.decode(hf_tokenizer_ids(path, text), skip_special_tokens=True) == text


def hf_tokenizer_ids(path: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)(text).input_ids


def write_phi3_gguf(model_dir: Path, out: Path, drop: str | None = None, attn_factor: float | None = None) -> Path:
    """The HF Phi-3 checkpoint in `model_dir` as llama.cpp's converter writes it: fused qkv and
    gate/up, the RoPE share as a dimension count, the window (0 for none), and LongRoPE as
    the original context, the attention factor (as transformers computes it, or `attn_factor`)
    and two float32 factor tensors (`drop` one)."""
    from safetensors.torch import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    rope = cfg["rope_parameters"]
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    w = gguf.GGUFWriter(str(out), arch="phi3")
    add_model_keys(w, cfg)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(cfg.get("sliding_window") or 0)
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.PHI3, cfg["num_hidden_layers"])
    for name, tensor in load_file(model_dir / "model.safetensors").items():
        w.add_tensor(names.get_name(name, try_suffixes=(".weight",)), tensor.float().numpy())
    if rope["rope_type"] == "longrope":
        original = cfg["original_max_position_embeddings"]
        w.add_rope_scaling_orig_ctx_len(original)
        scale = cfg["max_position_embeddings"] / original
        w.add_rope_scaling_attn_factors(attn_factor or math.sqrt(1 + math.log(scale) / math.log(original)))
        for kind in ("long", "short"):
            if kind != drop:
                w.add_tensor(f"rope_factors_{kind}.weight", np.array(rope[f"{kind}_factor"], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


# (tiny architecture, overrides, prompt lengths, max_model_len): the 4k models' window; Phi-4-mini's
# shape (LongRoPE over half of each head, a window) within the original 256 positions, so that both
# sides take the short factors; the 128k models' shape past them, where both take the long ones
PHI3_CASES = {
    "window": ("phi3", dict(sliding_window=12, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
               (9, 30, 47), None),
    "partial rotary, short factors": ("phi3_partial", {}, (9, 30, 47), 256),
    "long factors": ("phi3", {}, (260, 290), None),
}


@pytest.mark.parametrize("case", list(PHI3_CASES))
def test_phi3_gguf_keys_transformers_drops(tmp_path, own_cache, case):
    """A Phi-3 GGUF: transformers' reader drops llama.cpp's phi3 keys for the sliding window,
    the rotary dimension count and LongRoPE (the factor tensors, the original context). Each is
    read from the file, and the model then gives the greedy tokens of the checkpoint it was
    written from."""
    tiny, overrides, lengths, max_model_len = PHI3_CASES[case]
    model_dir = build_tiny_model(tmp_path / "hf", arch=tiny, **overrides)
    path = write_phi3_gguf(model_dir, tmp_path / "tiny-phi3.gguf")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in lengths]
    expected = hf_greedy(model_dir, prompts, max_new_tokens=12)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.01, max_num_batched_tokens=64,
              max_model_len=max_model_len)
    hf = json.loads((model_dir / "config.json").read_text())
    model = llm.engine.config.model
    assert (model.sliding_window or None) == hf.get("sliding_window")  # (0: none)
    assert model.rotary_dim == int(model.head_dim * hf["rope_parameters"].get("partial_rotary_factor", 1.0))
    for key in ("long_factor", "short_factor"):  # as float32, which the file keeps and the RoPE table takes
        assert np.array_equal(np.float32((model.rope_scaling or {}).get(key, [])),
                              np.float32(hf["rope_parameters"].get(key, [])))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected


def test_phi3_gguf_attention_factor_kept_where_it_is_not_transformers_own(tmp_path, own_cache):
    """The file's attention factor goes into the config only where it differs from the one
    transformers computes; a later start on the converted folder rewrites nothing."""
    model_dir = build_tiny_model(tmp_path / "hf", arch="phi3")
    for factor, kept in ((None, None), (1.25, 1.25)):
        path = write_phi3_gguf(model_dir, tmp_path / f"tiny-phi3-{factor}.gguf", attn_factor=factor)
        folder = resolve_model(str(path))
        config = folder / "config.json"
        rope = json.loads(config.read_text())["rope_parameters"]
        assert rope["rope_type"] == "longrope" and rope.get("attention_factor") == kept
        written = config.stat().st_mtime_ns
        assert resolve_model(str(path)) == folder and config.stat().st_mtime_ns == written


def test_phi3_gguf_with_one_longrope_factor_tensor_is_refused(tmp_path, own_cache):
    model_dir = build_tiny_model(tmp_path / "hf", arch="phi3")
    path = write_phi3_gguf(model_dir, tmp_path / "tiny-phi3.gguf", drop="short")
    with pytest.raises(ModelLoadError, match=r"LongRoPE tensors \['rope_factors_long.weight'\]"):
        LLM(str(path), dtype="float32", kv_cache_memory=0.01)
