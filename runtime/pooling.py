"""How an embedding request's last hidden states become one vector: pooled over the prompt (the
mean of its tokens, its last token, or its first), then L2-normalized or not. A checkpoint made
for sentence-transformers says which in its own files (modules.json, 1_Pooling/config.json), as
vLLM reads them; --pooler-config overrides; otherwise the mean, normalized."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

POOLING_TYPES = ("MEAN", "LAST", "CLS")
# sentence-transformers' pooling modes, as its 1_Pooling/config.json names them
_ST_MODES = {"pooling_mode_mean_tokens": "MEAN", "pooling_mode_lasttoken": "LAST", "pooling_mode_cls_token": "CLS"}
_ST_MODULES = ("Transformer", "Pooling", "Normalize")  # what the pooling here reproduces


@dataclasses.dataclass(frozen=True, slots=True)
class PoolerConfig:
    pooling_type: str = "MEAN"
    normalize: bool = True
    # a sentence-transformers module after the pooling that is not applied here (a Dense
    # projection): embeddings are refused rather than served different from the model's own
    unsupported: str | None = None

    def __post_init__(self):
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")


def pooler_config(model_dir: str | Path, override: dict | str | None = None) -> PoolerConfig:
    """The model's pooling: its sentence-transformers files, then `override` (--pooler-config:
    {"pooling_type": "LAST", "normalize": true}, or its JSON) on top."""
    config = _sentence_transformers_config(Path(model_dir))
    if override is None:
        return config
    if isinstance(override, str):
        try:
            override = json.loads(override)
        except ValueError as e:
            raise ValueError(f"--pooler-config is not JSON: {e}") from None
    if not isinstance(override, dict):
        raise ValueError("--pooler-config must be a JSON object")
    unknown = set(override) - {"pooling_type", "normalize"}
    if unknown:
        raise ValueError(f"--pooler-config takes pooling_type and normalize, not {', '.join(sorted(unknown))}")
    if isinstance(override.get("pooling_type"), str):
        override = {**override, "pooling_type": override["pooling_type"].upper()}
    return dataclasses.replace(config, **override)


def _sentence_transformers_config(model_dir: Path) -> PoolerConfig:
    try:
        modules = json.loads((model_dir / "modules.json").read_text())
    except (OSError, ValueError):
        return PoolerConfig()  # not a sentence-transformers checkpoint
    if not isinstance(modules, list):
        raise ValueError(f"{model_dir}/modules.json is not a list of modules")
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    pooling_type, unsupported = "MEAN", None
    if "Pooling" in kinds:
        path = model_dir / str(kinds["Pooling"].get("path", "1_Pooling")) / "config.json"
        try:
            st = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{path} cannot be read: {e}") from None
        modes = [mode for key, mode in _ST_MODES.items() if st.get(key)]
        others = [k for k, v in st.items() if k.startswith("pooling_mode_") and v and k not in _ST_MODES]
        if others or len(modes) != 1:
            unsupported = f"the pooling {', '.join(others) or 'of several modes'} ({path})"
        else:
            pooling_type = modes[0]
    extra = [name for name in kinds if name not in _ST_MODULES]
    if extra:
        unsupported = f"the sentence-transformers module {extra[0]} ({model_dir}/modules.json)"
    return PoolerConfig(pooling_type, "Normalize" in kinds, unsupported)


def chunk_part(rows: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """What one step's rows of a request (its prompt's next tokens) give its pooling."""
    if pooling_type == "MEAN":
        return rows.float().sum(dim=0)
    return (rows[-1] if pooling_type == "LAST" else rows[0]).float()


def combine(pooled: torch.Tensor | None, part: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """The request's pooling so far with a step's part (its steps come in prompt order)."""
    if pooled is None:
        return part
    if pooling_type == "MEAN":
        return pooled + part
    return part if pooling_type == "LAST" else pooled


def embedding(pooled: torch.Tensor, num_tokens: int, config: PoolerConfig) -> list[float]:
    vector = pooled / num_tokens if config.pooling_type == "MEAN" else pooled
    if config.normalize:
        vector = vector / vector.norm().clamp_min(1e-12)
    return vector.tolist()
