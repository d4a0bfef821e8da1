"""llm-compressor's `compressed-tensors` checkpoints: which of their schemes pageserve serves
(refusing the others in one line), and how each quantized layer's tensors read into a
QuantTensor."""

from __future__ import annotations

import torch

from pageserve.runtime.quantization.methods import (QuantMethod, UnsupportedQuantization, block_grid, e8m0_scales,
                                                    fp4_weights, fp8_block_size, fp8_blocks, fp8_scales, int4_tensor,
                                                    kv_cache_scheme, need_tensors, static_input_scale)
from pageserve.runtime.quantization.qtensor import QuantTensor, unpack_bytes, unpack_nibbles

# compressed-tensors' FP4 formats: (format, strategy, group size) -> name
_FP4_FORMATS = {("nvfp4-pack-quantized", "tensor_group", 16): "NVFP4", ("mxfp4-pack-quantized", "group", 32): "MXFP4"}


class CompressedTensors(QuantMethod):
    """llm-compressor's `compressed-tensors`: FP8 weights (`float-quantized`) per channel, per
    tensor, or per block (as the C linear's FP8 groups, activations unquantized); INT8 weights
    (`int-quantized`/`naive-quantized`) per channel, symmetric; either with dynamic per-token
    activations, static per-tensor ones (`input_scale`) or none; 4-bit weights
    `pack-quantized` in groups or per channel, symmetric or with zero points; NVFP4
    (`nvfp4-pack-quantized`: e2m1 codes, an FP8 scale a group of 16, divided by the layer's
    `weight_global_scale`) and MXFP4 (`mxfp4-pack-quantized`: an E8M0 power of two a group of
    32), both weight-only."""
    name = "compressed-tensors"
    marker = "weight_scale"

    def __init__(self, cfg: dict):
        kv = kv_cache_scheme(cfg)
        fmt = cfg.get("format")
        groups = cfg.get("config_groups") or {}
        if not groups and kv is None:
            raise UnsupportedQuantization("compressed-tensors: the config has no config_groups")
        self.schemes = [] if kv is None else ["FP8 KV-cache scales"]
        self.block: tuple[int, int] | None = None  # block-wise FP8 weights' block (rows, columns)
        self.static: bool | None = None  # activations quantized with the checkpoint's input_scale
        self.packed_bits: int | None = None  # pack-quantized integer weights' width
        self.group_sizes = {g.get("weights", {}).get("group_size") for g in groups.values()} - {None}
        for name, group in groups.items():
            w, act = group.get("weights") or {}, group.get("input_activations")
            kind = (w.get("type"), w.get("num_bits"))
            gfmt = group.get("format") or fmt
            where = f"compressed-tensors group {name}"
            if not w and kv is not None:  # the attention's query quantized (for FP8 attention): not here
                continue
            if kind == ("float", 8):
                if w.get("strategy") == "block":
                    block = fp8_block_size(w.get("block_structure"), f"{where}: FP8 weights in blocks of")
                    if self.block not in (None, block):
                        raise UnsupportedQuantization(f"compressed-tensors: FP8 weights in blocks of {self.block} "
                                                      f"and of {block} in one checkpoint are not supported")
                    self.block = block
                elif w.get("strategy") not in ("tensor", "channel"):
                    raise UnsupportedQuantization(f"{where}: FP8 weights by {w.get('strategy')} are not supported "
                                                  "(by tensor, channel or block are)")
            elif kind == ("int", 8):
                if not w.get("symmetric", True):
                    raise UnsupportedQuantization(f"{where}: asymmetric INT8 weights are not supported")
                packed = gfmt == "pack-quantized"  # W8A16: four a word, by channel or in groups
                if w.get("strategy") not in (("channel", "group") if packed else ("tensor", "channel")):
                    raise UnsupportedQuantization(f"{where}: INT8 weights by {w.get('strategy')} in format {gfmt} "
                                                  "are not supported")
                if packed and (act is not None or w.get("actorder") == "group"):
                    raise UnsupportedQuantization(f"{where}: packed INT8 weights with quantized activations or "
                                                  "activation ordering are not supported")
                if packed:
                    self._pack(8)
                    self.schemes.append("W8A16")
                    continue
            elif kind == ("int", 4):
                if gfmt not in ("pack-quantized", None):
                    raise UnsupportedQuantization(f"{where}: 4-bit weights in format {gfmt} are not supported "
                                                  "(pack-quantized is)")
                self._pack(4)
                if w.get("strategy") not in ("group", "channel"):
                    raise UnsupportedQuantization(f"{where}: 4-bit weights by {w.get('strategy')} are not supported")
                if w.get("actorder") == "group":
                    raise UnsupportedQuantization(f"{where}: activation ordering (actorder: group) is not supported")
            elif kind == ("float", 4):
                name = _FP4_FORMATS.get((gfmt, w.get("strategy"), w.get("group_size")))
                if name is None:
                    raise UnsupportedQuantization(f"{where}: 4-bit float weights in format {gfmt} by "
                                                  f"{w.get('strategy')} in groups of {w.get('group_size')} are not "
                                                  "supported (NVFP4 and MXFP4 are)")
                if not w.get("symmetric", True):
                    raise UnsupportedQuantization(f"{where}: asymmetric {name} weights (zero points) are not supported")
                if act is not None and (act.get("type"), act.get("num_bits")) != ("float", 4):
                    raise UnsupportedQuantization(f"{where}: {name} weights beside {act.get('num_bits')}-bit "
                                                  f"{act.get('type')} activations are not supported")
                # FP4 activations (W4A4: FP4 kernels Blackwell has) are not quantized here
                self.schemes.append(f"{name} weight-only")
                continue
            else:
                raise UnsupportedQuantization(f"{where}: {w.get('num_bits')}-bit {w.get('type')} weights "
                                              f"(format {gfmt}) are not supported; FP8, INT8, 4-bit integer "
                                              "and NVFP4 weights are")
            static = act is not None and not act.get("dynamic", False)
            if act is not None:
                # static: one scale a tensor, symmetric, beside per-row (not block-wise) 8-bit weights
                if (act.get("type"), act.get("num_bits")) not in (("float", 8), ("int", 8)) or static and (
                        act.get("strategy") != "tensor" or not act.get("symmetric", True)
                        or kind[1] != 8 or w.get("strategy") == "block"):
                    symmetric = "symmetric" if act.get("symmetric", True) else "asymmetric"
                    raise UnsupportedQuantization(
                        f"{where}: input activations {act.get('num_bits')}-bit {act.get('type')} "
                        f"{'static' if static else 'dynamic'} {symmetric} by {act.get('strategy')} beside "
                        f"{kind[1]}-bit weights by {w.get('strategy')} are not supported (dynamic FP8 or INT8 are, "
                        "and static symmetric by tensor beside 8-bit weights by tensor or channel)")
            if kind[1] == 8 and w.get("strategy") != "block":  # the layers that read an input_scale, or not
                if self.static not in (None, static):
                    raise UnsupportedQuantization("compressed-tensors: 8-bit groups with static activation scales "
                                                  "beside 8-bit groups without are not supported")
                self.static = static
            if w.get("strategy") == "block":  # its activations (per group of columns) stay unquantized here
                self.schemes.append("FP8 in blocks of %dx%d" % self.block)
                continue
            self.schemes.append(f"{'W4A16' if kind[1] == 4 else ('FP8' if kind[0] == 'float' else 'INT8')}"
                                f"{'' if kind[1] == 4 or act else ' weight-only'}{' static' if static else ''}")

    def _groups(self, prefix: str, k: int, scale: torch.Tensor) -> int:
        """The groups of a pack-quantized row of k values: its scales' columns, each of a group
        size of the config (compressed-tensors writes a last, partial group where the size does
        not divide K; not served)."""
        groups = scale.shape[1] if scale.dim() == 2 else 1
        if k % groups or groups > 1 and k // groups not in self.group_sizes:
            raise UnsupportedQuantization(f"compressed-tensors: {prefix}'s {k} columns in {groups} groups are not "
                                          f"whole groups of {sorted(self.group_sizes)}")
        return groups

    def _pack(self, bits: int) -> None:
        """pack-quantized integer weights of `bits` bits (one width a checkpoint: the layers'
        shapes alone do not tell 4 from 8)."""
        if self.packed_bits not in (None, bits):
            raise UnsupportedQuantization("compressed-tensors: 4-bit and 8-bit pack-quantized weights in one "
                                          "checkpoint are not supported")
        self.packed_bits = bits

    def describe(self) -> str:
        return f"{self.name} ({', '.join(sorted(set(self.schemes)))})"

    def layout(self, tensors):
        if "weight_packed" in tensors:
            ((_, words), dtype), scale = tensors["weight_packed"], tensors["weight_scale"][0]
            if dtype == "U8":  # NVFP4 or MXFP4: two codes a byte
                return "fp4", 2 * words // scale[1]
            groups = scale[1] if len(scale) == 2 else 1
            if self.packed_bits == 8:  # W8A16, by channel a group of K: weight-only everywhere, as 4-bit
                return "int8", 4 * words // groups
            return "int4", 8 * words // groups
        shape, dtype = tensors.get("weight", ((), "?"))
        kind = {"F8_E4M3": "fp8", "I8": "int8"}.get(dtype)
        if kind is None:
            raise UnsupportedQuantization(f"compressed-tensors: weights of dtype {dtype} are not supported")
        return kind, 32 if self._blocks(shape, tensors["weight_scale"][0]) else 0

    def _blocks(self, shape, scale_shape) -> bool:
        """Whether a matrix of `shape` with scales of `scale_shape` is quantized block-wise."""
        return self.block is not None and len(shape) == 2 and tuple(scale_shape) == block_grid(*shape, self.block)

    def read(self, prefix, tensors):
        scale = tensors["weight_scale"]
        if "weight_packed" in tensors and tensors["weight_packed"].dtype == torch.uint8:  # FP4
            if scale.dtype == torch.uint8:  # MXFP4: a power of two a group
                return fp4_weights(prefix, tensors["weight_packed"], e8m0_scales(prefix, scale))
            packed, global_scale = need_tensors(tensors, prefix, "weight_packed", "weight_global_scale")
            return fp4_weights(prefix, packed, fp8_scales(prefix, scale) / global_scale.float().reshape(()))
        if "weight_packed" in tensors and self.packed_bits == 8:  # values stored plus 128, four a word
            packed, shape = need_tensors(tensors, prefix, "weight_packed", "weight_shape")
            n, k = (int(v) for v in shape.tolist())
            codes = (unpack_bytes(packed, dim=1)[:, :k].to(torch.int16) - 128).to(torch.int8)
            groups = self._groups(prefix, k, scale)
            return QuantTensor("int8", codes.contiguous(), scale.to(torch.float32).reshape(n, groups).contiguous(),
                               group_size=k // groups)
        if "weight_packed" in tensors:
            packed, shape = need_tensors(tensors, prefix, "weight_packed", "weight_shape")
            n, k = (int(v) for v in shape.tolist())
            codes = unpack_nibbles(packed, dim=1)[:, :k]  # signed values stored plus 8
            zp = tensors.get("weight_zero_point")
            groups = self._groups(prefix, k, scale)
            if zp is None:
                zeros = torch.full((n, groups), 8, dtype=torch.uint8)
            else:  # packed along the rows, plus 8 as well
                zeros = unpack_nibbles(zp, dim=0)[:n]
            return int4_tensor(prefix, codes, scale.reshape(n, -1), zeros)
        weight, = need_tensors(tensors, prefix, "weight")
        n = weight.shape[0]
        if weight.dtype == torch.float8_e4m3fn and self._blocks(weight.shape, scale.shape):
            return fp8_blocks(f"{prefix}.weight_scale", weight, scale, self.block)
        if scale.numel() not in (1, n):
            raise ValueError(f"{prefix}: a scale of shape {tuple(scale.shape)} for {n} rows")
        scales = scale.to(torch.float32).reshape(-1).expand(n).contiguous()
        for zero in ("weight_zero_point", "input_zero_point"):
            if tensors.get(zero) is not None and tensors[zero].any():
                raise ValueError(f"{prefix}.{zero}: non-zero zero points are not supported")
        static = static_input_scale(prefix, tensors, bool(self.static))
        if weight.dtype == torch.float8_e4m3fn:
            return QuantTensor("fp8", weight, scales, input_scale=static)
        if weight.dtype == torch.int8:
            return QuantTensor("int8", weight, scales, input_scale=static)
        raise ValueError(f"{prefix}: quantized weight of dtype {weight.dtype}")
