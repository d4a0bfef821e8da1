"""RoPE tables: each position's cos and sin of the rotary angles, by the model's scaling
(default, linear, llama3, LongRoPE, YaRN), as Hugging Face computes them, over the rotary_dim
values of a head that turn (all of it, or a partial_rotary_factor's share)."""

from __future__ import annotations

import math

import torch

from pageserve.runtime.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig, long_factors: bool = False) -> torch.Tensor:
    """The inverse frequencies of the rotary_dim / 2 pairs; LongRoPE's short factors, or its
    long ones (`long_factors`)."""
    dim = cfg.rotary_dim
    powers = cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv_freq = 1.0 / powers
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if kind == "longrope":  # as transformers: 1 / (factor * theta ** (2i / dim))
        factors = scaling["long_factor" if long_factors else "short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * powers)
    if kind == "yarn":
        return yarn_parameters(cfg)[0]
    raise ValueError(f"unsupported RoPE scaling type {kind!r} (supported: default, linear, llama3, longrope, yarn)")


def longrope_attention_factor(factor: float, original: int) -> float:
    """LongRoPE's cos/sin scale where the config gives none, as transformers computes it."""
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_parameters(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """YaRN (Qwen2.5's and Qwen3's long-context setting), as Hugging Face computes it: the
    frequencies that turn more than beta_fast times over the original context kept, those that
    turn fewer than beta_slow times divided by the factor, a linear ramp between; cos and sin
    scaled by the attention factor (0.1 ln(factor) + 1, or the mscale ratio). Returns (inverse
    frequencies, attention factor)."""
    s, dim, base = cfg.rope_scaling, cfg.rotary_dim, cfg.rope_theta
    original = rope_original_length(cfg)
    factor = s.get("factor") or cfg.hf_config.get("max_position_embeddings", original) / original
    attention = s.get("attention_factor")
    if attention is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all \
            else yarn_mscale(factor)

    def dim_of(turns):  # the dimension whose frequency turns `turns` times over the original context
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(s.get("beta_fast") or 32), dim_of(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    kept = 1 - ramp  # the share of each frequency left as it was
    return 1.0 / (factor * freqs) * (1 - kept) + 1.0 / freqs * kept, float(attention)


def rope_cos_sin_cache(cfg: ModelConfig) -> torch.Tensor:
    """[max_model_len, rotary_dim] float32: cos of each position's R/2 angles, then their sin.
    LongRoPE (Phi-3): Hugging Face takes the long factors for a sequence longer than
    original_max_position_embeddings and the short ones otherwise. One table cannot do both
    without rotating a query and its keys by different factors, so the choice is the served
    context's: the short factors when --max-model-len fits the original context (exactly HF),
    else the long ones for every request (exactly HF for the requests longer than it; shorter
    ones get the long factors, which HF would not give them). Both scaled by the attention
    factor."""
    pos = torch.arange(cfg.max_model_len, dtype=torch.float32)[:, None]
    scale = 1.0
    scaling = cfg.rope_scaling or {}
    longrope = scaling.get("rope_type", scaling.get("type")) == "longrope"
    inv_freq = rope_inv_freq(cfg, long_factors=longrope and cfg.max_model_len > rope_original_length(cfg))
    if scaling.get("rope_type", scaling.get("type")) == "yarn":
        scale = yarn_parameters(cfg)[1]
    if longrope:
        original = rope_original_length(cfg)
        factor = scaling.get("factor") or cfg.hf_config.get("max_position_embeddings", original) / original
        scale = scaling.get("attention_factor") or longrope_attention_factor(factor, original)
    freqs = pos * inv_freq[None, :]
    return torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)


def rope_original_length(cfg: ModelConfig) -> int:
    """The context a LongRoPE or YaRN model was trained at, as Hugging Face reads it: the
    config's own original_max_position_embeddings, else the RoPE parameters', else
    max_position_embeddings."""
    hf, scaling = cfg.hf_config, cfg.rope_scaling or {}
    return (hf.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
            or hf.get("max_position_embeddings") or cfg.max_position_embeddings)
