"""What transformers' GGUF reader gets wrong or drops from a file's metadata, written into the
config.json of the file's converted folder (loader.convert_gguf): a mixture of experts' sizes
and Mixtral's experts; Phi-3's sliding window, partial rotary share and LongRoPE factors."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np

from pageserve.runtime.models.gguf_file import Entry, read_metadata, read_tensor
from pageserve.runtime.models.loader import ModelLoadError
from pageserve.runtime.models.rope import longrope_attention_factor


def fix_config(folder: Path, path: Path) -> None:
    """`folder`'s config.json made to say what the GGUF file at `path` says."""
    cfg = json.loads((folder / "config.json").read_text())
    changed = {k: v for k, v in {**_experts_config(cfg, path), **_phi3_config(cfg, path)}.items() if cfg.get(k) != v}
    if changed:
        _rewrite_config(folder, path, changed)


def _metadata(path: Path) -> tuple[str, list[Entry], dict[str, int | float]]:
    try:
        return read_metadata(path)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None


def _rewrite_config(folder: Path, path: Path, changed: dict) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changed)
    tmp = folder / f".config.json.{os.getpid()}"
    try:
        tmp.write_text(json.dumps(cfg, indent=2) + "\n")
        os.replace(tmp, folder / "config.json")  # replaced whole
    except OSError as e:
        raise ModelLoadError(f"{folder}/config.json differs from {path} in {sorted(changed)}, and cannot be "
                             f"rewritten ({e}): delete the folder") from None


def _phi3_config(cfg: dict, path: Path) -> dict:
    """A Phi-3 GGUF (llama.cpp's "phi3"): transformers' reader drops its sliding window (the 4k
    models' 2,047), the share of each head RoPE turns (Phi-4-mini's 0.75) and LongRoPE (the 128k
    models' and Phi-4-mini's factors, kept as two tensors, and the original context). The keys
    that differ from `cfg`, as transformers 5 lays them out."""
    if cfg.get("model_type") != "phi3":
        return {}
    arch, entries, values = _metadata(path)
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    read = cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 1e4)}
    rope, changed = dict(read), {}
    turned = values.get(f"{arch}.rope.dimension_count", head_dim)
    if turned != head_dim:  # a share whose product with head_dim truncates back to the count
        share = turned / head_dim
        rope["partial_rotary_factor"] = share if int(head_dim * share) == turned else math.nextafter(share, 1.0)
    factors = {e.name: e for e in entries if e.name.startswith("rope_factors")}
    if factors:
        long, short = factors.get("rope_factors_long.weight"), factors.get("rope_factors_short.weight")
        original = values.get(f"{arch}.rope.scaling.original_context_length")
        if long is None or short is None or len(factors) != 2 or not original:
            raise ModelLoadError(f"{path}: LongRoPE tensors {sorted(factors)} and original context {original}: "
                                 "llama.cpp writes rope_factors_long and rope_factors_short with the original context")
        rope.update(rope_type="longrope", long_factor=_floats(path, long), short_factor=_floats(path, short),
                    original_max_position_embeddings=original)
        changed["original_max_position_embeddings"] = original
        # llama.cpp stores the attention factor transformers computes, rounded to float32: kept
        # only where it is another value
        computed = longrope_attention_factor(cfg["max_position_embeddings"] / original, original)
        stored = values.get(f"{arch}.rope.scaling.attn_factor", computed)
        if abs(stored - computed) > 1e-6 * computed:
            rope["attention_factor"] = float(stored)
    if rope != read:
        changed["rope_parameters"] = rope
    window = values.get(f"{arch}.attention.sliding_window")  # (0: none, as Phi-4's files say)
    if window and cfg.get("sliding_window") != window:
        changed["sliding_window"] = window
    return changed


def _floats(path: Path, e: Entry) -> list[float]:
    """A small float tensor of the file (LongRoPE's factors) as a list."""
    dtype = {0: np.float32, 1: np.float16}.get(e.qtype)
    if dtype is None or len(e.shape) != 1:
        raise ModelLoadError(f"{path}: tensor {e.name} is not a float32 or float16 vector (GGML type {e.qtype}, "
                             f"shape {list(e.shape)})")
    return [float(x) for x in read_tensor(path, e).view(dtype).astype(np.float64)]


def _experts_config(cfg: dict, path: Path) -> dict:
    """A mixture of experts' GGUF: the expert sizes (transformers keeps its config class's
    defaults, Qwen3-MoE's 768, Qwen2-MoE's 1408 and 5632) as the file's expert tensors have
    them; and Mixtral (llama.cpp's "llama" with experts), which it reads as a dense Llama. The
    keys that differ from `cfg`."""
    moe = {"moe_intermediate_size", "shared_expert_intermediate_size"} & cfg.keys()
    dense = cfg.get("model_type") in ("llama", "mistral")  # (transformers' "mistral": a llama file so named)
    if not moe and not dense:
        return {}
    arch, entries, values = _metadata(path)
    sizes, experts = {}, None
    for e in entries:  # numpy shapes: experts [E, rows, columns], the shared expert's gate [rows, columns]
        if e.name.endswith("ffn_gate_exps.weight") and len(e.shape) == 3:
            experts = e.shape
            sizes["moe_intermediate_size"] = e.shape[1]
        elif e.name.endswith("ffn_gate_shexp.weight") and len(e.shape) == 2:
            sizes["shared_expert_intermediate_size"] = e.shape[0]
    if not dense:
        return {k: v for k, v in sizes.items() if k in cfg and cfg[k] != v}
    if experts is not None:  # Mixtral: llama.cpp writes it as a Llama with experts (and no sliding window)
        return dict(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=experts[0],
                    num_experts_per_tok=values.get(f"{arch}.expert_used_count", 2), intermediate_size=experts[1],
                    sliding_window=None)
    if any(re.fullmatch(r"blk\.\d+\.ffn_gate\.\d+\.weight", e.name) for e in entries):
        raise ModelLoadError(f"{path}: a mixture of experts with each expert in tensors of its own, an early "
                             "llama.cpp layout pageserve does not read: convert it again with a current llama.cpp")
    return {}
