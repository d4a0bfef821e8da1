"""Idefics3 and SmolVLM (Idefics3ForConditionalGeneration, SmolVLMForConditionalGeneration): the
processor splits an image into tiles of the tower's size plus a global view, writes each tile's
image tokens after a row/column marker, and pads tiles whose pixels do not fill them (a pixel
mask). The SigLIP-like tower reads a tile's real patches at positions bucketed onto its
grid (NaViT's variable resolution); the connector folds each 2x2 (scale_factor) block of patch
outputs into one token (pixel shuffle) and projects it into a Llama-shaped language model."""

from __future__ import annotations

import torch
from torch import nn

from pageserve.runtime.models.llama import LlamaForCausalLM
from pageserve.runtime.models.vision import TakesImages, VisionEncoder, language_model_weights, load_exact
from pageserve.runtime.multimodal import image_token_runs


class Idefics3VisionTower(nn.Module):
    def __init__(self, vc: dict):
        super().__init__()
        size, self.patch = vc["hidden_size"], vc["patch_size"]
        self.side = vc["image_size"] // self.patch
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Conv2d(vc.get("num_channels", 3), size, self.patch, self.patch)
        self.embeddings.position_embedding = nn.Embedding(self.side ** 2, size)
        self.encoder = VisionEncoder(vc, vc["num_hidden_layers"])
        self.post_layernorm = nn.LayerNorm(size, eps=vc.get("layer_norm_eps", 1e-6))

    def forward(self, pixel_values: torch.Tensor, pixel_mask: torch.Tensor) -> torch.Tensor:
        """[tiles, 3, H, W] and their real pixels [tiles, H, W] -> [tiles, patches, hidden]"""
        p, tiles = self.patch, pixel_values.shape[0]
        patch_mask = pixel_mask.unfold(1, p, p).unfold(2, p, p).sum(dim=(-1, -2)) > 0  # [tiles, h, w]
        conv = self.embeddings.patch_embedding
        x = conv(pixel_values.to(conv.weight.dtype)).flatten(2).transpose(1, 2)
        # each real patch's fraction of the way across its tile, bucketed onto the trained grid
        boundaries = torch.arange(1 / self.side, 1.0, 1 / self.side, device=x.device)

        def buckets(n_real: torch.Tensor, n: int) -> torch.Tensor:
            frac = torch.arange(n, device=x.device, dtype=torch.float32)[None, :] * (1.0 / n_real)[:, None]
            return torch.bucketize(frac.clamp(max=1.0 - 1e-6), boundaries, right=True)

        rows = buckets(patch_mask[:, :, 0].sum(dim=1), patch_mask.shape[1])
        cols = buckets(patch_mask[:, 0, :].sum(dim=1), patch_mask.shape[2])
        positions = (rows[:, :, None] * self.side + cols[:, None, :]).reshape(tiles, -1)
        positions = torch.where(patch_mask.view(tiles, -1), positions, 0)
        x = x + self.embeddings.position_embedding(positions)
        flat = patch_mask.view(tiles, -1)
        mask = None if bool(flat.all()) else flat[:, None, None, :]  # padded patches are no keys
        return self.post_layernorm(self.encoder(x, mask)[-1])


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[tiles, side * side, d] -> [tiles, side * side / scale^2, d * scale^2]: each scale x scale
    block of patches becomes one token, as Idefics3's connector folds them."""
    tiles, seq, d = x.shape
    side = int(seq ** 0.5)
    x = x.view(tiles, side, side // scale, d * scale).permute(0, 2, 1, 3)
    x = x.reshape(tiles, side // scale, side // scale, d * scale * scale).permute(0, 2, 1, 3)
    return x.reshape(tiles, seq // (scale * scale), d * scale * scale)


class Idefics3ForConditionalGeneration(TakesImages, LlamaForCausalLM):
    towers = ("vision_model.", "connector.")
    image_placeholder = "<image>"

    @staticmethod
    def image_inputs(processed, ids: list[int], token: int, num_images: int, processor) -> list[tuple]:
        """An image is its tiles' runs of image tokens up to the global view's (the run after
        <global-img>); its span runs from its first run to the end of its last."""
        glob = processor.global_image_token_id
        pixels, masks = processed["pixel_values"][0], processed["pixel_attention_mask"][0]
        out, first, tile = [], None, 0
        for offset, length in image_token_runs(ids, token):
            first = offset if first is None else first
            if offset > 0 and ids[offset - 1] == glob:
                n = sum(1 for o, _ in image_token_runs(ids[first:offset + length], token))
                out.append((first, offset + length - first, {"pixel_values": pixels[tile:tile + n],
                                                              "pixel_attention_mask": masks[tile:tile + n]}))
                first, tile = None, tile + n
        if len(out) != num_images or tile != pixels.shape[0]:
            raise ValueError(f"{len(out)} images' tiles found in the prompt for {num_images} images")
        return out

    def __init__(self, cfg, kernels):
        super().__init__(cfg, kernels)
        mm = cfg.hf_config["_multimodal"]
        vc = mm["vision_config"]
        self.scale = mm.get("scale_factor", 2)
        self.vision_model = Idefics3VisionTower(vc)
        self.connector = nn.Module()
        self.connector.modality_projection = nn.Module()
        self.connector.modality_projection.proj = nn.Linear(vc["hidden_size"] * self.scale ** 2, cfg.hidden_size,
                                                            bias=False)

    @torch.no_grad()
    def encode_image(self, data: dict) -> torch.Tensor:
        device = self.norm.weight.device
        x = self.vision_model(data["pixel_values"].to(device), data["pixel_attention_mask"].to(device).bool())
        x = self.connector.modality_projection.proj(pixel_shuffle(x, self.scale))
        return x.reshape(-1, x.shape[-1])

    def load_weights(self, weights) -> None:
        towers: list = []
        super().load_weights(language_model_weights(weights, towers))
        load_exact(self.vision_model, [(n.removeprefix("vision_model."), t) for n, t in towers
                                       if n.startswith("vision_model.")], "vision tower")
        load_exact(self.connector, [(n.removeprefix("connector."), t) for n, t in towers
                                    if n.startswith("connector.")], "connector")


class SmolVLMForConditionalGeneration(Idefics3ForConditionalGeneration):
    pass
