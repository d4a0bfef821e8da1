"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration). Images keep their own resolution: the image
processor resizes each to a multiple of patch x merge pixels and cuts it into patches (two
frames deep); the tower embeds the patches with a 3-D convolution, rotates q/k by each patch's
row and column (2-D RoPE), attends within windows of tokens on most blocks and across the whole
image on the `fullatt_block_indexes` blocks, then merges each 2x2 block of patches into a token.
The language model is Qwen2's with M-RoPE: a position is (t, h, w), the rotary frequencies split
into sections that turn with t, h and w; text tokens have t = h = w, an image's tokens start
where the text before them ends and its grid gives their (0, row, column), and the text after
an image goes on from its largest index (multimodal.mrope_positions)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pageserve.runtime.models.llama import LlamaForCausalLM
from pageserve.runtime.models.vision import TakesImages, activation, language_model_weights, load_exact
from pageserve.runtime.multimodal import image_token_runs


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class VisionBlock(nn.Module):
    def __init__(self, vc: dict):
        super().__init__()
        d, inner = vc["hidden_size"], vc["intermediate_size"]
        self.heads = vc["num_heads"]
        self.norm1, self.norm2 = nn.Module(), nn.Module()
        self.norm1.weight, self.norm2.weight = nn.Parameter(torch.empty(d)), nn.Parameter(torch.empty(d))
        self.attn = nn.Module()
        self.attn.qkv, self.attn.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Module()
        self.mlp.gate_proj, self.mlp.up_proj, self.mlp.down_proj = nn.Linear(d, inner), nn.Linear(d, inner), nn.Linear(inner, d)
        self.act = activation(vc.get("hidden_act", "silu"))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        """x: [N, d]; cos/sin: [N, head_dim]; bounds: where each attention segment starts and ends."""
        n, d = x.shape
        q, k, v = self.attn.qkv(rms_norm(x, self.norm1.weight)).view(n, 3, self.heads, -1).unbind(1)
        c, s = cos[:, None].float(), sin[:, None].float()
        q = (q.float() * c + rotate_half(q.float()) * s).to(x.dtype)
        k = (k.float() * c + rotate_half(k.float()) * s).to(x.dtype)
        out = torch.empty_like(q)
        for a, b in zip(bounds, bounds[1:]):  # windows (or the whole image) attend within themselves
            out[a:b] = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                                      v[a:b].transpose(0, 1)).transpose(0, 1)
        x = x + self.attn.proj(out.reshape(n, d))
        h = rms_norm(x, self.norm2.weight)
        return x + self.mlp.down_proj(self.act(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


class Qwen25VisionTower(nn.Module):
    def __init__(self, vc: dict):
        super().__init__()
        d = vc["hidden_size"]
        self.patch, self.merge, self.frames = vc["patch_size"], vc["spatial_merge_size"], vc["temporal_patch_size"]
        self.channels = vc.get("in_channels", 3)
        self.window = vc["window_size"] // self.merge // self.patch  # a window's side, in tokens
        self.full_blocks = set(vc.get("fullatt_block_indexes") or ())
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(self.channels, d, (self.frames, self.patch, self.patch),
                                          (self.frames, self.patch, self.patch), bias=False)
        self.blocks = nn.ModuleList(VisionBlock(vc) for _ in range(vc["depth"]))
        wide = d * self.merge ** 2
        self.merger = nn.Module()
        self.merger.ln_q = nn.Module()
        self.merger.ln_q.weight = nn.Parameter(torch.empty(d))
        self.merger.mlp = nn.Sequential(nn.Linear(wide, wide), nn.GELU(), nn.Linear(wide, vc["out_hidden_size"]))
        self.theta = (vc.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        self.rotary_dim = d // vc["num_heads"] // 2  # half the head turns with the row, half with the column

    def _windows(self, t: int, h: int, w: int) -> tuple[torch.Tensor, list[int]]:
        """The tokens (merged patches) in window order, and where each window starts and ends
        in patches."""
        gh, gw, ws = h // self.merge, w // self.merge, self.window
        index = torch.arange(t * gh * gw).view(t, gh, gw)
        ph, pw = -gh % ws, -gw % ws
        index = F.pad(index, (0, pw, 0, ph), value=-1)
        nh, nw = (gh + ph) // ws, (gw + pw) // ws
        index = index.view(t, nh, ws, nw, ws).permute(0, 1, 3, 2, 4).reshape(t * nh * nw, ws * ws)
        sizes = (index >= 0).sum(dim=1)
        order = index[index >= 0]
        bounds = [0]
        for size in sizes.tolist():
            if size:
                bounds.append(bounds[-1] + size * self.merge ** 2)
        return order, bounds

    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        t, h, w = grid
        m, unit = self.merge, self.merge ** 2
        conv = self.patch_embed.proj
        x = conv(pixels.view(-1, self.channels, self.frames, self.patch, self.patch).to(conv.weight.dtype))
        x = x.view(-1, conv.out_channels)
        n = x.shape[0]
        # each patch's row and column, in the processor's order (2x2 merge blocks together)
        rows = torch.arange(h)[:, None].expand(h, w).reshape(h // m, m, w // m, m).transpose(1, 2).flatten()
        cols = torch.arange(w)[None, :].expand(h, w).reshape(h // m, m, w // m, m).transpose(1, 2).flatten()
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float32) / self.rotary_dim))
        angles = torch.cat([rows.repeat(t)[:, None] * inv_freq, cols.repeat(t)[:, None] * inv_freq], dim=-1)
        order, window_bounds = self._windows(t, h, w)

        def by_window(y: torch.Tensor) -> torch.Tensor:
            return y.reshape(n // unit, unit, -1)[order].reshape(n, -1)
        x = by_window(x)
        angles = by_window(angles.to(x.device))
        cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
        whole = [0, n]  # one image: the full-attention blocks see all of it (each frame, for video)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, whole if i in self.full_blocks else window_bounds)
        x = self.merger.mlp(rms_norm(x, self.merger.ln_q.weight).view(n // unit, -1))
        return x[torch.argsort(order)]


class Qwen2VLPrompts:
    """Qwen2-VL's processing of a prompt with images: the image processor, and each
    <|image_pad|> repeated once a token of its image (merged patches). transformers' own
    processor also loads a video processor, which needs torchvision."""
    image_token = "<|image_pad|>"

    def __init__(self, path: str):
        from transformers import AutoImageProcessor, AutoTokenizer

        self.images = AutoImageProcessor.from_pretrained(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.merge = self.images.merge_size
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.image_token)

    def __call__(self, text: list[str], images=None, return_tensors: str = "pt", add_special_tokens: bool = True):
        text, out = text[0], {}
        if images:
            out = dict(self.images(images=images, return_tensors="pt"))
            pieces = text.split(self.image_token)
            if len(pieces) != len(images) + 1:
                raise ValueError(f"{len(pieces) - 1} {self.image_token} for {len(images)} images")
            sizes = (out["image_grid_thw"].prod(dim=-1) // self.merge ** 2).tolist()
            text = pieces[0] + "".join(self.image_token * n + piece for n, piece in zip(sizes, pieces[1:]))
        ids = torch.tensor([self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]])
        out["input_ids"] = ids
        out["mm_token_type_ids"] = (ids == self.image_token_id).int()
        return out


class Qwen2_5_VLForConditionalGeneration(TakesImages, LlamaForCausalLM):
    towers = ("visual.",)
    image_placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    processor = Qwen2VLPrompts

    @staticmethod
    def image_inputs(processed, ids: list[int], token: int, num_images: int, processor) -> list[tuple]:
        runs = image_token_runs(ids, token)
        if len(runs) != num_images:
            raise ValueError(f"{len(runs)} runs of image tokens for {num_images} images")
        grids = processed["image_grid_thw"]
        patches = F.pad(grids.prod(dim=-1).cumsum(0), (1, 0)).tolist()
        merge = processor.merge
        return [(offset, length, {"pixel_values": processed["pixel_values"][patches[i]:patches[i + 1]],
                                  "grid": tuple(grids[i].tolist()),
                                  "mrope_grid": (int(grids[i][0]), int(grids[i][1]) // merge, int(grids[i][2]) // merge)})
                for i, (offset, length) in enumerate(runs)]

    def __init__(self, cfg, kernels):
        super().__init__(cfg, kernels)
        mm = cfg.hf_config["_multimodal"]
        rope = cfg.hf_config.get("rope_parameters") or cfg.hf_config.get("rope_scaling") or {}
        self.mrope_section = list(rope["mrope_section"])
        self.visual = Qwen25VisionTower(mm["vision_config"])

    @torch.no_grad()
    def encode_image(self, data: dict) -> torch.Tensor:
        return self.visual(data["pixel_values"].to(self.norm.weight.device), data["grid"])

    def forward(self, input_ids, positions, meta, kv_caches, images=None):
        """positions: [3, T] (t, h, w) for M-RoPE."""
        x = self.embed(input_ids, images)
        rope = self._mrope(positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, meta, kv_cache, rope)
        x, _ = self.ops.rms_norm(x, self.norm.weight, self.cfg.rms_norm_eps, residual)
        return x

    def _mrope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin as torch_ops.rope_cos_sin gives them, each frequency turned by the
        position component its section names."""
        if positions.dim() == 1:  # a step without 3-D positions (warm-up): text only
            positions = positions.expand(3, -1)
        half = self.cos_sin_cache.shape[-1] // 2
        section = torch.repeat_interleave(torch.arange(3), torch.tensor(self.mrope_section))
        pick = torch.cat([section, section]).to(positions.device)
        table = self.cos_sin_cache[positions]  # [3, T, D]
        cs = table.gather(0, pick.view(1, 1, -1).expand(1, table.shape[1], -1))[0].to(dtype)
        return cs[:, None, :half], cs[:, None, half:]

    def load_weights(self, weights) -> None:
        towers: list = []
        super().load_weights(language_model_weights(weights, towers))
        load_exact(self.visual, [(n.removeprefix("visual."), t) for n, t in towers], "vision tower")
