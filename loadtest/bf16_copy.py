"""A bfloat16 copy of a model directory (by default: the default model, converted from its
GGUF file), for measuring the engine on the weights most checkpoints ship in.

The default model's file holds Q4_1 blocks, which the CPU path reads as they are (97 MB a decode
step); a bfloat16 checkpoint of the same model is read as bfloat16 (269 MB a step). The copy
rounds each weight to the nearest bfloat16 value, so its tokens may differ from the GGUF's; it
is a model of the same shapes and bytes, for timing.

    python -m pageserve.loadtest.bf16_copy /tmp/smollm2-bf16
    pageserve bench offline --model /tmp/smollm2-bf16 --skip-hf
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from pageserve.runtime.models.gguf_file import dense_copy
from pageserve.runtime.models.loader import GGUF_SOURCE, resolve_model


def copy_model_files(src: Path, out: Path) -> None:
    """`src`'s config, generation config and tokenizer files into `out` (made if missing):
    nothing that names a GGUF source or indexes its weights."""
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if (f.is_file() and f.suffix in (".json", ".jinja", ".txt", ".model")
                and f.name not in (GGUF_SOURCE, "model.safetensors.index.json")):
            shutil.copy2(f, out / f.name)


def set_dtype(model_dir: Path, dtype: str) -> None:
    """config.json's dtype (both the transformers 4 and 5 keys) set to `dtype`."""
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["torch_dtype"] = cfg["dtype"] = dtype
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=1))


def bf16_copy(src: Path, out: Path) -> Path:
    """Every floating-point tensor of `src`'s safetensors in bfloat16 under `out`, with its
    config (dtype bfloat16) and tokenizer files; nothing that names a GGUF source."""
    from safetensors.torch import load_file, save_file

    src = dense_copy(src)
    copy_model_files(src, out)
    index = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors = load_file(f)
        save_file({k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()},
                  out / f.name, metadata={"format": "pt"})
        index.update({k: f.name for k in tensors})
    if (src / "model.safetensors.index.json").is_file():
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))
    set_dtype(out, "bfloat16")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="directory to write")
    p.add_argument("--model", default=None, help="model directory or .gguf (default: the default model)")
    args = p.parse_args()
    print(bf16_copy(resolve_model(args.model), args.out))


if __name__ == "__main__":
    main()
