"""Llama, and the architectures that are Llama under another name: Mistral (without a
sliding window) and Qwen2 (q/k/v with a bias, which the config's registry line sets)."""

from pageserve.runtime.models.layers import CausalLM


class LlamaForCausalLM(CausalLM):
    pass
