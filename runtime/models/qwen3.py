"""Qwen3 (dense): Llama with an RMSNorm over each head of q and of k before RoPE, and a
head_dim of its own (not hidden_size / heads)."""

from pageserve.runtime.models.layers import CausalLM


class Qwen3ForCausalLM(CausalLM):
    qk_norm = True
