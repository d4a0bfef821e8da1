"""NVIDIA Model Optimizer's (ModelOpt's) checkpoints, as vLLM's `modelopt` method reads them:
FP8 E4M3 weights with one of three kinds of scales, or NVFP4 weights (quant_algo), and
optionally FP8 KV-cache scales."""

from __future__ import annotations

import torch

from pageserve.runtime.quantization.methods import (QuantMethod, UnsupportedQuantization, fp4_weights, fp8_blocks,
                                                    fp8_scales, kv_cache_scheme, modelopt_fields, need_tensors,
                                                    static_input_scale)
from pageserve.runtime.quantization.qtensor import QuantTensor

# ModelOpt's quant_algo values pageserve serves, each with what it is
_MODELOPT_ALGOS = {"FP8": "per-tensor weights, static activations", "FP8_PER_CHANNEL_PER_TOKEN":
                   "per-channel weights, dynamic activations", "FP8_PB_WO": "weights in blocks of 128x128",
                   "NVFP4": "FP4 weights, served weight-only", "W4A16_NVFP4": "FP4 weights, weight-only"}
_MODELOPT_BLOCK = (128, 128)


class ModelOpt(QuantMethod):
    """NVIDIA Model Optimizer's checkpoints (`quant_method: modelopt`, or a legacy
    hf_quant_config.json beside config.json): quant_algo FP8 (one `weight_scale` a tensor and a
    static `input_scale`), FP8_PER_CHANNEL_PER_TOKEN (a `weight_scale` a row, dynamic
    activations), FP8_PB_WO (a `weight_scale` [N/128, 1, K/128, 1] a block of 128x128,
    weight-only); NVFP4 and W4A16_NVFP4 (e2m1 codes two a byte, an FP8 `weight_scale` a group
    of 16, times the layer's `weight_scale_2`), weight-only: NVFP4's activation scales
    (`input_scale`) go unused, as on GPUs without FP4 kernels in vLLM. KV-cache scales
    (`k_proj.k_scale`, `v_proj.v_scale`) are kv_scales.py's.
    Layers the config excludes carry no weight_scale and load unquantized."""
    name = "modelopt"
    marker = "weight_scale"

    def __init__(self, cfg: dict):
        self.algo, _ = modelopt_fields(cfg)
        if self.algo not in _MODELOPT_ALGOS:
            raise UnsupportedQuantization(f"modelopt: quant_algo {self.algo or '(none)'} is not supported "
                                          f"({', '.join(_MODELOPT_ALGOS)} are)")
        kv_cache_scheme(cfg)  # a KV-cache format not served is refused here too
        self.static = self.algo == "FP8"
        self.fp4 = self.algo.endswith("NVFP4")
        self.block = _MODELOPT_BLOCK if self.algo == "FP8_PB_WO" else None

    def describe(self) -> str:
        return f"modelopt ({self.algo}: {_MODELOPT_ALGOS[self.algo]})"

    def layout(self, tensors):
        shape, dtype = tensors.get("weight", ((), "none"))
        if dtype != ("U8" if self.fp4 else "F8_E4M3"):
            raise UnsupportedQuantization(f"modelopt {self.algo}: a quantized layer's weight is {dtype}, not "
                                          f"{'FP4 codes two a byte (uint8)' if self.fp4 else 'float8_e4m3fn'}")
        if self.fp4:
            return "fp4", 2 * shape[1] // tensors["weight_scale"][0][1]
        return "fp8", 32 if self.block else 0

    def read(self, prefix, tensors):
        if self.fp4:
            packed, scale, scale_2 = need_tensors(tensors, prefix, "weight", "weight_scale", "weight_scale_2")
            return fp4_weights(prefix, packed, fp8_scales(prefix, scale) * scale_2.float().reshape(()))
        codes, scale = need_tensors(tensors, prefix, "weight", "weight_scale")
        n, k = codes.shape
        if codes.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{prefix}.weight is {codes.dtype}, not float8_e4m3fn")
        if self.block:  # [N/128, 1, K/128, 1] as ModelOpt writes it, or already [N/128, K/128]
            if scale.dim() == 4 and scale.shape[1] == scale.shape[3] == 1:
                scale = scale[:, 0, :, 0]
            return fp8_blocks(f"{prefix}.weight_scale", codes, scale, self.block)
        want = 1 if self.static else n
        if scale.numel() != want:
            raise ValueError(f"{prefix}.weight_scale: {scale.numel()} values, expected {want} "
                             f"({'one a tensor' if self.static else 'one a row'}, quant_algo {self.algo})")
        return QuantTensor("fp8", codes, scale.to(torch.float32).reshape(-1).expand(n).contiguous(),
                           input_scale=static_input_scale(prefix, tensors, self.static))
