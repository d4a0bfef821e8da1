"""Llama, and the architectures that are Llama under another name: Mistral (with config.json's
sliding_window on every layer, when it has one) and Qwen2 (q/k/v with a bias, which the
config's registry line sets)."""

from pageserve.runtime.models.layers import CausalLM


class LlamaForCausalLM(CausalLM):
    pass


class MistralForCausalLM(CausalLM):
    @classmethod
    def layer_windows(cls, hf: dict, num_layers: int) -> list[int]:
        return [hf.get("sliding_window") or 0] * num_layers

    def __init__(self, cfg, kernels):
        super().__init__(cfg, kernels)
        for layer, window in zip(self.layers, self.layer_windows(cfg.hf_config, cfg.num_layers)):
            layer.self_attn.sliding_window = window
