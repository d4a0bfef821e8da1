"""A copy of a model directory with float8 KV-cache scales as llm-compressor writes them: the
config's `quantization_config` gets a compressed-tensors `kv_cache_scheme` (static symmetric
float8, per tensor or per attention head) and every attention layer a `k_scale` and a `v_scale`
tensor. The scales are calibrated here from Hugging Face float32's K (after RoPE) and V on a few
chat prompts: the largest magnitude over 448, float8 e4m3's largest value.

    python -m pageserve.loadtest.kv_scales_copy /tmp/smollm2-kv --strategy tensor
    pageserve bench accuracy --model /tmp/smollm2-kv --dtypes bfloat16,bfloat16/fp8
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from pageserve.loadtest.bf16_copy import copy_model_files
from pageserve.runtime.models.gguf_file import dense_copy
from pageserve.runtime.models.loader import resolve_model

FP8_MAX = 448.0
STRATEGIES = ("tensor", "attn_head")
CALIBRATION = [
    "Tell me about the history of the printing press.", "How do I sort a list of dictionaries in Python?",
    "What should I pack for a week of hiking?", "Explain the difference between weather and climate.",
    "Write a short story about a lighthouse keeper.", "What is a prime number?",
    "Give me three ideas for a birthday party.", "How does a refrigerator keep food cold?",
]


def calibrate(src: Path, prompts: list[list[int]], strategy: str = "tensor") -> dict[int, tuple[torch.Tensor, ...]]:
    """Per layer (k_scale, v_scale), float32 [1] or [KV heads]: the largest |K| and |V| that HF
    float32 computes over `prompts` (token ids), over 448."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dims = (0, 2, 3) if strategy == "attn_head" else (0, 1, 2, 3)
    amax: dict[int, list[torch.Tensor]] = {}

    def observe(module, query, key, value, attention_mask, **kw):
        seen = [key.abs().amax(dim=dims), value.abs().amax(dim=dims)]
        old = amax.get(module.layer_idx)
        amax[module.layer_idx] = seen if old is None else [torch.maximum(a, b) for a, b in zip(old, seen)]
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("pageserve_kv_observe", observe)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32,
                                                 attn_implementation="pageserve_kv_observe")
    with torch.inference_mode():
        for ids in prompts:
            model(torch.tensor([ids]))
    return {i: tuple((a.float() / FP8_MAX).clamp(min=1e-8).reshape(-1) for a in kv) for i, kv in amax.items()}


def add_kv_scales(model_dir: Path, scales: dict[int, tuple[torch.Tensor, torch.Tensor]], strategy: str) -> None:
    """Writes `scales` (per layer index (k_scale, v_scale): one value, or one a KV head under
    attn_head) into `model_dir`'s safetensors and its config's kv_cache_scheme, in
    compressed-tensors' layout (shape [1] per tensor, [KV heads, 1, 1] per head)."""
    from safetensors.torch import load_file, save_file

    files = sorted(model_dir.glob("*.safetensors"))
    tensors = load_file(files[-1])
    for i, (k, v) in scales.items():
        for part, s in (("k", k), ("v", v)):
            s = s.to(torch.float32).reshape(-1)
            tensors[f"model.layers.{i}.self_attn.{part}_scale"] = s[:, None, None] if strategy == "attn_head" else s
    save_file(tensors, files[-1], metadata={"format": "pt"})
    index = model_dir / "model.safetensors.index.json"
    if index.exists():  # a sharded checkpoint: the scales live in the last file
        idx = json.loads(index.read_text())
        idx["weight_map"].update({f"model.layers.{i}.self_attn.{p}_scale": files[-1].name
                                  for i in scales for p in "kv"})
        index.write_text(json.dumps(idx, indent=1))
    cfg = json.loads((model_dir / "config.json").read_text())
    q = cfg.setdefault("quantization_config", {"quant_method": "compressed-tensors", "format": "dense",
                                               "quantization_status": "compressed", "config_groups": {}})
    q["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy,
                            "dynamic": False}
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=1))


def kv_scales_copy(src: Path, out: Path, strategy: str = "tensor") -> Path:
    """`src` (a directory of safetensors) copied into `out` with scales calibrated on CALIBRATION's
    chat prompts."""
    from transformers import AutoTokenizer

    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}")
    src = dense_copy(src)
    copy_model_files(src, out)
    for f in src.glob("*.safetensors"):
        shutil.copy2(f, out / f.name)
    if (src / "model.safetensors.index.json").exists():
        shutil.copy2(src / "model.safetensors.index.json", out)
    tok = AutoTokenizer.from_pretrained(str(src))
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False) for q in CALIBRATION]
    add_kv_scales(out, calibrate(src, prompts, strategy), strategy)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="directory to write")
    p.add_argument("--model", default=None, help="model directory or .gguf (default: the default model)")
    p.add_argument("--strategy", default="tensor", choices=STRATEGIES)
    args = p.parse_args()
    print(kv_scales_copy(resolve_model(args.model), args.out, args.strategy))


if __name__ == "__main__":
    main()
