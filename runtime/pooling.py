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
    # Matryoshka: a request may ask for the first `dimensions` values only (those listed, where
    # the model lists them), as config.json's is_matryoshka and matryoshka_dimensions say
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
        dims = self.matryoshka_dimensions
        if dims is not None and (not isinstance(dims, tuple) or not dims
                                 or any(not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in dims)):
            raise ValueError(f"matryoshka_dimensions must be a list of positive integers, got {dims!r}")

    def dimensions_error(self, dimensions: int, size: int) -> str | None:
        """Why a request may not ask for `dimensions` values of embeddings of `size` (None: it may)."""
        if not self.matryoshka:
            return ("the model does not say it was trained for Matryoshka embeddings (is_matryoshka or "
                    "matryoshka_dimensions in its config.json, or --hf-overrides): its first values alone would "
                    "embed poorly")
        if self.matryoshka_dimensions is not None and dimensions not in self.matryoshka_dimensions:
            return f"the model takes dimensions {', '.join(map(str, self.matryoshka_dimensions))} only"
        if dimensions > size:
            return f"the model's embeddings have {size} values, fewer than {dimensions}"
        return None

    def shorten(self, vector: list[float], dimensions: int) -> list[float]:
        """A Matryoshka embedding's first `dimensions` values, normalized again where the pooling
        normalizes (the same as normalizing only the shortened one)."""
        short = torch.tensor(vector[:dimensions], dtype=torch.float32)
        if self.normalize:
            short = short / short.norm().clamp_min(1e-12)
        return short.tolist()


def pooler_config(model_dir: str | Path, override: dict | str | None = None, hf: dict | None = None) -> PoolerConfig:
    """The model's pooling: its sentence-transformers files and `hf` (config.json, for
    Matryoshka), then `override` (--pooler-config: {"pooling_type": "LAST", "normalize": true},
    or its JSON) on top."""
    config = _sentence_transformers_config(Path(model_dir))
    hf = hf or {}
    dims = hf.get("matryoshka_dimensions")
    config = dataclasses.replace(config, matryoshka=bool(hf.get("is_matryoshka")) or dims is not None,
                                 matryoshka_dimensions=tuple(dims) if isinstance(dims, list) else dims)
    if override is None:
        return config
    override = _json_object(override, "--pooler-config", ("pooling_type", "normalize"))
    if isinstance(override.get("pooling_type"), str):
        override = {**override, "pooling_type": override["pooling_type"].upper()}
    return dataclasses.replace(config, **override)


# what --hf-overrides may set of config.json here (the rest is read as it is)
HF_OVERRIDES = ("is_matryoshka", "matryoshka_dimensions")


def apply_hf_overrides(hf: dict, overrides: dict | str | None) -> dict:
    """config.json with --hf-overrides on top (a JSON object), as vLLM's, for the keys in
    HF_OVERRIDES (Qwen3-Embedding's Matryoshka: {"is_matryoshka": true})."""
    if overrides is None:
        return hf
    values = _json_object(overrides, "--hf-overrides", HF_OVERRIDES, "; the rest of config.json is read as it is")
    if not isinstance(values.get("is_matryoshka", False), bool):
        raise ValueError(f"--hf-overrides: is_matryoshka must be true or false, got {values['is_matryoshka']!r}")
    dims = values.get("matryoshka_dimensions")
    if dims is not None:  # checked as the pooler will take it
        PoolerConfig(matryoshka_dimensions=tuple(dims) if isinstance(dims, list) else dims)
    return {**hf, **values}


def _json_object(value: dict | str, flag: str, keys: tuple[str, ...], why: str = "") -> dict:
    """A flag's JSON object (or the dict itself), of `keys` only."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{flag} is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object")
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise ValueError(f"{flag} takes {' and '.join(keys)}, not {', '.join(unknown)}{why}")
    return value


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
