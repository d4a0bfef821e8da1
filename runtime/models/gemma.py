"""Gemma 2 and Gemma 3 (text): Llama's shape with the embedding scaled by sqrt(hidden), RMSNorms
that scale by (1 + w) (folded into the weights at load), a norm after attention and after the
MLP as well as before each (four per layer), a GeLU-tanh gated MLP, the attention scale from
query_pre_attn_scalar, and sliding-window attention on the layers config.json's layer_types
marks "sliding_attention". Gemma 2 soft-caps the attention scores and the final logits
(cap * tanh(x / cap)). Gemma 3 adds a per-head
q/k norm and its own RoPE base for the sliding layers (rope_local_base_freq). Gemma 3's
multimodal checkpoint is gemma3_mm.py."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from pageserve.runtime.config import ModelConfig
from pageserve.runtime.kernels import Kernels
from pageserve.runtime.models import parallel
from pageserve.runtime.models.layers import Attention, CausalLM, GatedMLP, RMSNorm
from pageserve.runtime.models.rope import rope_cos_sin_cache


def layer_windows(hf: dict, num_layers: int, pattern: int) -> list[int]:
    """Each layer's sliding window (0: full attention): config.json's layer_types, else every
    `pattern`-th layer global (Gemma 2: 2, Gemma 3: sliding_window_pattern, 6)."""
    window = hf.get("sliding_window") or 0
    types = hf.get("layer_types")
    if types is None:
        pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or pattern
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    return [window if t == "sliding_attention" else 0 for t in types]


def local_rope_config(cfg: ModelConfig) -> ModelConfig:
    """The sliding layers' RoPE: their own base, no scaling (Gemma 3)."""
    hf = cfg.hf_config
    local = (hf.get("rope_parameters") or {}).get("sliding_attention") or {}
    theta = local.get("rope_theta") or hf.get("rope_local_base_freq") or cfg.rope_theta
    return dataclasses.replace(cfg, rope_theta=float(theta), rope_scaling=None)


class GeluTanhMLP(GatedMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = self.kernels.linear
        gate, up = linear(x, self.gate_up_proj.weight).chunk(2, dim=-1)
        out = linear(F.gelu(gate, approximate="tanh") * up, self.down_proj.weight)
        return parallel.all_reduce(out, self.tp_size)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: Kernels, qk_norm: bool, window: int, softcap: float):
        super().__init__()
        self.cfg, self.ops, self.window = cfg, kernels.ops, window
        eps, size = cfg.rms_norm_eps, cfg.hidden_size
        self.self_attn = Attention(cfg, kernels, qk_norm)
        self.self_attn.scale = cfg.hf_config.get("query_pre_attn_scalar", cfg.head_dim) ** -0.5
        self.self_attn.sliding_window = window
        self.self_attn.softcap = softcap
        self.mlp = GeluTanhMLP(size, cfg.intermediate_size, kernels, cfg.tp_size)
        self.input_layernorm = RMSNorm(size, eps)
        self.post_attention_layernorm = RMSNorm(size, eps)
        self.pre_feedforward_layernorm = RMSNorm(size, eps)
        self.post_feedforward_layernorm = RMSNorm(size, eps)

    def forward(self, x, residual, meta, kv_cache, rope):
        rms_norm, eps = self.ops.rms_norm, self.cfg.rms_norm_eps
        x, residual = rms_norm(x, self.input_layernorm.weight, eps, residual)
        x, _ = rms_norm(self.self_attn(x, meta, kv_cache, rope), self.post_attention_layernorm.weight, eps)
        x, residual = rms_norm(x, self.pre_feedforward_layernorm.weight, eps, residual)
        x, _ = rms_norm(self.mlp(x), self.post_feedforward_layernorm.weight, eps)
        return x, residual


class GemmaCausalLM(CausalLM):
    """The Gemma shell; Gemma2ForCausalLM and Gemma3ForCausalLM set what differs."""
    window_pattern = 2
    local_rope = False
    attn_softcap = True  # config.json's attn_logit_softcapping applies (Gemma 3's transformers ignores it)

    @classmethod
    def layer_windows(cls, hf: dict, num_layers: int) -> list[int]:
        return layer_windows(hf, num_layers, cls.window_pattern)

    def __init__(self, cfg: ModelConfig, kernels: Kernels):
        super().__init__(cfg, kernels)
        windows = self.layer_windows(cfg.hf_config, cfg.num_layers)
        softcap = (cfg.hf_config.get("attn_logit_softcapping") or 0.0) if self.attn_softcap else 0.0
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, kernels, self.qk_norm, w, softcap) for w in windows)
        self.final_softcap = cfg.hf_config.get("final_logit_softcapping") or 0.0
        self.local_cos_sin_cache = None

    def embed(self, input_ids: torch.Tensor, images: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = super().embed(input_ids)
        x = x * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=x.dtype)  # rounded to the dtype, as HF
        if images is not None:  # image embeddings are not scaled
            x[images[0]] = images[1].to(x.dtype)
        return x

    def layer_ropes(self, layers, positions: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
        """The sliding layers' own RoPE (Gemma 3's local base), the global one elsewhere."""
        rope = self.ops.rope_cos_sin(positions, self.cos_sin_cache, dtype)
        local = rope
        if self.local_cos_sin_cache is not None and any(layer.window for layer in layers):
            local = self.ops.rope_cos_sin(positions, self.local_cos_sin_cache, dtype)
        return [local if layer.window else rope for layer in layers]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    @torch.no_grad()
    def load_weights(self, weights) -> None:
        super().load_weights(weights)
        for module in self.modules():  # Gemma's norms scale by (1 + w)
            if isinstance(module, RMSNorm):
                module.weight.add_(1.0)
        if self.local_rope:  # a plain attribute, float32: the runner's dtype cast leaves it alone
            self.local_cos_sin_cache = rope_cos_sin_cache(local_rope_config(self.cfg)).to(self.norm.weight.device)


class Gemma2ForCausalLM(GemmaCausalLM):
    pass


class Gemma3ForCausalLM(GemmaCausalLM):
    qk_norm = True
    window_pattern = 6
    local_rope = True
    attn_softcap = False
