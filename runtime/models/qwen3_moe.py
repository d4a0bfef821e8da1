"""Qwen3-MoE: Qwen2-MoE's layer plan without the shared expert (and without q/k/v biases),
with Qwen3's per-head q/k norms."""

from pageserve.runtime.models.qwen2_moe import Qwen2MoeForCausalLM


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    qk_norm = True
