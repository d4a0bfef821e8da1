"""Architecture name (config.json's `architectures[0]`) -> the model class that serves it.
Adding a Llama-shaped model is a file under runtime/models/ and one line here; nothing else
in the engine names an architecture."""

from __future__ import annotations

import importlib
from typing import NamedTuple


class Entry(NamedTuple):
    module: str  # under pageserve.runtime.models
    cls: str
    qkv_bias: bool = False  # the q/k/v projections' bias when config.json does not say
    sliding_window: bool = False  # serves config.json's sliding_window (else the context is capped at it)
    text_config: bool = False  # a multimodal checkpoint: its config is config.json's text_config (the whole
    # of it under "_multimodal")
    activations: tuple[str, ...] = ("silu", "swish")  # config.json's hidden_act (or hidden_activation) it runs
    o_bias: bool = False  # o_proj takes config.json's attention_bias, as q/k/v do (transformers' class does)
    mlp_bias: bool = False  # gate, up and down take config.json's mlp_bias
    partial_rotary: bool = False  # RoPE turns config.json's partial_rotary_factor of each head (transformers' does)


GELU_TANH = ("gelu_pytorch_tanh", "gelu_new")  # Gemma's MLP: GELU's tanh approximation


_MODELS = {
    "LlamaForCausalLM": Entry("llama", "LlamaForCausalLM", o_bias=True, mlp_bias=True),
    "MistralForCausalLM": Entry("llama", "MistralForCausalLM", sliding_window=True),
    "Qwen2ForCausalLM": Entry("llama", "LlamaForCausalLM", qkv_bias=True),
    "Qwen3ForCausalLM": Entry("qwen3", "Qwen3ForCausalLM", o_bias=True),
    "Phi3ForCausalLM": Entry("phi3", "Phi3ForCausalLM", sliding_window=True, partial_rotary=True),
    "MixtralForCausalLM": Entry("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": Entry("qwen2_moe", "Qwen2MoeForCausalLM", qkv_bias=True),
    "Qwen3MoeForCausalLM": Entry("qwen3_moe", "Qwen3MoeForCausalLM", o_bias=True),
    "Gemma2ForCausalLM": Entry("gemma", "Gemma2ForCausalLM", sliding_window=True, activations=GELU_TANH,
                               o_bias=True),
    "Gemma3ForCausalLM": Entry("gemma", "Gemma3ForCausalLM", sliding_window=True, activations=GELU_TANH,
                               o_bias=True),
    "LlavaForConditionalGeneration": Entry("llava", "LlavaForConditionalGeneration", text_config=True, o_bias=True,
                                           mlp_bias=True),
    "LlavaNextForConditionalGeneration": Entry("llava", "LlavaNextForConditionalGeneration", text_config=True,
                                               o_bias=True, mlp_bias=True),
    "Qwen2_5_VLForConditionalGeneration": Entry("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", qkv_bias=True,
                                                text_config=True),
    "Idefics3ForConditionalGeneration": Entry("idefics3", "Idefics3ForConditionalGeneration", text_config=True,
                                              o_bias=True, mlp_bias=True),
    "SmolVLMForConditionalGeneration": Entry("idefics3", "SmolVLMForConditionalGeneration", text_config=True,
                                             o_bias=True, mlp_bias=True),
    "Gemma3ForConditionalGeneration": Entry("gemma3_mm", "Gemma3ForConditionalGeneration", sliding_window=True,
                                            text_config=True, activations=GELU_TANH, o_bias=True),
}


def supported() -> list[str]:
    return list(_MODELS)


def entry(architecture: str) -> Entry:
    if architecture not in _MODELS:
        raise KeyError(architecture)
    return _MODELS[architecture]


def model_class(architecture: str) -> type:
    e = entry(architecture)
    return getattr(importlib.import_module(f"pageserve.runtime.models.{e.module}"), e.cls)


def takes_images(architecture: str) -> bool:
    return hasattr(model_class(architecture), "encode_image")


def layer_windows(architecture: str, hf: dict, num_layers: int) -> list[int]:
    """Each layer's sliding window as the model class sets it (0: full attention); a class
    without a `layer_windows` classmethod attends fully everywhere."""
    windows = getattr(model_class(architecture), "layer_windows", None)
    return windows(hf, num_layers) if windows is not None else [0] * num_layers


def kv_sliding_window(architecture: str, hf: dict, num_layers: int) -> int:
    """The window every layer attends within (the widest, where they differ): KV wholly before
    it is never read again. 0 when any layer attends to the whole context."""
    windows = layer_windows(architecture, hf, num_layers)
    return max(windows) if windows and all(windows) else 0
