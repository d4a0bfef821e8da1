"""Gemma 3 with images (Gemma3ForConditionalGeneration): a SigLIP tower (its last layer, normed),
its patch outputs average-pooled to mm_tokens_per_image, normed (Gemma's 1 + w) and projected
into the text model's width. An image's tokens attend to each other both ways, as in HF's
prefill: the runner gives each of them the image's last position as the last it may see
(AttentionMetadata.key_limit) and the scheduler never splits an image across steps, so the
whole image's K/V are in the cache when its tokens attend. The text embeddings are scaled by
sqrt(hidden); the image rows are not."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pageserve.runtime.models.gemma import Gemma3ForCausalLM
from pageserve.runtime.models.vision import SiglipVisionTower, TakesImages, language_model_weights, load_exact


class Gemma3Projector(nn.Module):
    def __init__(self, vc: dict, text_hidden: int, tokens_per_image: int):
        super().__init__()
        self.patches_per_side = vc["image_size"] // vc["patch_size"]
        self.kernel = self.patches_per_side // int(tokens_per_image ** 0.5)
        self.eps = vc.get("layer_norm_eps", 1e-6)
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = nn.Parameter(torch.empty(vc["hidden_size"]))
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vc["hidden_size"], text_hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, d = x.shape
        side = self.patches_per_side
        x = F.avg_pool2d(x.transpose(1, 2).reshape(b, d, side, side), self.kernel, self.kernel).flatten(2).transpose(1, 2)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.mm_soft_emb_norm.weight.float())
        return torch.matmul(h.type_as(x), self.mm_input_projection_weight).type_as(x)


class Gemma3ForConditionalGeneration(TakesImages, Gemma3ForCausalLM):
    towers = ("vision_tower.", "multi_modal_projector.")
    images_attend_both_ways = True  # image_placeholder: the processor's <start_of_image>, which it expands

    def __init__(self, cfg, kernels):
        super().__init__(cfg, kernels)
        mm = cfg.hf_config["_multimodal"]
        vc = mm["vision_config"]
        self.vision_tower = SiglipVisionTower(vc, vc["num_hidden_layers"])
        self.multi_modal_projector = Gemma3Projector(vc, cfg.hidden_size, mm.get("mm_tokens_per_image", 256))

    @torch.no_grad()
    def encode_image(self, data: dict) -> torch.Tensor:
        x = self.vision_tower(data["pixel_values"].to(self.norm.weight.device))
        return self.multi_modal_projector(x)[0]

    def load_weights(self, weights) -> None:
        towers: list = []
        super().load_weights(language_model_weights(weights, towers))
        vision = [(n.removeprefix("vision_tower."), t) for n, t in towers
                  if n.startswith("vision_tower.") and not n.startswith("vision_tower.head.")]  # SigLIP's pooling head
        load_exact(self.vision_tower, vision, "vision tower")
        load_exact(self.multi_modal_projector, [(n.removeprefix("multi_modal_projector."), t) for n, t in towers
                                                if n.startswith("multi_modal_projector.")], "projector")
