"""A quantized copy of a model directory in the layout a quantization tool writes: FP8, INT8 or
4-bit weights of every decoder layer's linear layers (round to nearest, no calibration), packed
by hand from each format's specification, with the config's `quantization_config`:

- ct-fp8 / ct-fp8-tensor: compressed-tensors `float-quantized`, FP8 E4M3 weights with a scale per
  output channel / per tensor, dynamic per-token FP8 activations (llm-compressor's FP8_DYNAMIC);
- ct-fp8-static: compressed-tensors `float-quantized`, FP8 weights per tensor, static FP8
  activations per tensor (an `input_scale` a layer: llm-compressor's FP8 preset);
- ct-fp8-block: compressed-tensors `float-quantized`, a scale per block of group_size x
  group_size, dynamic FP8 activations per group of group_size columns (llm-compressor's FP8_BLOCK);
- ct-int8: compressed-tensors `int-quantized`, INT8 weights per channel, dynamic per-token INT8
  activations (W8A8); ct-int8-static: static INT8 activations per tensor;
- ct-w4a16 / ct-w4a16-asym: compressed-tensors `pack-quantized`, 4-bit in groups, symmetric /
  with zero points (eight values an int32 word along the row, signed values plus 8);
- ct-w8a16: `pack-quantized` 8-bit, symmetric, in groups (by channel where group_size is -1;
  four values a word, signed values plus 128);
- gptq-int8: AutoGPTQ's 8-bit packing, symmetric (Qwen's -GPTQ-Int8: qweight [K/4, N], every
  zero point 128, stored minus one);
- awq: AutoAWQ's GEMM packing (qweight [K, N/8], columns in the order 0 2 4 6 1 3 5 7);
- gptq: AutoGPTQ's packing (qweight [K/8, N], zero points stored minus one);
- fp8-tensor / fp8-block: vLLM's own `fp8` method, FP8 E4M3 weights with one `weight_scale` a
  tensor (AutoFP8's) / one `weight_scale_inv` a block of group_size x group_size (Qwen's and
  DeepSeek's `-FP8` models; 128 there), dynamic activations; fp8-static: per tensor with
  AutoFP8's static activations (an `input_scale` a layer);
- modelopt-fp8: NVIDIA ModelOpt's FP8 (a legacy hf_quant_config.json): per-tensor weights, static
  activations, FP8 KV-cache scales (`k_proj.k_scale`, `v_proj.v_scale`, uncalibrated: 1/8);
  modelopt-fp8-pcpt: FP8_PER_CHANNEL_PER_TOKEN (config.json); modelopt-fp8-pb-wo: FP8_PB_WO,
  a `weight_scale` [N/128, 1, K/128, 1] a block of 128x128 (group_size is ignored);
- ct-nvfp4 / modelopt-nvfp4: NVFP4 (FP4 e2m1 codes two a byte, an FP8 scale a group of 16, and
  a global scale a layer: compressed-tensors' `nvfp4-pack-quantized` divides by its
  `weight_global_scale`, ModelOpt's NVFP4 multiplies by its `weight_scale_2`), with the W4A4
  activation scales those tools write (group_size is ignored);
- bnb-nf4 / bnb-nf4-single: bitsandbytes' 4-bit NormalFloat with / without double
  quantization (unsloth's `-bnb-4bit` models), written by bitsandbytes itself through
  transformers (group_size is ignored: blocks of 64); bnb-int8: its LLM.int8 (int8 rows with
  their absmax); the reference is bitsandbytes' own dequantization;
- ct-mxfp4: compressed-tensors' `mxfp4-pack-quantized` (MXFP4: e2m1 codes, an E8M0 power of two
  a group of 32), W4A4 as its MXFP4 preset writes it (group_size is ignored).

Static activation scales are not calibrated: each layer's is 1/56, 2/56 or 3/56 by its letter
(inputs up to 8, 16 or 24; q, k and v differ, so that a fused layer must take the largest).

`reference`: also a plain float32 copy whose weights are the quantized values, dequantized
here from the codes (value = (code - zero) * scale): what a correct reader of the quantized
copy must compute with.

    python -m pageserve.loadtest.quantized_copy /tmp/smollm2-w4 --format ct-w4a16
    pageserve bench offline --model /tmp/smollm2-w4 --skip-hf
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

from pageserve.loadtest.bf16_copy import copy_model_files, set_dtype
from pageserve.runtime.models.gguf_file import dense_copy
from pageserve.runtime.models.loader import resolve_model

FORMATS = ("ct-fp8", "ct-fp8-tensor", "ct-fp8-static", "ct-fp8-block", "ct-int8", "ct-int8-static", "ct-w4a16",
           "ct-w4a16-asym", "ct-w8a16", "awq", "gptq", "gptq-int8", "fp8-tensor", "fp8-static", "fp8-block",
           "modelopt-fp8", "modelopt-fp8-pcpt", "modelopt-fp8-pb-wo", "ct-nvfp4", "modelopt-nvfp4", "ct-mxfp4",
           "bnb-nf4", "bnb-nf4-single", "bnb-int8")
# the modelopt formats, as the others they share their tensors with
_MODELOPT_AS = {"modelopt-fp8": "fp8-static", "modelopt-fp8-pcpt": "ct-fp8", "modelopt-fp8-pb-wo": "fp8-block"}
# the decoder layers' linear layers, and each expert's (Mixtral's named w1, w2, w3); a vision
# tower's stay as they are, as quantization tools' recipes leave them
LINEAR = re.compile(r"(?!.*visi)(.*\.layers\.\d+\..*(?:(?:q|k|v|o|gate|up|down)_proj|experts\.\d+\.w[123]))\.weight")
_PROJ = "qkvogud"  # the first letters of q, k, v, o, gate, up and down_proj (Mixtral's w1..w3: none)
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column _AWQ_ORDER[i] of its eight


def rtn_int4(w: torch.Tensor, group: int, symmetric: bool, scale_dtype: torch.dtype):
    """Round-to-nearest 4-bit codes (0..15), scales [N, K/G] (in scale_dtype's values) and zeros."""
    n, k = w.shape
    g = w.view(n, k // group, group)
    if symmetric:
        scales = (g.abs().amax(dim=2) / 7).clamp(min=1e-8).to(scale_dtype).float()
        zeros = torch.full_like(scales, 8)
    else:
        lo, hi = g.amin(dim=2).clamp(max=0), g.amax(dim=2).clamp(min=0)
        scales = ((hi - lo) / 15).clamp(min=1e-8).to(scale_dtype).float()
        zeros = (-lo / scales).round().clamp(1, 15)  # >= 1: GPTQ's original format cannot store 0
    codes = ((g / scales[:, :, None]).round() + zeros[:, :, None]).clamp(0, 15)
    return codes.view(n, k).to(torch.uint8), scales, zeros.to(torch.uint8)


def dequant_int4(codes, scales, zeros, group):
    return (codes.float() - zeros.float().repeat_interleave(group, 1)) * scales.repeat_interleave(group, 1)


def pack_bytes(values: torch.Tensor) -> torch.Tensor:
    """uint8 values [R, C] -> int32 [R, C / 4]: value 4i + j of a row at bits 8j of word i."""
    v = values.to(torch.int64).view(values.shape[0], -1, 4)
    words = sum(v[:, :, j] << (8 * j) for j in range(4))
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def rtn_int8(w: torch.Tensor, group: int, scale_dtype: torch.dtype):
    """Symmetric round-to-nearest 8-bit codes (-127..127) and scales [N, K/G] (group -1: one a row)."""
    n, k = w.shape
    group = k if group <= 0 else group
    g = w.view(n, k // group, group)
    scales = (g.abs().amax(dim=2) / 127).clamp(min=1e-8).to(scale_dtype).float()
    codes = (g / scales[:, :, None]).round().clamp(-127, 127)
    return codes.view(n, k).to(torch.int8), scales


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """uint8 4-bit values [R, C] -> int32 [R, C / 8]: value 8i + j of a row at bits 4j of word i."""
    v = values.to(torch.int32).view(values.shape[0], -1, 8)
    return sum(v[:, :, j] << (4 * j) for j in range(8)).to(torch.int32)


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # FP4's magnitudes; bit 3 is the sign


def fp4_layer(prefix: str, w: torch.Tensor, fmt: str):
    """FP4 round to nearest. NVFP4: a global scale amax / (6 * 448), each group of 16 an FP8
    scale of its amax / 6 in units of it. MXFP4: each group of 32 the power of two 2^(floor(log2
    amax) - 2) (OCP's shared exponent; 2 is e2m1's largest exponent), stored as its E8M0 byte.
    Each value the nearest e2m1 value of w / its group's scale (clamped to +-6)."""
    n, k = w.shape
    size = 32 if fmt == "ct-mxfp4" else 16
    groups = w.view(n, k // size, size)
    amax = groups.abs().amax(dim=2)
    if fmt == "ct-mxfp4":
        exponent = (torch.floor(torch.log2(amax.clamp(min=2.0 ** -125))) - 2).clamp(-127, 127)
        scale, extra = torch.ldexp(torch.ones_like(amax), exponent.int()), {}
        stored = (exponent + 127).to(torch.uint8)
    else:
        global_scale = (w.abs().amax() / (6 * 448)).clamp(min=1e-12)
        stored = (amax / 6 / global_scale).clamp(max=448).to(torch.float8_e4m3fn)
        if fmt.startswith("modelopt"):  # weight_scale_2 multiplies
            scale = stored.float() * global_scale
            extra = {"weight_scale_2": global_scale.reshape(()), "input_scale": torch.tensor(0.01)}
        else:  # weight_global_scale divides
            inverse = (1 / global_scale).reshape(1)
            scale = stored.float() / inverse
            extra = {"weight_global_scale": inverse, "input_global_scale": torch.tensor([100.0])}
    ratio = (groups / torch.where(scale == 0, 1.0, scale)[:, :, None]).clamp(-6, 6)
    codes = (ratio.abs()[..., None] - E2M1).abs().argmin(dim=-1).to(torch.uint8) | ((ratio < 0).to(torch.uint8) << 3)
    values = E2M1[(codes & 7).long()] * torch.where(codes >= 8, -1.0, 1.0)
    deq = (values * scale[:, :, None]).view(n, k)
    codes = codes.view(n, k)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    parts = {"weight" if fmt.startswith("modelopt") else "weight_packed": packed, "weight_scale": stored, **extra}
    return {f"{prefix}.{name}": t for name, t in parts.items()}, deq


def _ct_config(fmt: str, group: int) -> dict:
    dyn = lambda t: {"num_bits": 8, "type": t, "symmetric": True, "strategy": "token", "dynamic": True}  # noqa: E731
    if fmt == "ct-nvfp4":
        weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16,
                   "dynamic": False}
        form, act = "nvfp4-pack-quantized", {**weights, "dynamic": "local"}
    elif fmt == "ct-mxfp4":
        weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
                   "dynamic": False}
        form, act = "mxfp4-pack-quantized", {**weights, "dynamic": True}
    elif fmt == "ct-fp8-block":
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
                   "block_structure": [group, group], "dynamic": False}
        form, act = "float-quantized", {**dyn("float"), "strategy": "group", "group_size": group}
    elif fmt.startswith("ct-fp8"):
        weights = {"num_bits": 8, "type": "float", "symmetric": True,
                   "strategy": "channel" if fmt == "ct-fp8" else "tensor", "dynamic": False}
        form, act = "float-quantized", dyn("float")
        if fmt == "ct-fp8-static":
            act.update(strategy="tensor", dynamic=False)
    elif fmt.startswith("ct-int8"):
        weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
        form, act = "int-quantized", dyn("int")
        if fmt == "ct-int8-static":
            act.update(strategy="tensor", dynamic=False)
    elif fmt == "ct-w8a16":
        weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "group" if group > 0 else "channel",
                   "group_size": group if group > 0 else None, "dynamic": False}
        form, act = "pack-quantized", None
    else:
        weights = {"num_bits": 4, "type": "int", "symmetric": fmt == "ct-w4a16", "strategy": "group",
                   "group_size": group, "dynamic": False}
        form, act = "pack-quantized", None
    return {"quant_method": "compressed-tensors", "format": form, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": act,
                                          "output_activations": None, "format": form}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def quantize_layer(prefix: str, w: torch.Tensor, fmt: str, group: int, scale_dtype: torch.dtype):
    """The checkpoint tensors of one quantized layer, and its dequantized float32 weight."""
    if fmt.endswith("fp4"):
        return fp4_layer(prefix, w, fmt)
    if fmt in _MODELOPT_AS:
        return _modelopt_layer(prefix, w, fmt, scale_dtype)
    n, k = w.shape
    static = {f"{prefix}.input_scale": torch.tensor([(1 + _PROJ.find(prefix.rpartition(".")[2][0]) % 3) / 56.0])}
    if fmt in ("fp8-tensor", "fp8-static", "fp8-block", "ct-fp8-block"):
        b = group if fmt.endswith("block") else max(n, k)  # one block: the whole tensor
        pad = torch.zeros(-(-n // b) * b, -(-k // b) * b)
        pad[:n, :k] = w.abs()
        amax = pad.view(pad.shape[0] // b, b, pad.shape[1] // b, b).amax(dim=(1, 3))
        scale = (amax / 448.0).clamp(min=1e-8).to(scale_dtype).float()
        full = scale.repeat_interleave(b, 0).repeat_interleave(b, 1)[:n, :k]
        codes = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        name = "weight_scale_inv" if fmt == "fp8-block" else "weight_scale"
        return {f"{prefix}.weight": codes, f"{prefix}.{name}": scale if fmt.endswith("block") else scale.reshape(()),
                **(static if fmt == "fp8-static" else {})}, codes.float() * full
    if fmt.startswith("ct-fp8") or fmt.startswith("ct-int8"):
        top = 127.0 if fmt.startswith("ct-int8") else 448.0
        amax = w.abs().amax(dim=1) if fmt in ("ct-fp8", "ct-int8", "ct-int8-static") else w.abs().amax()
        scale = (amax / top).clamp(min=1e-8).to(scale_dtype).float()
        ratio = w / (scale if scale.dim() == 0 else scale[:, None])
        if fmt.startswith("ct-int8"):
            codes = ratio.round().clamp(-127, 127).to(torch.int8)
        else:
            codes = ratio.clamp(-top, top).to(torch.float8_e4m3fn)
        deq = codes.float() * (scale if scale.dim() == 0 else scale[:, None])
        stored = scale.reshape(1) if scale.dim() == 0 else scale[:, None]
        return {f"{prefix}.weight": codes, f"{prefix}.weight_scale": stored.to(scale_dtype),
                **(static if fmt.endswith("static") else {})}, deq
    if fmt in ("ct-w8a16", "gptq-int8"):
        codes, scales = rtn_int8(w, group, scale_dtype)
        deq = codes.float() * scales.repeat_interleave(k // scales.shape[1], 1)
        stored = (codes.to(torch.int16) + 128).to(torch.uint8)  # unsigned, zero point 128
        if fmt == "ct-w8a16":
            return {f"{prefix}.weight_packed": pack_bytes(stored), f"{prefix}.weight_scale": scales.to(scale_dtype),
                    f"{prefix}.weight_shape": torch.tensor([n, k])}, deq
        return {f"{prefix}.qweight": pack_bytes(stored).t().contiguous(),
                f"{prefix}.qzeros": pack_bytes(torch.full((scales.shape[1], n), 127, dtype=torch.uint8)),
                f"{prefix}.scales": scales.t().contiguous().to(scale_dtype),
                f"{prefix}.g_idx": torch.arange(k, dtype=torch.int32) // (k // scales.shape[1])}, deq
    codes, scales, zeros = rtn_int4(w, group, fmt in ("ct-w4a16", "gptq"), scale_dtype)
    deq = dequant_int4(codes, scales, zeros, group)
    if fmt.startswith("ct-"):
        out = {f"{prefix}.weight_packed": pack_rows(codes), f"{prefix}.weight_scale": scales.to(scale_dtype),
               f"{prefix}.weight_shape": torch.tensor([n, k])}
        if fmt == "ct-w4a16-asym":
            out[f"{prefix}.weight_zero_point"] = pack_rows(zeros.t().contiguous()).t().contiguous()
        return out, deq
    if fmt == "awq":
        order = torch.tensor(_AWQ_ORDER)
        swizzle = lambda t: t.view(t.shape[0], -1, 8)[:, :, order].reshape(t.shape)  # noqa: E731
        return {f"{prefix}.qweight": pack_rows(swizzle(codes.t().contiguous())),
                f"{prefix}.qzeros": pack_rows(swizzle(zeros.t().contiguous())),
                f"{prefix}.scales": scales.t().contiguous().to(scale_dtype)}, deq
    return {f"{prefix}.qweight": _gptq_qweight(codes),
            f"{prefix}.qzeros": pack_rows((zeros.to(torch.int32) - 1).to(torch.uint8).t().contiguous()),
            f"{prefix}.scales": scales.t().contiguous().to(scale_dtype),
            f"{prefix}.g_idx": torch.arange(k, dtype=torch.int32) // group}, deq


def _modelopt_layer(prefix: str, w: torch.Tensor, fmt: str, scale_dtype: torch.dtype):
    """ModelOpt's tensors: those of the format with the same scales, a weight_scale of one value
    (FP8), one a row (FP8_PER_CHANNEL_PER_TOKEN) or [N/128, 1, K/128, 1] (FP8_PB_WO); the KV
    cache's scales beside k_proj and v_proj (FP8)."""
    block = fmt == "modelopt-fp8-pb-wo"
    parts, deq = quantize_layer(prefix, w, _MODELOPT_AS[fmt], 128 if block else 0, scale_dtype)
    scale = parts.pop(f"{prefix}.{'weight_scale_inv' if block else 'weight_scale'}")
    parts[f"{prefix}.weight_scale"] = (scale[:, None, :, None] if block
                                       else scale.reshape(-1 if scale.numel() > 1 else ()))
    last = prefix.rpartition(".")[2]
    if fmt == "modelopt-fp8" and last in ("k_proj", "v_proj"):
        parts[f"{prefix}.{last[0]}_scale"] = torch.tensor(0.125)
    return parts, deq


def _modelopt_config(fmt: str) -> tuple[str, dict]:
    """(the file, its content): the legacy hf_quant_config.json for FP8, config.json's
    quantization_config for the others."""
    algo = {"modelopt-fp8": "FP8", "modelopt-fp8-pcpt": "FP8_PER_CHANNEL_PER_TOKEN", "modelopt-fp8-pb-wo": "FP8_PB_WO",
            "modelopt-nvfp4": "NVFP4"}
    producer = {"name": "modelopt", "version": "0.37.0"}
    if fmt == "modelopt-fp8":
        return "hf_quant_config.json", {"producer": producer, "quantization": {
            "quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}}
    return "config.json", {"quant_method": "modelopt", "quant_algo": algo[fmt], "ignore": ["lm_head"],
                           "producer": producer, **({"group_size": 16} if fmt.endswith("nvfp4") else {})}


def _bnb_copy(src: Path, out: Path, reference: Path | None, double: bool, eight: bool) -> Path:
    """bitsandbytes' own 4-bit NF4 copy (with double quantization or without) or 8-bit one, saved
    by transformers; the reference holds bitsandbytes' dequantization of each layer."""
    import bitsandbytes.functional as bnb
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if eight:
        config = BitsAndBytesConfig(load_in_8bit=True)
    else:
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double,
                                    bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(str(src), quantization_config=config, dtype=torch.float32,
                                                 device_map="cpu")
    copy_model_files(src, out)
    model.save_pretrained(str(out))
    if reference:
        copy_model_files(src, reference)
        dense = {}
        for f in sorted(src.glob("*.safetensors")):
            dense.update(load_file(f))
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if getattr(weight, "quant_state", None) is not None:
                dense[f"{name}.weight"] = bnb.dequantize_4bit(weight.data, weight.quant_state).float().contiguous()
            elif getattr(weight, "SCB", None) is not None:
                dense[f"{name}.weight"] = bnb.int8_vectorwise_dequant(weight.data, weight.SCB).float().contiguous()
        save_file({k: v.float().contiguous() for k, v in dense.items()}, reference / "model.safetensors",
                  metadata={"format": "pt"})
        set_dtype(reference, "float32")
    return out


def _gptq_qweight(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes -> int32 [K / 8, N]: input rows 8i..8i+7 of column n in word [i, n], row 8i + j
    at bits 4j."""
    return pack_rows(codes).t().contiguous()


def quantized_copy(src: Path, out: Path, fmt: str, group_size: int = 128, reference: Path | None = None,
                   scale_dtype: torch.dtype | None = None) -> Path:
    """`src` (an HF directory) quantized into `out` in format `fmt`; with `reference`, its
    dequantized float32 copy there too. scale_dtype: the scales' stored dtype (default float16
    for AWQ and GPTQ, as their tools write them, else float32)."""
    from safetensors.torch import load_file, save_file

    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}")
    src = dense_copy(src)
    if fmt.startswith("bnb-"):
        return _bnb_copy(src, out, reference, double=fmt == "bnb-nf4", eight=fmt == "bnb-int8")
    scale_dtype = scale_dtype or (torch.float16 if fmt in ("awq", "gptq", "gptq-int8") else torch.float32)
    for d in [out] + ([reference] if reference else []):
        copy_model_files(src, d)
    quantized, dense = {}, {}
    for f in sorted(src.glob("*.safetensors")):
        for name, t in load_file(f).items():
            m = LINEAR.fullmatch(name)
            if m is None:
                quantized[name] = dense[name] = t.contiguous()
                continue
            parts, deq = quantize_layer(m.group(1), t.float(), fmt, group_size, scale_dtype)
            quantized.update(parts)
            dense[name] = deq.contiguous()
    save_file(quantized, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    if fmt.startswith("modelopt"):
        where, quant = _modelopt_config(fmt)
        if where == "config.json":
            cfg["quantization_config"] = quant
        else:
            (out / where).write_text(json.dumps(quant, indent=1))
    elif fmt.startswith("ct-"):
        cfg["quantization_config"] = _ct_config(fmt, group_size)
    elif fmt.startswith("fp8-"):
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                      "activation_scheme": "static" if fmt == "fp8-static" else "dynamic",
                                      **({"weight_block_size": [group_size, group_size]} if fmt == "fp8-block" else {})}
    elif fmt == "awq":
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                      "zero_point": True, "version": "gemm"}
    else:
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": 8 if fmt == "gptq-int8" else 4,
                                      "group_size": group_size, "desc_act": False, "sym": True,
                                      "checkpoint_format": "gptq"}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    if reference:
        save_file({k: v.float() if v.is_floating_point() else v for k, v in dense.items()},
                  reference / "model.safetensors", metadata={"format": "pt"})
        set_dtype(reference, "float32")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="directory to write")
    p.add_argument("--model", default=None, help="model directory or .gguf (default: the default model)")
    p.add_argument("--format", default="ct-w4a16", choices=FORMATS)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--scale-dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="the scales' stored dtype (default: float16 for awq and gptq, else float32)")
    args = p.parse_args()
    dtype = getattr(torch, args.scale_dtype) if args.scale_dtype else None
    print(quantized_copy(resolve_model(args.model), args.out, args.format, args.group_size, scale_dtype=dtype))


if __name__ == "__main__":
    main()
