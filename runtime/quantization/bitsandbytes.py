"""bitsandbytes' 4-bit checkpoints (`quant_method: bitsandbytes`, `load_in_4bit`: unsloth's and
others' `-bnb-4bit` models), as transformers saves them: each linear layer's `weight` is its
NormalFloat4 codes, two a byte with the first in the high nibble, flattened ([N * K / 2, 1]),
in blocks of 64 values with one absmax each; beside it `weight.absmax`, `weight.quant_map` (the
16 values), `weight.quant_state.bitsandbytes__nf4` (a JSON of the shape, block size and, with
double quantization, the nested blocks' offset), and with double quantization the absmaxes
quantized too (8-bit codes into `weight.nested_quant_map`, times `weight.nested_absmax` per
block of 256, plus the offset). Read as nf4 QuantTensors: value = NF4[code] * absmax, as
bitsandbytes dequantizes. 8-bit checkpoints (`load_in_8bit`, LLM.int8): `weight` int8 [N, K]
and `SCB`, each row's absmax: int8 QuantTensors with a scale a row of SCB / 127 (bitsandbytes
rounds q * SCB first, then multiplies by 1 / 127: the values differ by at most a float32 ulp;
they are multiplied as other per-row INT8 weights, where bitsandbytes computes its outlier
columns apart). The FP4 variant is refused."""

from __future__ import annotations

import json

import torch

from pageserve.runtime.quantization.methods import QuantMethod, UnsupportedQuantization, need_tensors
from pageserve.runtime.quantization.qtensor import NF4, QuantTensor

_STATE = "weight.quant_state.bitsandbytes__"
_RECIPROCAL_127 = 7.874015718698502e-3  # bitsandbytes' 1 / 127


class BitsAndBytes(QuantMethod):
    name = "bitsandbytes"
    marker = "weight.absmax"

    def __init__(self, cfg: dict):
        self.bits = 8 if cfg.get("load_in_8bit") or cfg.get("_load_in_8bit") else 4
        self.double = bool(cfg.get("bnb_4bit_use_double_quant"))
        if self.bits == 8:
            self.marker = "SCB"
            return
        if not (cfg.get("load_in_4bit") or cfg.get("_load_in_4bit")):
            raise UnsupportedQuantization("bitsandbytes: a config that loads neither 4- nor 8-bit is not a quantized "
                                          "checkpoint pageserve reads")
        kind = cfg.get("bnb_4bit_quant_type", "fp4")
        if kind != "nf4":
            raise UnsupportedQuantization(f"bitsandbytes: 4-bit {kind} weights are not supported (nf4 are)")
        storage = cfg.get("bnb_4bit_quant_storage", "uint8")
        if storage != "uint8":
            raise UnsupportedQuantization(f"bitsandbytes: 4-bit weights stored as {storage} are not supported "
                                          "(uint8 are)")

    def describe(self) -> str:
        if self.bits == 8:
            return "bitsandbytes (int8, LLM.int8's per-row scales)"
        return f"bitsandbytes (nf4{', double quantization' if self.double else ''})"

    def split(self, name: str) -> tuple[str, str]:
        """(layer, suffix): the suffixes of a layer's tensors start at its `weight`."""
        at = name.find(".weight.")
        if at >= 0:
            return name[:at], name[at + 1:]
        return super().split(name)

    def layers(self, names):
        if self.bits == 8:
            return super().layers(names)
        prefixes = {n[:-len("." + self.marker)] for n in names if n.endswith("." + self.marker)}
        out: dict[str, set[str]] = {p: set() for p in prefixes}
        for n in names:
            prefix, suffix = self.split(n)
            if prefix in out and suffix.startswith("weight"):
                out[prefix].add(suffix)
        return out

    def layout(self, tensors):
        if self.bits == 8:
            if tensors.get("weight", ((), "none"))[1] != "I8":
                raise UnsupportedQuantization(f"bitsandbytes: 8-bit weights of dtype {tensors.get('weight')} are "
                                              "not supported (int8 are)")
            return "int8", 0
        (rows, _), dtype = tensors["weight"]
        blocks = tensors["weight.absmax"][0][0]
        if dtype != "U8" or not blocks:
            raise UnsupportedQuantization(f"bitsandbytes: 4-bit weights of dtype {dtype} are not supported")
        return "nf4", 2 * rows // blocks

    def read(self, prefix, tensors):
        if self.bits == 8:
            codes, absmax = need_tensors(tensors, prefix, "weight", "SCB")
            layout = tensors.get("weight_format")
            if layout is not None and int(layout.reshape(-1)[0]) != 0:
                raise UnsupportedQuantization(f"bitsandbytes: {prefix}'s 8-bit weights are in a tiled layout "
                                              f"(weight_format {int(layout.reshape(-1)[0])}), not rows")
            if absmax.numel() != codes.shape[0]:
                raise ValueError(f"{prefix}.SCB: {absmax.numel()} values for {codes.shape[0]} rows")
            return QuantTensor("int8", codes.contiguous(), (absmax.float() * _RECIPROCAL_127).reshape(-1).contiguous())
        packed, absmax, table = need_tensors(tensors, prefix, "weight", "weight.absmax", "weight.quant_map")
        state = next((t for s, t in tensors.items() if s.startswith(_STATE)), None)
        if state is None:
            raise ValueError(f"quantized layer {prefix} lacks its {prefix}.{_STATE}nf4")
        info = json.loads(bytes(state.tolist()))
        if info.get("quant_type") != "nf4" or not torch.equal(table.float().cpu(), NF4):
            raise UnsupportedQuantization(f"bitsandbytes: {prefix} is not NF4 (quant_type {info.get('quant_type')}, "
                                          "or a quant_map of other values)")
        n, k = info["shape"]
        block = info["blocksize"]
        if k % block or packed.numel() * 2 != n * k or absmax.numel() * block != n * k:
            raise UnsupportedQuantization(f"bitsandbytes: {prefix} ({n}x{k}) in blocks of {block} that are not whole "
                                          "blocks of its rows is not supported")
        if "weight.nested_absmax" in tensors:  # the absmaxes quantized in turn, blocks of `nested_blocksize`
            nested, codebook = need_tensors(tensors, prefix, "weight.nested_absmax", "weight.nested_quant_map")
            per = nested.float().repeat_interleave(info["nested_blocksize"])[:absmax.numel()]
            absmax = codebook.float()[absmax.long()] * per + info["nested_offset"]
        codes = torch.stack([packed.reshape(-1) >> 4, packed.reshape(-1) & 0xF], dim=1).reshape(n, k)
        return QuantTensor("nf4", codes, absmax.float().reshape(n, k // block).contiguous(), group_size=block)
