"""Phi-3 and Phi-3.5: Llama whose checkpoint stores q/k/v and gate/up already fused
(qkv_proj, gate_up_proj: the layout ours has), with LongRoPE scaling (rope.rope_cos_sin_cache)."""

from pageserve.runtime.models.layers import CausalLM


class Phi3ForCausalLM(CausalLM):
    pass
