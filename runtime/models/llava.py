"""LLaVA-1.5 (LlavaForConditionalGeneration): CLIP's vision tower read at one of its hidden
layers (or several, side by side), the class token dropped ("default" strategy), a two-layer
projector into the language model's width, and a Llama-shaped language model whose prompt
holds one image token per patch."""

from __future__ import annotations

import re

import torch
from torch import nn

from pageserve.runtime.models.llama import LlamaForCausalLM
from pageserve.runtime.models.vision import (ClipVisionTower, activation, feature_layers, language_model_weights,
                                             load_exact)
from pageserve.runtime.multimodal import equal_image_spans


class Projector(nn.Module):
    def __init__(self, inputs: int, size: int, act: str, bias: bool = True):
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(inputs, size, bias=bias), nn.Linear(size, size, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    towers = ("vision_tower.", "multi_modal_projector.")
    image_placeholder = None  # the processor's image_token

    @staticmethod
    def image_token(hf: dict) -> int:
        mm = hf["_multimodal"]
        return mm.get("image_token_index", mm.get("image_token_id"))

    @staticmethod
    def image_inputs(processed, ids: list[int], token: int, num_images: int, processor) -> list[tuple]:
        """(offset, length, tensors) of each image: as many image tokens each."""
        return [(offset, length, {"pixel_values": processed["pixel_values"][i:i + 1]})
                for i, (offset, length) in enumerate(equal_image_spans(ids, token, num_images))]

    def __init__(self, cfg, kernels):
        super().__init__(cfg, kernels)
        mm = cfg.hf_config["_multimodal"]
        vc = mm["vision_config"]
        layer = mm.get("vision_feature_layer", -2)
        layers = list(layer) if isinstance(layer, (list, tuple)) else [layer]
        self.feature_layers = [feature_layers(i, vc["num_hidden_layers"]) for i in layers]  # from the embeddings
        depth = max(self.feature_layers)
        self.keep_class_token = mm.get("vision_feature_select_strategy", "default") == "full"
        self.vision_tower = ClipVisionTower(vc, depth)
        self.multi_modal_projector = Projector(vc["hidden_size"] * len(self.feature_layers), cfg.hidden_size,
                                               mm.get("projector_hidden_act", "gelu"),
                                               mm.get("multimodal_projector_bias", True))

    @torch.no_grad()
    def encode_image(self, data: dict) -> torch.Tensor:
        """[image tokens, hidden] for one image."""
        states = self.vision_tower(data["pixel_values"].to(self.norm.weight.device))
        x = torch.cat([states[i] for i in self.feature_layers], dim=-1)
        if not self.keep_class_token:
            x = x[:, 1:]
        return self.multi_modal_projector(x)[0]

    def load_weights(self, weights) -> None:
        towers: list = []
        super().load_weights(language_model_weights(weights, towers))
        depth = len(self.vision_tower.encoder.layers)
        unused = re.compile(r"vision_tower\.(post_layernorm\.|encoder\.layers\.(\d+)\.)")
        vision, projector = [], []
        for name, tensor in towers:
            m = unused.match(name)
            if m and (m.group(2) is None or int(m.group(2)) >= depth):
                continue  # layers past the one read, and the pooled output's norm
            if name.startswith("vision_tower."):
                vision.append((name.removeprefix("vision_tower."), tensor))
            else:
                projector.append((name.removeprefix("multi_modal_projector."), tensor))
        load_exact(self.vision_tower, vision, "vision tower")
        load_exact(self.multi_modal_projector, projector, "projector")
