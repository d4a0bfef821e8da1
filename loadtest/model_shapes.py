"""Random-weight models of a public model's exact shape (`--shape`), built once into the cache.

The weights are noise, so the figures measure speed only; the tokenizer is loadtest/tiny_model.py's
384-token one (the engine takes ids past it, which decode to no text)."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

# Qwen2.5-0.5B's config.json, less its special token ids (the tokenizer's are used instead)
QWEN2_5_0_5B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}
# the same family on CPU sizes; a vocabulary past the tokenizer's, as the real shape has
TINY = {**QWEN2_5_0_5B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
        "max_position_embeddings": 4096}
SHAPES = {"qwen2.5-0.5b": QWEN2_5_0_5B, "tiny": TINY}


def shape_config(name: str, **overrides) -> dict:
    """The config fields of shape `name` (a copy), with `overrides` (e.g. fewer layers) applied."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}: choose from {', '.join(SHAPES)}")
    return {**SHAPES[name], **overrides}


def shape_of(config: dict) -> dict:
    """A model's config.json read back as the fields above (transformers 5 writes `dtype` and
    nests `rope_theta` in `rope_parameters`)."""
    rope = config.get("rope_parameters") or {}
    found = {"torch_dtype": config.get("dtype"), "rope_theta": rope.get("rope_theta")}
    return {k: config[k] if k in config else found.get(k) for k in QWEN2_5_0_5B}


def build_shape(name: str, root: Path | None = None, **overrides) -> Path:
    """The model directory of shape `name`: under `root` (default: the cache root's `shapes/`),
    named by the shape and a digest of its fields, built on first use in bfloat16 safetensors."""
    import torch

    from pageserve.loadtest.tiny_model import build_tiny_model
    from pageserve.runtime.models.loader import cache_root, publish

    config = shape_config(name, **overrides)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
    root = Path(root) if root is not None else cache_root() / "shapes"
    out = root / f"{name}-{digest}"
    if (out / "config.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{name}-"))  # renamed into place once whole
    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    build_tiny_model(tmp, arch=config["model_type"], weights_dtype=getattr(torch, config["torch_dtype"]),
                     initializer_range=0.02, **fields)
    try:
        publish(tmp, out, "config.json")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
