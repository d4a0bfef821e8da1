"""The Llama family (Llama, Mistral, Qwen2) written against the engine's paged attention.

q/k/v and gate/up projections are fused into one matmul each at load time. Tokens of the
whole step are one flat [T, hidden] batch: there is no batch or padding dimension."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from pageserve.runtime.kernels import Kernels, AttentionMetadata
from pageserve.runtime.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
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
    raise ValueError(f"unsupported RoPE scaling type {kind!r} (supported: default, linear, llama3)")


def rope_cos_sin_cache(cfg: ModelConfig) -> torch.Tensor:
    inv_freq = rope_inv_freq(cfg)
    freqs = torch.arange(cfg.max_model_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, kernels: Kernels):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.kernels = kernels
        self.ops = kernels.ops
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_size = cfg.num_heads * d
        self.kv_size = cfg.num_kv_heads * d
        self.scale = d ** -0.5
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, h, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.gate_up_proj = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, linear = self.cfg, self.kernels.linear
        x, residual = self.ops.rms_norm(x, self.input_layernorm, cfg.rms_norm_eps, residual)
        qkv = linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        self.ops.rotary_embedding(q, k, *rope)
        attn = self.kernels.attention(q, k, v, kv_cache, meta, self.scale)
        x = linear(attn.reshape(t, self.q_size), self.o_proj.weight)
        x, residual = self.ops.rms_norm(x, self.post_attention_layernorm, cfg.rms_norm_eps, residual)
        x = linear(self.ops.silu_and_mul(linear(x, self.gate_up_proj.weight)), self.down_proj.weight)
        return x, residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: Kernels):
        super().__init__()
        self.cfg = cfg
        self.ops = kernels.ops
        self.kernels = kernels
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, kernels) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("cos_sin_cache", rope_cos_sin_cache(cfg), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Final hidden states (after the last norm) of every token of the step."""
        x = self.embed_tokens(input_ids)
        rope = self.ops.rope_cos_sin(positions, self.cos_sin_cache, x.dtype)  # once per step
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, meta, kv_cache, rope)
        x, _ = self.ops.rms_norm(x, self.norm, self.cfg.rms_norm_eps, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.kernels.linear(hidden, weight).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take Hugging Face parameter names; fuse q/k/v and gate/up as they arrive."""
        q, kv = self.layers[0].q_size, self.layers[0].kv_size
        inter = self.cfg.intermediate_size
        fused = {  # HF suffix -> (our suffix, row offset, rows)
            "self_attn.q_proj": ("qkv_proj", 0, q),
            "self_attn.k_proj": ("qkv_proj", q, kv),
            "self_attn.v_proj": ("qkv_proj", q + kv, kv),
            "mlp.gate_proj": ("gate_up_proj", 0, inter),
            "mlp.up_proj": ("gate_up_proj", inter, inter),
        }
        renamed = {"self_attn.o_proj": "o_proj", "mlp.down_proj": "down_proj"}
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def put(name: str, tensor: torch.Tensor, offset: int | None = None, rows: int | None = None):
            if name not in params:
                raise ValueError(f"unexpected weight {name}")
            dst = params[name] if offset is None else params[name][offset:offset + rows]
            if dst.shape != tensor.shape:
                raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(name if offset is None else f"{name}[{offset}]")

        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            name = name.removeprefix("model.")
            if name.endswith("layernorm.weight") or name == "norm.weight":
                put(name.removesuffix(".weight"), tensor)
                continue
            if name.startswith("layers."):
                _, idx, rest = name.split(".", 2)
                module, _, kind = rest.rpartition(".")
                if module in fused:
                    ours, off, rows = fused[module]
                    put(f"layers.{idx}.{ours}.{kind}", tensor, off, rows)
                    continue
                if module in renamed:
                    put(f"layers.{idx}.{renamed[module]}.{kind}", tensor)
                    continue
            put(name, tensor)
        per_layer = 2 + 7 + (3 if self.cfg.qkv_bias else 0)  # norms, q k v o gate up down, biases
        expected = len(self.layers) * per_layer + 2 + (0 if self.lm_head is None else 1)
        if len(loaded) != expected:
            raise ValueError(f"checkpoint is missing weights: loaded {len(loaded)} of {expected} tensors")
