"""LLaVA-1.5 (LlavaForConditionalGeneration): CLIP's vision tower read at one of its hidden
layers (or several, side by side), the class token dropped ("default" strategy), a two-layer
projector into the language model's width, and a Llama-shaped language model whose prompt
holds one image token per patch. LLaVA-NeXT (LlavaNextForConditionalGeneration) tiles an image
at the best of its grid resolutions and lays the tiles' features out as the image."""

from __future__ import annotations

import re

import torch
from torch import nn

from pageserve.runtime.models.llama import LlamaForCausalLM
from pageserve.runtime.models.vision import (ClipVisionTower, TakesImages, activation, feature_layers,
                                             language_model_weights, load_exact)
from pageserve.runtime.multimodal import counted_image_spans


class Projector(nn.Module):
    def __init__(self, inputs: int, size: int, act: str, bias: bool = True):
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(inputs, size, bias=bias), nn.Linear(size, size, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(TakesImages, LlamaForCausalLM):
    towers = ("vision_tower.", "multi_modal_projector.")

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

    def project(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[views, 3, H, W] -> [views, patches, hidden]: the tower's chosen layers, projected."""
        states = self.vision_tower(pixel_values)
        x = torch.cat([states[i] for i in self.feature_layers], dim=-1)
        if not self.keep_class_token:
            x = x[:, 1:]
        return self.multi_modal_projector(x)

    @torch.no_grad()
    def encode_image(self, data: dict) -> torch.Tensor:
        """[image tokens, hidden] for one image."""
        return self.project(data["pixel_values"].to(self.norm.weight.device))[0]

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


def best_resolution(size: tuple[int, int], pinpoints: list) -> tuple[int, int]:
    """The (height, width) among `pinpoints` that keeps the most of an image of `size` (height,
    width) scaled to fit, then wastes the least: LLaVA-NeXT's choice of tiling."""
    h, w = size
    best, most, waste = None, -1, None
    for ph, pw in pinpoints:
        scale = min(pw / w, ph / h)
        kept = min(int(w * scale) * int(h * scale), w * h)
        wasted = pw * ph - kept
        if kept > most or (kept == most and wasted < waste):
            best, most, waste = (ph, pw), kept, wasted
    return best


def unpadded(size: tuple[int, int], rows: int, cols: int) -> tuple[int, int, int, int]:
    """The token rows and columns of a (rows x cols) feature grid that hold the image of `size`
    (height, width), fitted into it and centred: (first row, rows, first column, columns)."""
    h, w = size
    if w / h > cols / rows:
        pad = (rows - int(round(h * (cols / w), 7))) // 2
        return pad, rows - 2 * pad, 0, cols
    pad = (cols - int(round(w * (rows / h), 7))) // 2
    return 0, rows, pad, cols - 2 * pad


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA-NeXT: an image is tiled at the best of `image_grid_pinpoints` plus a global view;
    the tiles' features are laid out as one grid, cut back to the image's own aspect (unpadded),
    and end each row with `image_newline`; the global view's come first."""
    towers = ("vision_tower.", "multi_modal_projector.", "image_newline")

    def __init__(self, cfg, kernels):
        super().__init__(cfg, kernels)
        mm = cfg.hf_config["_multimodal"]
        self.pinpoints = [tuple(p) for p in mm["image_grid_pinpoints"]]
        self.tile = mm["vision_config"]["image_size"]
        self.side = self.tile // mm["vision_config"]["patch_size"]  # a tile's feature rows (and columns)
        self.image_newline = nn.Parameter(torch.empty(cfg.hidden_size))

    @staticmethod
    def _layout(size, pinpoints, tile: int, side: int) -> tuple[int, int, tuple[int, int, int, int]]:
        """(tile rows, tile columns, the unpadded window of their feature grid) of an image."""
        bh, bw = best_resolution(size, pinpoints)
        return bh // tile, bw // tile, unpadded(size, bh // tile * side, bw // tile * side)

    @classmethod
    def image_inputs(cls, processed, ids: list[int], token: int, num_images: int, processor) -> list[tuple]:
        ip = processor.image_processor
        tile = ip.crop_size["height"]
        side = tile // processor.patch_size
        pinpoints = [tuple(p) for p in ip.image_grid_pinpoints]
        datas, counts = [], []
        for i in range(num_images):
            size = tuple(processed["image_sizes"][i].tolist())
            gh, gw, (_, rows, _, cols) = cls._layout(size, pinpoints, tile, side)
            datas.append({"pixel_values": processed["pixel_values"][i, :gh * gw + 1], "image_size": size})
            counts.append(side * side + rows * (cols + 1))
        return [(offset, length, data)
                for (offset, length), data in zip(counted_image_spans(ids, token, counts), datas)]

    @torch.no_grad()
    def encode_image(self, data: dict) -> torch.Tensor:
        features = self.project(data["pixel_values"].to(self.norm.weight.device))  # [tiles, side * side, hidden]
        gh, gw, (r0, rows, c0, cols) = self._layout(data["image_size"], self.pinpoints, self.tile, self.side)
        s, d = self.side, features.shape[-1]
        grid = features[1:].view(gh, gw, s, s, d).permute(0, 2, 1, 3, 4).reshape(gh * s, gw * s, d)
        grid = grid[r0:r0 + rows, c0:c0 + cols]
        grid = torch.cat([grid, self.image_newline.to(grid.dtype).expand(rows, 1, d)], dim=1)
        return torch.cat([features[0], grid.reshape(-1, d)])

    def load_weights(self, weights) -> None:
        newline = []

        def split(stream):
            for name, tensor in stream:
                if name.removeprefix("model.") == "image_newline":
                    newline.append(tensor)
                else:
                    yield name, tensor
        super().load_weights(split(weights))
        if len(newline) != 1:
            raise ValueError("the checkpoint has no image_newline")
        with torch.no_grad():
            self.image_newline.copy_(newline[0])
