"""A checkpoint's KV-cache scales: compressed-tensors' `kv_cache_scheme` (float8, per tensor or per
KV head, as llm-compressor writes them), one `k_scale` and `v_scale` tensor per attention layer;
also the older layouts vLLM reads, with AutoFP8's `"kv_cache_scheme": "static"`:
`k_proj.output_scale` / `v_proj.output_scale` (AutoFP8, older compressed-tensors),
`k_proj.k_scale` / `v_proj.v_scale` (ModelOpt's names) and one `kv_scale` for both (deprecated);
without a scheme, the scales a checkpoint holds are taken for the layers that have them. Under a
float8 cache (`--kv-cache-dtype fp8`) the cache keeps K / k_scale and V / v_scale, read back
times the scales, as vLLM reads them; under any other cache the values are kept unscaled and the
scales go unused, as in vLLM. A `q_scale` (the query quantized for FP8 attention) is read and
dropped: the query is not quantized here."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch
from torch import nn

from pageserve.runtime.quantization.methods import kv_cache_scheme

logger = logging.getLogger(__name__)

# (attention prefix, part): a projection's scale first, as "self_attn.k_proj.k_scale" would
# also read as the attention-level name of a module "self_attn.k_proj"
_PROJ_SCALE = re.compile(r"(.+)\.([kvq])_proj\.(?:output_scale|[kvq]_scale)")
_ATTN_SCALE = re.compile(r"(.+)\.(kv|[kvq])_scale")


def scale_name(name: str) -> tuple[str, str] | None:
    """(attention prefix, "k", "v", "q" or "kv" for both) of a KV-cache scale tensor's name in
    any of the layouts above; None for another tensor."""
    m = _PROJ_SCALE.fullmatch(name) or _ATTN_SCALE.fullmatch(name)
    return None if m is None else (m.group(1), m.group(2))


@dataclass(frozen=True)
class AttentionScales:
    """What one attention layer multiplies by, in this rank's heads: the query [H, 1] and the
    output [H, 1] by their KV head's k_scale and v_scale, the new K and V [Hkv, 1] by their
    reciprocals. The cache keeps K' = K / k_scale, read as q . (K' k_scale), which is
    (q k_scale) . K': the kernels need not know. The divisors are float32, so that K / k_scale
    is rounded once, to float8, whatever the activations' dtype (as vLLM divides)."""
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    output: torch.Tensor

    @classmethod
    def of(cls, k_scale: torch.Tensor, v_scale: torch.Tensor, group: int, dtype: torch.dtype) -> "AttentionScales":
        k, v = k_scale[:, None], v_scale[:, None]
        return cls(k.repeat_interleave(group, 0).to(dtype), k, v, v.repeat_interleave(group, 0).to(dtype))


class KVScales:
    """The scale tensors of one checkpoint for one model: taken out of the stream of weights,
    then given to the attention layers (`apply`)."""

    def __init__(self, model: nn.Module, scheme: dict | None):
        self.model, self.scheme = model, scheme  # None: scales taken where the checkpoint has them
        self.found: dict[str, dict[str, torch.Tensor]] = {}  # our attention module -> "k"/"v" -> scale

    @classmethod
    def for_checkpoint(cls, hf_config: dict, model: nn.Module) -> "KVScales":
        """The checkpoint's kv_cache_scheme (a vision-language model's is in its whole config,
        beside the text part the model reads): every attention layer must have its scales.
        Without one, the scales some checkpoints carry anyway (a `kv_scale` a layer, as vLLM's
        and TGI's tools write them) are taken where they are."""
        whole = hf_config.get("_multimodal") or hf_config
        qcfg = whole.get("quantization_config") or whole.get("compression_config")
        return cls(model, kv_cache_scheme(qcfg))

    def stream(self, weights):
        """The checkpoint's (name, tensor) pairs without the scales, which are kept."""
        for name, tensor in weights:
            scale = scale_name(name)
            module = None if scale is None else self._attention(scale[0])
            if module is None:
                yield name, tensor
                continue
            if scale[1] != "q" and module:  # "": another pipeline stage's layer
                for part in scale[1]:
                    self.found.setdefault(module, {})[part] = tensor.detach().to(torch.float32).reshape(-1)

    def _attention(self, prefix: str) -> str | None:
        """Our attention module under the checkpoint's prefix (its q/k/v projections'), "" for
        another pipeline stage's, None where the prefix names no attention of ours."""
        name = prefix + ".k_proj.weight"
        target = self.model.checkpoint_target(name)
        if target is None or not target.endswith(".qkv_proj.weight"):
            return None
        return target.removesuffix(".qkv_proj.weight") if self.model.checkpoint_held(name) else ""

    def apply(self, cache_dtype: torch.dtype) -> None:
        """Each attention layer's scales where the cache holds float8; checks that every layer
        of this stage (without a kv_cache_scheme: every layer with a scale) has both, of one
        value or one a KV head, finite and positive."""
        cfg = self.model.cfg
        layers = [n for n, m in self.model.named_modules() if hasattr(m, "kv_scales")]
        if self.scheme is None:
            if not self.found:
                return
            layers = [n for n in layers if n in self.found]
        strategy = "the checkpoint's layout" if self.scheme is None else self.scheme.get("strategy", "tensor")
        if cache_dtype != torch.float8_e4m3fn:
            logger.info("the checkpoint's float8 KV-cache scales (by %s) are not used: the KV cache holds %s "
                        "(--kv-cache-dtype fp8 uses them)", strategy, str(cache_dtype).removeprefix("torch."))
            return
        first, count = cfg.tp_rank * cfg.num_kv_heads // cfg.tp_size, cfg.kv_heads_per_rank
        for name in layers:
            found = self.found.get(name, {})
            if set(found) != {"k", "v"}:
                has = "KV-cache scales" if self.scheme is None else "a kv_cache_scheme"
                raise ValueError(f"the checkpoint has {has} but no "
                                 f"{' or '.join(p + '_scale' for p in 'kv' if p not in found)} for {name}")
            per_head = []
            for part in "kv":
                s = found[part]
                if s.numel() not in (1, cfg.num_kv_heads) or not bool(torch.isfinite(s).all() and (s > 0).all()):
                    raise ValueError(f"{name}.{part}_scale: {s.numel()} values, expected 1 or "
                                     f"{cfg.num_kv_heads} (one a KV head), each finite and positive")
                per_head.append(s.expand(cfg.num_kv_heads)[first:first + count].contiguous())
            module = self.model.get_submodule(name)
            module.kv_scales = AttentionScales.of(*per_head, module.num_heads // module.num_kv_heads, cfg.dtype)
        logger.info("float8 KV cache with the checkpoint's scales (by %s) in %d layers", strategy, len(layers))
