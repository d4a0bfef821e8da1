"""The vision encoders that vision-language models put before their language model: a ViT as
CLIP and SigLIP write it (a patch convolution, position embeddings, pre-norm encoder layers
with full attention over the image's patches), and the checks for loading a tower's weights.
A tower runs once per image, outside the paged attention: its output rows become the image
tokens' embeddings (runtime/multimodal.py)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pageserve.runtime.multimodal import equal_image_spans

ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r} (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class VisionAttention(nn.Module):
    def __init__(self, size: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(size, size) for _ in range(4))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = (p(x).view(b, n, self.heads, d // self.heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, d))


class VisionMLP(nn.Module):
    def __init__(self, size: int, inner: int, act: str):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(size, inner), nn.Linear(inner, size), activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, vc: dict):
        super().__init__()
        size, eps = vc["hidden_size"], vc.get("layer_norm_eps", 1e-6)
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(size, eps=eps), nn.LayerNorm(size, eps=eps)
        self.self_attn = VisionAttention(size, vc["num_attention_heads"])
        self.mlp = VisionMLP(size, vc["intermediate_size"], vc.get("hidden_act", "gelu_pytorch_tanh"))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), mask)
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, vc: dict, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(vc) for _ in range(num_layers))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The input and each layer's output (HF's hidden_states)."""
        states = [x]
        for layer in self.layers:
            states.append(layer(states[-1], mask))
        return states


def feature_layers(feature_layer: int, num_layers: int) -> int:
    """How many encoder layers run to reach hidden state `feature_layer` (HF's indexing: 0 is
    the embeddings, -1 the last layer's output)."""
    n = feature_layer if feature_layer >= 0 else num_layers + 1 + feature_layer
    if not 0 <= n <= num_layers:
        raise ValueError(f"vision feature layer {feature_layer} is outside the tower's {num_layers} layers")
    return n


class ClipVisionTower(nn.Module):
    """CLIP's vision transformer up to the hidden state a model reads (`num_layers` of them):
    a class token before the patches, a norm before the encoder, none after."""

    def __init__(self, vc: dict, num_layers: int):
        super().__init__()
        size, patch, image = vc["hidden_size"], vc["patch_size"], vc["image_size"]
        self.embeddings = nn.Module()
        self.embeddings.class_embedding = nn.Parameter(torch.empty(size))
        self.embeddings.patch_embedding = nn.Conv2d(vc.get("num_channels", 3), size, patch, patch, bias=False)
        self.embeddings.position_embedding = nn.Embedding((image // patch) ** 2 + 1, size)
        self.pre_layrnorm = nn.LayerNorm(size, eps=vc.get("layer_norm_eps", 1e-5))
        self.encoder = VisionEncoder({"hidden_act": "quick_gelu", "layer_norm_eps": 1e-5, **vc}, num_layers)

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """[images, 3, H, W] -> hidden states [images, 1 + patches, hidden], the embeddings' and
        each layer's"""
        e = self.embeddings
        x = e.patch_embedding(pixel_values.to(e.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        x = torch.cat([e.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        x = x + e.position_embedding.weight[:x.shape[1]]
        return self.encoder(self.pre_layrnorm(x))


class SiglipVisionTower(nn.Module):
    """SigLIP's vision transformer: patches with a bias, no class token, a norm after the
    encoder (`post_norm`) when the model reads the last layer."""

    def __init__(self, vc: dict, num_layers: int, post_norm: bool = True):
        super().__init__()
        size, patch, image = vc["hidden_size"], vc["patch_size"], vc["image_size"]
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Conv2d(vc.get("num_channels", 3), size, patch, patch)
        self.embeddings.position_embedding = nn.Embedding((image // patch) ** 2, size)
        self.encoder = VisionEncoder(vc, num_layers)
        self.post_layernorm = nn.LayerNorm(size, eps=vc.get("layer_norm_eps", 1e-6)) if post_norm else None

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        e = self.embeddings
        x = e.patch_embedding(pixel_values.to(e.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        x = self.encoder(x + e.position_embedding.weight[:x.shape[1]])[-1]
        return self.post_layernorm(x) if self.post_layernorm is not None else x


class TakesImages:
    """What the engine asks of a model that takes images (runtime/multimodal.py), mixed in before
    its language model's class: `encode_image(data)` -> [image tokens, hidden]; `image_token`,
    the id the processor writes for each of an image's tokens; `image_inputs`, the processor's
    output -> each image's (offset, length, tensors) in the prompt (here: every image as many
    tokens, `pixel_values` one row each); `image_placeholder`, the text for an image before
    processing (None: the processor's image_token); `processor`, a class standing in for
    transformers' AutoProcessor (None: AutoProcessor); `images_attend_both_ways`, an image's
    tokens attend to each other in both directions."""
    image_placeholder: str | None = None
    processor = None
    images_attend_both_ways = False

    def checkpoint_target(self, name: str) -> str | None:
        """Our language model's parameter that a checkpoint tensor fills (None: a tower's)."""
        renamed = [n for n, _ in language_model_weights([(name, None)])]
        return super().checkpoint_target(renamed[0]) if renamed else None

    @staticmethod
    def image_token(hf: dict) -> int:
        mm = hf["_multimodal"]
        return mm.get("image_token_id", mm.get("image_token_index"))

    @staticmethod
    def image_inputs(processed, ids: list[int], token: int, num_images: int, processor) -> list[tuple]:
        return [(offset, length, {"pixel_values": processed["pixel_values"][i:i + 1]})
                for i, (offset, length) in enumerate(equal_image_spans(ids, token, num_images))]

    def encode_image(self, data: dict) -> torch.Tensor:
        raise NotImplementedError


# where a multimodal checkpoint keeps its language model: transformers' hub layout, and the one
# transformers 4.5x saved
_LANGUAGE_MODEL_PREFIXES = ("language_model.model.", "model.language_model.", "model.text_model.")
_TOWER_PREFIXES = ("vision_tower.", "multi_modal_projector.", "vision_model.", "connector.", "visual.")


def language_model_weights(weights, towers: list | None = None):
    """A multimodal checkpoint's text weights under the names of the text-only model. The
    vision tower's and projector's go into `towers` (without "model." or the tower's
    "vision_model."), or are skipped when it is None."""
    for name, tensor in weights:
        short = name.removeprefix("model.")
        if short.startswith(_TOWER_PREFIXES):
            if towers is not None:
                towers.append((short.replace("vision_tower.vision_model.", "vision_tower.", 1), tensor))
            continue
        for prefix in _LANGUAGE_MODEL_PREFIXES:
            if name.startswith(prefix):
                name = "model." + name[len(prefix):]
                break
        else:
            name = name.removeprefix("language_model.")  # language_model.lm_head.weight
        yield name, tensor


@torch.no_grad()
def load_exact(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], what: str) -> None:
    """Fill every parameter of `module` exactly once from (name, tensor) pairs named as its
    state dict; a name it does not have, a wrong shape or a parameter left unfilled is a
    ValueError naming the checkpoint part."""
    params = dict(module.named_parameters())
    written: set[str] = set()
    for name, tensor in weights:
        if name not in params:
            raise ValueError(f"unexpected weight {name} in the {what}")
        if params[name].shape != tensor.shape:
            raise ValueError(f"{what} weight {name} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(params[name].shape)}")
        if name in written:
            raise ValueError(f"{what} weight {name} appears twice")
        params[name].copy_(tensor)
        written.add(name)
    missing = sorted(set(params) - written)
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} {what} weights: {', '.join(missing[:4])}")
