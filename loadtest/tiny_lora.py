"""LoRA adapters for tests and benchmarks: made by PEFT itself on a model directory (the
reference format), or written directly in PEFT's layout for a base whose shapes are known (no
base model loaded: how `pageserve bench lora` makes adapters for the default model)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def peft_adapter(base_dir: Path, out_dir: Path, rank: int = 8, alpha: float = 16, seed: int = 0,
                 targets: tuple[str, ...] = ALL_TARGETS, use_rslora: bool = False, scale: float = 1.0,
                 base_model=None) -> Path:
    """A LoRA adapter made by PEFT on the model in base_dir (or `base_model`, a loaded copy):
    A and B random (PEFT's init_lora_weights=False, B then scaled by `scale`), so that it
    changes the output."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from pageserve.runtime.models.gguf_file import dense_copy

    base = base_model or AutoModelForCausalLM.from_pretrained(str(dense_copy(base_dir)), dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=use_rslora,
                        init_lora_weights=False, lora_dropout=0.0)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)
    model.save_pretrained(str(out_dir))
    model.unload()  # the base model's modules back as they were, for the next adapter
    return out_dir


def write_adapter(out_dir: Path, shapes: dict[str, tuple[int, int]], num_layers: int, rank: int = 16,
                  alpha: float = 32, seed: int = 0, std: float = 0.02) -> Path:
    """A random adapter in PEFT's layout: `shapes` maps each target module (q_proj, ...) to its
    (in_features, out_features) in the base model."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for module, (fan_in, fan_out) in shapes.items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / math.sqrt(fan_in)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * std
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": sorted(shapes),
              "bias": "none", "use_rslora": False, "modules_to_save": None}
    (out_dir / "adapter_config.json").write_text(json.dumps(config))
    return out_dir


def model_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """Every target module's (in_features, out_features) from a config.json."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
