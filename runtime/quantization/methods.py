"""The quantized checkpoint formats pageserve reads (compressed-tensors', ModelOpt's and
bitsandbytes' in their own modules), each a small object that knows its
`quantization_config`, which checkpoint tensors make up one quantized linear layer, and how to
read them into a QuantTensor (qtensor.py). What a format holds that pageserve cannot serve is
refused when the config is read, in one line naming it."""

from __future__ import annotations

import re

import torch

from pageserve.runtime.models.loader import ModelLoadError
from pageserve.runtime.quantization.qtensor import QuantTensor, quantize_fp8, unpack_bytes, unpack_nibbles


_KV_SCALE_SUFFIXES = ("output_scale", "k_scale", "v_scale", "q_scale")


class UnsupportedQuantization(ModelLoadError):
    """A quantized checkpoint (or --quantization) pageserve does not serve; one line for the user."""


class QuantMethod:
    """A checkpoint format. `marker`: the suffix of the tensor that marks a linear layer as
    quantized (its prefix is the layer's name); `read` turns that layer's tensors, by suffix, into
    a QuantTensor."""
    name = ""
    marker = ""
    online = False  # quantized as the checkpoint loads (--quantization fp8), not stored so

    def describe(self) -> str:
        return self.name

    def layers(self, names: dict[str, tuple]) -> dict[str, set[str]]:
        """The quantized layers of a checkpoint, from its tensors' names (-> (shape, dtype)):
        layer prefix -> the suffixes of its tensors."""
        suffix = "." + self.marker
        prefixes = {n[:-len(suffix)] for n in names if n.endswith(suffix)}
        out: dict[str, set[str]] = {p: set() for p in prefixes}
        for n in names:
            prefix, _, last = n.rpartition(".")
            # a bias loads as any dense tensor (Qwen2's q/k/v); k_proj's output_scale (or k_scale)
            # is a KV-cache scale (kv_scales.py)
            if prefix in out and last != "bias" and last not in _KV_SCALE_SUFFIXES:
                out[prefix].add(last)
        return out

    def split(self, name: str) -> tuple[str, str]:
        """(layer, suffix) of one of a quantized layer's tensors: the last name part is the suffix."""
        prefix, _, suffix = name.rpartition(".")
        return prefix, suffix

    def layout(self, tensors: dict[str, tuple]) -> tuple[str, int]:
        """(kind, group size) of one quantized layer, from its tensors' (shape, dtype name)."""
        return "int4", self._group(tensors)

    def _group(self, tensors: dict[str, tuple]) -> int:
        """Columns a 4-bit scale covers: the layer's input features over the scales' groups (both
        as the checkpoint holds them: a tensor-parallel rank's share is cut later)."""
        raise NotImplementedError

    def read(self, prefix: str, tensors: dict[str, torch.Tensor]) -> QuantTensor:
        raise NotImplementedError


def need_tensors(tensors: dict, prefix: str, *names: str) -> list[torch.Tensor]:
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ValueError(f"quantized layer {prefix} lacks {', '.join(f'{prefix}.{n}' for n in missing)}")
    return [tensors[n] for n in names]


