"""A PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) read into the layout of
our layers: q/k/v pieces become slices of the fused qkv_proj, gate/up of gate_up_proj. Each
piece keeps its own A [r, in] and B [out, r], with the adapter's scaling (lora_alpha / r, or
lora_alpha / sqrt(r) for rsLoRA) folded into B. Everything that does not fit the base model
or the server's limits is a LoRAError naming it."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn


class LoRAError(ValueError):
    """An adapter that cannot be served: its message says why (a 400 when loaded at run time)."""


# PEFT's module name -> (our projection, slice index; None: the whole fused projection)
_MODULES = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
            "qkv_proj": ("qkv_proj", None), "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", 1), "gate_up_proj": ("gate_up_proj", None), "down_proj": ("down_proj", 0)}
ATTENTION = ("qkv_proj", "o_proj")  # our projections under self_attn; the others are the MLP's
_TENSOR = re.compile(r"(?:.*\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


@dataclass(frozen=True, slots=True)
class Target:
    """A projection adapters may change: its input size and the sizes of its output's slices."""
    in_features: int
    slices: tuple[int, ...]


def lora_targets(model: nn.Module) -> dict[str, Target]:
    """"{layer}.{projection}" -> Target, for every decoder layer's qkv_proj and o_proj and, where
    the layer's feed-forward is a gated MLP (not experts), its gate_up_proj and down_proj."""
    targets = {}
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp  # this rank's shapes under tensor parallelism
        targets[f"{i}.qkv_proj"] = Target(attn.qkv_proj.in_features, (attn.q_size, attn.kv_size, attn.kv_size))
        targets[f"{i}.o_proj"] = Target(attn.o_proj.in_features, (attn.o_proj.out_features,))
        if hasattr(mlp, "gate_up_proj") and hasattr(mlp, "down_proj"):
            inter = mlp.gate_up_proj.out_features // 2
            targets[f"{i}.gate_up_proj"] = Target(mlp.gate_up_proj.in_features, (inter, inter))
            targets[f"{i}.down_proj"] = Target(mlp.down_proj.in_features, (mlp.down_proj.out_features,))
    return targets


@dataclass(slots=True)
class LoRAAdapter:
    name: str
    rank: int
    # "{layer}.{projection}" -> one (A [r, in], B [out, r] scaled) per slice, None where absent
    weights: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for pieces in self.weights.values() for p in pieces if p for a, b in [p])


def read_config(path: Path) -> dict:
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise LoRAError(f"no adapter_config.json in {path}: not a PEFT LoRA adapter directory")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise LoRAError(f"{config_file} cannot be read: {e}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{config_file} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{path} is a {config.get('peft_type')} adapter; only LoRA adapters are served")
    refused = {"modules_to_save": "modules_to_save (whole modules trained beside the adapter)",
               "use_dora": "DoRA (use_dora)", "fan_in_fan_out": "fan_in_fan_out weights",
               "rank_pattern": "per-module ranks (rank_pattern)", "alpha_pattern": "per-module alphas (alpha_pattern)"}
    for key, what in refused.items():
        if config.get(key):
            raise LoRAError(f"{path}: {what} is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"{path}: adapters with trained biases (bias={config['bias']!r}) are not supported")
    return config


def load_adapter(name: str, path: str | Path, targets: dict[str, Target], max_rank: int,
                 shard: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> LoRAAdapter:
    """The adapter in `path`, checked against the base model's `targets` and the rank limit.
    `shard(weight name, tensor)`: this tensor-parallel rank's part of a tensor split like that
    base weight (models/parallel.py): B's rows of a column-parallel projection, A's columns of a
    row-parallel one (o, down), so that the delta is split as the base matmul's output is."""
    path = Path(path)
    if not path.is_dir():
        raise LoRAError(f"LoRA adapter directory {str(path)!r} does not exist")
    config = read_config(path)
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise LoRAError(f"no adapter_model.safetensors in {path} (.bin adapters are not read: they are pickles)")
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)  # PEFT's LoraConfig default
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1 or not isinstance(alpha, (int, float)) \
            or isinstance(alpha, bool):
        raise LoRAError(f"{path}: adapter_config.json needs an integer r >= 1 and a number lora_alpha")
    if rank > max_rank:
        raise LoRAError(f"adapter {name!r} has rank {rank}, above --max-lora-rank {max_rank}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pieces: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_file), framework="pt") as f:
            for key in f.keys():
                m = _TENSOR.fullmatch(key)
                if m is None or m.group(2) not in _MODULES:
                    raise LoRAError(f"adapter {name!r}: tensor {key} is not a LoRA weight of a decoder "
                                    f"layer's {', '.join(_MODULES)}")
                pieces.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = f.get_tensor(key).float()
    except LoRAError:
        raise
    except Exception as e:  # a torn or foreign file
        raise LoRAError(f"{weights_file} cannot be read: {type(e).__name__}: {e}") from None
    if not pieces:
        raise LoRAError(f"adapter {name!r} has no LoRA weights")
    adapter = LoRAAdapter(name, rank)
    for (layer, module), ab in sorted(pieces.items()):
        if shard is not None and set(ab) == {"A", "B"}:
            weight = f"layers.{layer}.{'self_attn' if _MODULES[module][0] in ATTENTION else 'mlp'}.{module}.weight"
            row_parallel = _MODULES[module][0] in ("o_proj", "down_proj")
            ab = {"A": shard(weight, ab["A"]), "B": ab["B"]} if row_parallel else {"A": ab["A"], "B": shard(weight, ab["B"])}
        _place(adapter, name, layer, module, ab, targets, scaling)
    return adapter


def _place(adapter: LoRAAdapter, name: str, layer: int, module: str, ab: dict[str, torch.Tensor],
           targets: dict[str, Target], scaling: float) -> None:
    projection, index = _MODULES[module]
    key = f"{layer}.{projection}"
    target = targets.get(key)
    if target is None:
        raise LoRAError(f"adapter {name!r} changes layers.{layer}.{module}, which the base model does not have "
                        "(another base model?)")
    if set(ab) != {"A", "B"}:
        raise LoRAError(f"adapter {name!r}: layers.{layer}.{module} lacks its lora_{'B' if 'A' in ab else 'A'}")
    a, b = ab["A"], ab["B"]
    out = sum(target.slices) if index is None else target.slices[index]
    if a.shape != (adapter.rank, target.in_features) or b.shape != (out, adapter.rank):
        raise LoRAError(f"adapter {name!r}: layers.{layer}.{module} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                        f"the base model needs A ({adapter.rank}, {target.in_features}) and B ({out}, "
                        f"{adapter.rank}) (another base model?)")
    slots = adapter.weights.setdefault(key, [None] * len(target.slices))
    b = b * scaling
    if index is not None:
        slots[index] = (a, b)
        return
    # a fused projection's adapter: each slice is its rows of B after the one shared A
    for i, rows in enumerate(b.split(list(target.slices))):
        slots[i] = (a, rows.contiguous())
