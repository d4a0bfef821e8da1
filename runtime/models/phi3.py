"""Phi-3, Phi-3.5 and Phi-4-mini: Llama whose checkpoint stores q/k/v and gate/up already fused
(qkv_proj, gate_up_proj: the layout ours has), with LongRoPE scaling (rope.rope_cos_sin_cache),
RoPE over part of each head (Phi-4-mini's partial_rotary_factor: ModelConfig.rotary_dim) and
config.json's sliding_window on every layer, as Mistral's (the 4k models' 2,047 tokens)."""

from pageserve.runtime.models.llama import MistralForCausalLM


class Phi3ForCausalLM(MistralForCausalLM):
    @classmethod
    def layer_windows(cls, hf: dict, num_layers: int) -> list[int]:
        """A window no shorter than the model's context (the 128k models' and Phi-4-mini's
        262,144) hides nothing: full attention, which keeps the paths that take no window."""
        window = hf.get("sliding_window") or 0
        return [window if window < hf.get("max_position_embeddings", window + 1) else 0] * num_layers