def int4_tensor(prefix: str, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> QuantTensor:
    n, k = codes.shape
    if scales.dim() != 2 or scales.shape[0] != n or not scales.shape[1] or k % scales.shape[1]:
        raise ValueError(f"{prefix}: scales {tuple(scales.shape)} do not make groups of a {n}x{k} matrix")
    return QuantTensor("int4", codes, scales.to(torch.float32).contiguous(), zeros.contiguous(), k // scales.shape[1])


def check_groups(method: str, prefix: str, k: int, groups: int, group_size: int | None) -> None:
    """That a layer's K columns make `groups` whole groups of the config's `group_size` (-1 or
    None: one group a row). A K that is not a multiple of it (AutoGPTQ then rounds the scale
    rows up) would be read as groups of another size."""
    size = k if group_size in (-1, None) else group_size
    if not isinstance(size, int) or size < 1 or k % size or k // size != groups:
        raise UnsupportedQuantization(
            f"{method}: {prefix} has {k} input columns in {groups} groups, which is not groups of the config's "
            f"group_size {group_size} (input sizes must be a multiple of the group size)")


def fp4_weights(prefix: str, packed: torch.Tensor, scales: torch.Tensor) -> QuantTensor:
    """FP4 weights (NVFP4, MXFP4): e2m1 codes two a byte [N, K / 2] (the even column in the low
    nibble), with the float32 scale of each group of columns [N, K / G] (each value is then
    e2m1(code) * scale, as the formats' dequantizers compute it)."""
    if packed.dim() != 2 or packed.dtype != torch.uint8 or scales.dim() != 2 or scales.shape[0] != packed.shape[0] \
            or not scales.shape[1] or 2 * packed.shape[1] % scales.shape[1]:
        raise ValueError(f"{prefix}: FP4 codes {packed.dtype} {tuple(packed.shape)} and scales {tuple(scales.shape)} "
                         "do not make groups")
    codes = torch.stack([packed & 0xF, packed >> 4], dim=2).reshape(packed.shape[0], -1)
    group = codes.shape[1] // scales.shape[1]
    return QuantTensor("fp4", codes, scales.to(torch.float32).contiguous(), group_size=group)


def fp8_scales(prefix: str, scale: torch.Tensor) -> torch.Tensor:
    """NVFP4's group scales (float8_e4m3fn, one a group of 16) in float32."""
    if scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{prefix}.weight_scale is {scale.dtype}, not NVFP4's float8_e4m3fn")
    return scale.to(torch.float32)


def e8m0_scales(prefix: str, scale: torch.Tensor) -> torch.Tensor:
    """MXFP4's group scales: E8M0 bytes (a power of two, 2^(e - 127); 255 is NaN) in float32."""
    if scale.dtype != torch.uint8:
        raise ValueError(f"{prefix}.weight_scale is {scale.dtype}, not MXFP4's uint8 exponents")
    e = scale.to(torch.int32)
    return torch.where(e == 255, float("nan"), torch.ldexp(torch.ones(e.shape), e - 127))


def static_input_scale(prefix: str, tensors: dict, static: bool) -> float | None:
    """A layer's static activation scale (`input_scale`, one value), where its config says the
    activations are static; None where they are dynamic."""
    scale = tensors.get("input_scale")
    if not static:
        if scale is not None:
            raise ValueError(f"{prefix}.input_scale: a static activation scale, but the config's activations "
                             "are dynamic")
        return None
    if scale is None or scale.numel() != 1:
        raise ValueError(f"{prefix}.input_scale: {'missing' if scale is None else f'{scale.numel()} values'}, "
                         "expected one (static activations)")
    value = float(scale.float().reshape(()))
    if not 0 < value < float("inf"):
        raise ValueError(f"{prefix}.input_scale is {value}, not a finite positive scale")
    return value


def block_grid(n: int, k: int, block: tuple[int, int]) -> tuple[int, int]:
    """The scales of an n x k matrix in blocks of `block` (rows, columns), the last ones partial."""
    return -(-n // block[0]), -(-k // block[1])


def fp8_blocks(name: str, codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> QuantTensor:
    """FP8 codes [N, K] with a scale per block of `block`, as a QuantTensor in groups of 32
    columns: each 32 values of a row take their block's scale (the C kernels' block; a column
    block must be a multiple of 32, a tensor-parallel shard may cut inside one)."""
    n, k = codes.shape
    want = block_grid(n, k, block)
    if tuple(scale.shape) != want:
        raise ValueError(f"{name}: {tuple(scale.shape)} scales, expected {want} for a {n}x{k} matrix in blocks of "
                         f"{block[0]}x{block[1]}")
    if k % 32:
        raise ValueError(f"{name}: {k} columns, not a multiple of 32 (the C kernels' blocks)")
    bn, bk = block
    per32 = scale.to(torch.float32).repeat_interleave(bn, 0)[:n].repeat_interleave(bk // 32, 1)[:, :k // 32]
    return QuantTensor("fp8", codes, per32.contiguous(), group_size=32)


def fp8_block_size(block, where: str) -> tuple[int, int]:
    """A block size as a config gives it ([rows, columns]), checked: the columns a multiple of 32."""
    if not isinstance(block, (list, tuple)) or len(block) != 2 \
            or not all(isinstance(b, int) and b > 0 for b in block) or block[1] % 32:
        raise UnsupportedQuantization(f"{where} {block!r}: two positive sizes, the second (columns) a multiple "
                                      "of 32, are needed")
    return tuple(block)


_KV_STRATEGIES = ("tensor", "attn_head")


def modelopt_fields(qcfg: dict) -> tuple[str, object]:
    """(quant_algo, the KV cache's quantization) of a ModelOpt config in either layout: the
    legacy hf_quant_config.json's {"quantization": {"quant_algo", "kv_cache_quant_algo"}}, or
    config.json's {"quant_algo", "kv_cache_scheme"}."""
    inner = qcfg.get("quantization")
    if isinstance(inner, dict):
        return str(inner.get("quant_algo") or "").upper(), inner.get("kv_cache_quant_algo")
    return str(qcfg.get("quant_algo") or "").upper(), qcfg.get("kv_cache_scheme")


def kv_cache_scheme(qcfg: dict | None) -> dict | None:
    """The checkpoint's kv_cache_scheme (None: none); one that is not static symmetric float8
    per tensor or per KV head is refused in one line. AutoFP8's "static", and ModelOpt's
    kv_cache_quant_algo FP8, are float8 per tensor."""
    qcfg = qcfg or {}
    scheme = qcfg.get("kv_cache_scheme")
    if str(qcfg.get("quant_method", "")).lower().startswith("modelopt"):
        scheme = modelopt_fields(qcfg)[1]
        if isinstance(scheme, str):  # kv_cache_quant_algo
            if scheme.upper() != "FP8":
                raise UnsupportedQuantization(f"modelopt: kv_cache_quant_algo {scheme} is not supported (FP8 is)")
            scheme = "static"
    if not scheme:
        return None
    if scheme == "static":
        return {"type": "float", "num_bits": 8, "strategy": "tensor", "symmetric": True, "dynamic": False}
    if not isinstance(scheme, dict):
        raise UnsupportedQuantization(f"kv_cache_scheme {scheme!r} is not a scheme (an object of num_bits, type, ...)")
    kind = (scheme.get("type"), scheme.get("num_bits"))
    if kind != ("float", 8) or not scheme.get("symmetric", True) or scheme.get("dynamic", False) \
            or scheme.get("strategy", "tensor") not in _KV_STRATEGIES:
        symmetric = "symmetric" if scheme.get("symmetric", True) else "asymmetric"
        raise UnsupportedQuantization(
            f"KV-cache quantization (kv_cache_scheme) {scheme.get('num_bits')}-bit {scheme.get('type')} "
            f"{'dynamic' if scheme.get('dynamic') else 'static'} {symmetric} by {scheme.get('strategy', 'tensor')} "
            "is not supported (static symmetric float8 per tensor or per attention head is)")
    return scheme


class AWQ(QuantMethod):
    """AutoAWQ's GEMM packing: qweight int32 [K, N / 8], eight output columns a word in the
    order 0, 2, 4, 6, 1, 3, 5, 7; qzeros [K / G, N / 8] packed alike; scales [K / G, N]."""
    name = "awq"
    marker = "qweight"
    _ORDER = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # the nibble that holds column j of its word

    def __init__(self, cfg: dict):
        if cfg.get("bits", 4) != 4:
            raise UnsupportedQuantization(f"awq: {cfg.get('bits')}-bit weights are not supported (4-bit are)")
        if str(cfg.get("version", "gemm")).lower() != "gemm":
            raise UnsupportedQuantization(f"awq: version {cfg.get('version')} packing is not supported (gemm is)")
        self.zero_point = cfg.get("zero_point", True)
        self.group_size = cfg.get("group_size", 128)

    def describe(self) -> str:
        return f"awq (4-bit, groups of {self.group_size})"

    def _group(self, tensors):
        return tensors["qweight"][0][0] // tensors["scales"][0][0]

    def _columns(self, words: torch.Tensor) -> torch.Tensor:
        values = unpack_nibbles(words, dim=1)
        r, c = values.shape
        return values.view(r, c // 8, 8)[:, :, self._ORDER].reshape(r, c)

    def read(self, prefix, tensors):
        qweight, scales = need_tensors(tensors, prefix, "qweight", "scales")
        codes = self._columns(qweight).t().contiguous()  # [N, K]
        check_groups(self.name, prefix, codes.shape[1], scales.shape[0], self.group_size)
        if self.zero_point:
            zeros = self._columns(need_tensors(tensors, prefix, "qzeros")[0]).t()
        else:
            zeros = torch.full((codes.shape[0], scales.shape[0]), 8, dtype=torch.uint8)
        return int4_tensor(prefix, codes, scales.t(), zeros)


class GPTQ(QuantMethod):
    """AutoGPTQ/GPTQModel's packing: qweight int32 [K / 8, N] (eight input rows a word; 8-bit:
    [K / 4, N], four), qzeros [K / G, N / 8] (eight output columns a word, each stored minus one
    in the original `gptq` format, as is in `gptq_v2`; 8-bit: four), scales [K / G, N], g_idx
    [K]. 8-bit weights must be symmetric (every zero point 128: Qwen's -GPTQ-Int8 models) and
    load as int8 codes q - 128 with group scales. desc_act (act-order) is served where g_idx is
    the plain k // G; a reordering g_idx is refused."""
    name = "gptq"
    marker = "qweight"

    def __init__(self, cfg: dict):
        self.bits = cfg.get("bits", 4)
        if self.bits not in (4, 8):
            raise UnsupportedQuantization(f"gptq: {self.bits}-bit weights are not supported (4- and 8-bit are)")
        if self.bits == 8 and cfg.get("sym", True) is False:
            raise UnsupportedQuantization("gptq: asymmetric 8-bit weights (sym: false) are not supported")
        fmt = cfg.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise UnsupportedQuantization(f"gptq: checkpoint_format {fmt} (a Marlin-only layout) is not supported")
        self.zero_offset = 1 if fmt == "gptq" else 0
        self.group_size = cfg.get("group_size", 128)

    def describe(self) -> str:
        groups = 'per channel' if self.group_size in (-1, None) else f'groups of {self.group_size}'
        return f"gptq ({self.bits}-bit, {groups})"

    def layout(self, tensors):
        rows, groups = tensors["qweight"][0][0], tensors["scales"][0][0]
        return ("int8", 4 * rows // groups) if self.bits == 8 else ("int4", 8 * rows // groups)

    def read(self, prefix, tensors):
        qweight, qzeros, scales = need_tensors(tensors, prefix, "qweight", "qzeros", "scales")
        unpack = unpack_bytes if self.bits == 8 else unpack_nibbles
        codes = unpack(qweight, dim=0).t().contiguous()  # [N, K]
        k = codes.shape[1]
        check_groups(self.name, prefix, k, scales.shape[0], self.group_size)
        g_idx = tensors.get("g_idx")
        plain = torch.arange(k) // (k // scales.shape[0])
        if g_idx is not None and not torch.equal(g_idx.to(torch.int64).cpu(), plain):
            raise UnsupportedQuantization(f"gptq: {prefix} reorders its input channels (desc_act / act-order "
                                          "with a g_idx other than k // group_size), which is not supported")
        zeros = (unpack(qzeros, dim=1).to(torch.int16) + self.zero_offset).t()
        if self.bits == 8:
            if not bool((zeros == 128).all()):
                raise UnsupportedQuantization(f"gptq: {prefix} has 8-bit zero points other than 128 (asymmetric), "
                                              "which are not supported")
            groups = scales.shape[0]
            return QuantTensor("int8", (codes.to(torch.int16) - 128).to(torch.int8), scales.t().to(torch.float32)
                               .contiguous(), group_size=k // groups)
        if zeros.max() > 15:  # the `gptq` format stores each minus one: a zero point of 0 wraps to 15
            raise UnsupportedQuantization(
                f"gptq: {prefix} has zero points past 15 (a `gptq`-format checkpoint stores each minus one, so a "
                "zero point of 0 is lost; GPTQModel's gptq_v2 format keeps it)")
        return int4_tensor(prefix, codes, scales.t(), zeros.to(torch.uint8))


class FP8Checkpoint(QuantMethod):
    """vLLM's own `fp8` checkpoints: FP8 E4M3 weights with one scale per tensor (AutoFP8's
    `weight_scale`) or per block of `weight_block_size` (Qwen's and DeepSeek's `-FP8` models,
    `weight_scale_inv`, which multiplies despite its name), activations quantized dynamically,
    or with a static `input_scale` a layer (AutoFP8's static scheme, per-tensor weights only).
    Block-wise weights keep a scale for each 32 values of a row (their block's)."""
    name = "fp8"

    def __init__(self, cfg: dict):
        scheme = cfg.get("activation_scheme", "dynamic")
        block = cfg.get("weight_block_size")
        if scheme not in ("dynamic", "static") or scheme == "static" and block is not None:
            raise UnsupportedQuantization(f"fp8 checkpoint with {scheme} activation scales"
                                          f"{' and block-wise weights' if block is not None else ''} is not supported "
                                          "(dynamic is, and static beside per-tensor weights)")
        if cfg.get("fmt", "e4m3") != "e4m3":
            raise UnsupportedQuantization(f"fp8 checkpoint in {cfg.get('fmt')} is not supported (e4m3 is)")
        self.block = None if block is None else fp8_block_size(block, "fp8 checkpoint with weight_block_size")
        self.static = scheme == "static"
        self.marker = "weight_scale_inv" if block is not None else "weight_scale"

    def describe(self) -> str:
        return (f"fp8 ({'blocks of %dx%d' % self.block if self.block else 'per-tensor scales'}"
                f"{', static activations' if self.static else ''})")

    def layout(self, tensors):
        return "fp8", 0 if self.block is None else 32  # a block's scale for each 32 columns of its rows

    def read(self, prefix, tensors):
        codes, scale = need_tensors(tensors, prefix, "weight", self.marker)
        n, k = codes.shape
        if codes.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{prefix}.weight is {codes.dtype}, not float8_e4m3fn")
        if self.block is None:
            if scale.numel() != 1:
                raise ValueError(f"{prefix}.weight_scale: {scale.numel()} values, expected one")
            return QuantTensor("fp8", codes, scale.to(torch.float32).reshape(1).expand(n).contiguous(),
                               input_scale=static_input_scale(prefix, tensors, self.static))
        return fp8_blocks(f"{prefix}.weight_scale_inv", codes, scale, self.block)


class OnlineFP8(QuantMethod):
    """`--quantization fp8` on an unquantized checkpoint: each decoder layer's matrices (and
    experts) in FP8 with one scale per output row, made as they load."""
    name = "fp8"
    marker = "weight"
    online = True
    # the layers quantized: the attention's and the MLP's matrices (our names, after fusing)
    TARGETS = re.compile(r".*\.(qkv_proj|o_proj|gate_up_proj|down_proj)\.weight")

    def describe(self) -> str:
        return "fp8 (online, per-channel scales)"

    def layout(self, tensors):
        return "fp8", 0

    def layers(self, names):
        return {n[:-len(".weight")]: {"weight"} for n, (shape, _) in names.items()
                if n.endswith(".weight") and len(shape) == 2}

    def read(self, prefix, tensors):
        return quantize_fp8(tensors["weight"])
