"""Gemma 3's multimodal checkpoint (Gemma3ForConditionalGeneration: config.json's text_config,
the language model's weights under language_model., a vision tower and projector beside them)
served as text only: greedy parity with HF's own Gemma3ForConditionalGeneration on text
prompts, chunked, with prefix hits and preemptions, in both weight layouts."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from pageserve.loadtest.tiny_model import ARCHITECTURES, build_tokenizer
from pageserve.runtime import LLM, SamplingParams
from pageserve.runtime.models.loader import ModelLoadError, read_config
from tests.conftest import assert_pool_clean
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.engine

BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # 2 layers, 2 KV heads of 16, float32, 16-token blocks


def build_gemma3_multimodal(path: Path, layout: str = "hub") -> Path:
    """The tiny Gemma 3 text model of tests/test_parity inside a Gemma3ForConditionalGeneration
    with a one-layer vision tower. layout "hub": weights as transformers writes them and the hub
    holds them (language_model.model.*); "model": as transformers 4.5x saved them
    (model.language_model.*, model.vision_tower.*, ...)."""
    import transformers
    from safetensors.torch import load_file, save_file

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(path)
    _, _, extra = ARCHITECTURES["gemma3_text"]
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
                initializer_range=0.15, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                pad_token_id=tok.pad_token_id, **extra)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    # the image tokens at the top of the vocabulary, which the prompts leave out
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    boi_token_index=len(tok) - 3, eoi_token_index=len(tok) - 2,
                                    image_token_index=len(tok) - 1, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    transformers.Gemma3ForConditionalGeneration(cfg).save_pretrained(path, safe_serialization=True)
    if layout == "model":
        file = path / "model.safetensors"
        weights = load_file(file)
        save_file({_model_layout_name(n): t for n, t in weights.items()}, file, metadata={"format": "pt"})
    return path


def _model_layout_name(name: str) -> str:
    if name.startswith("language_model.model."):
        return "model.language_model." + name.removeprefix("language_model.model.")
    return "model." + name  # vision_tower., multi_modal_projector.


def weight_names(model_dir: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return list(f.keys())


def prompts_for(vocab: int) -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(3, vocab - 3) for _ in range(48)]
    return [(shared if i % 2 else []) + [rng.randrange(3, vocab - 3) for _ in range(20 + 22 * i)] for i in range(8)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The hub-layout checkpoint and HF's greedy tokens on it."""
    from transformers import Gemma3ForConditionalGeneration

    model_dir = build_gemma3_multimodal(tmp_path_factory.mktemp("gemma3-mm"))
    hf = Gemma3ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32)
    prompts = prompts_for(hf.config.text_config.vocab_size)
    return model_dir, prompts, hf_greedy(None, prompts, max_new_tokens=20, hf_model=hf)


def test_the_text_config_is_served(reference):
    model_dir, _, _ = reference
    raw = json.loads((model_dir / "config.json").read_text())
    assert "num_attention_heads" not in raw and "vision_config" in raw  # all of it under text_config
    cfg = read_config(model_dir)
    assert cfg["architectures"] == ["Gemma3ForConditionalGeneration"]
    assert cfg["num_attention_heads"] == 4 and cfg["head_dim"] == 16 and cfg["sliding_window"] == 12
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"]
    names = weight_names(model_dir)
    assert any(n.startswith("language_model.model.layers.") for n in names)
    assert any(n.startswith("vision_tower.") for n in names)


@pytest.mark.parametrize("layout", ["hub", "model"])
def test_greedy_parity_text_only(tmp_path, reference, layout):
    model_dir, prompts, expected = reference
    if layout == "model":
        model_dir = build_gemma3_multimodal(tmp_path / "model-layout", layout="model")
        names = weight_names(model_dir)
        assert any(n.startswith("model.language_model.layers.") for n in names)
        assert any(n.startswith("model.vision_tower.") for n in names)
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=24 * BLOCK_BYTES / 2 ** 30,
              swap_space=4 * BLOCK_BYTES / 2 ** 30, max_model_len=256, max_num_batched_tokens=64,
              debug_checks=True)
    assert llm.engine.config.model.architecture == "Gemma3ForConditionalGeneration"
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert_pool_clean(llm.engine)
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.kv.prefix_hits > 0
    for i, (o, e) in enumerate(zip(outs, expected)):
        assert o.outputs[0].token_ids == e, f"{layout}: prompt {i} ({len(prompts[i])} tokens) diverges"


def test_a_config_without_text_config_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"],
                                                      "hidden_size": 64}))
    with pytest.raises(ModelLoadError, match="has no text_config"):
        read_config(tmp_path)


@pytest.mark.server
def test_chat_through_the_server(reference):
    """One streamed chat on the multimodal checkpoint with Gemma 3's real chat template: the
    greedy continuation HF's Gemma3ForConditionalGeneration gives the rendered prompt."""
    from transformers import AutoTokenizer, Gemma3ForConditionalGeneration

    from tests.test_models_served import MESSAGES, TEMPLATES, assert_served_chat

    model_dir, _, _ = reference
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = (TEMPLATES / "gemma3.jinja").read_text()
    tok.save_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert "<start_of_turn>user\n" in text
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    hf = Gemma3ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32)
    expected = hf_greedy(None, [prompt], max_new_tokens=12, hf_model=hf)[0]
    assert_served_chat(model_dir, MESSAGES, len(prompt), tok.decode(expected, skip_special_tokens=True))
