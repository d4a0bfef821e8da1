"""A copy of a model directory with some of its decoder layers (by default: the default model,
converted from its GGUF file): a draft model with the model's own tokenizer, embedding and
head, for speculative decoding's draft_model method where no smaller model of the family is at
hand. `--layers 6` keeps the first six; `--layers 0-3,26-29` the first and last four (a
layer-skipping draft: the last layers are the ones that map to the head's space). The copy
names the same GGUF source, so the CPU path keeps its layers in the file's blocks.

    python -m pageserve.loadtest.truncated_copy /tmp/smollm2-draft --layers 0-3,26-29
    pageserve serve --speculative-config '{"model": "/tmp/smollm2-draft", "num_speculative_tokens": 4}'
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from pageserve.loadtest.bf16_copy import copy_model_files
from pageserve.runtime.models.loader import GGUF_SOURCE, resolve_model

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def parse_layers(spec: str) -> list[int]:
    """"6" -> the first six layers; "0-3,26-29" -> those layers."""
    if spec.isdigit():
        return list(range(int(spec)))
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def truncated_copy(src: Path, out: Path, layers: int | list[int]) -> Path:
    """`src` with the decoder layers `layers` only (an int: the first that many), renumbered
    from 0 in order, under `out`."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((src / "config.json").read_text())
    total = cfg["num_hidden_layers"]
    keep = sorted(set(range(layers) if isinstance(layers, int) else layers))
    if not keep or keep[0] < 0 or keep[-1] >= total:
        raise ValueError(f"layers must be in 0..{total - 1}, got {layers}")
    new_index = {old: new for new, old in enumerate(keep)}
    copy_model_files(src, out)
    if (src / GGUF_SOURCE).exists():
        shutil.copy2(src / GGUF_SOURCE, out / GGUF_SOURCE)
    for key, value in list(cfg.items()):  # per-layer lists (layer_types, ...) cut as the layers are
        if isinstance(value, list) and len(value) == total:
            cfg[key] = [value[i] for i in keep]
    cfg["num_hidden_layers"] = len(keep)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    kept = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(f).items():
            m = _LAYER.search(name)
            if m is None:
                kept[name] = tensor
            elif int(m.group(1)) in new_index:
                kept[name[:m.start()] + f".layers.{new_index[int(m.group(1))]}." + name[m.end():]] = tensor
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--model", default=None, help="a model directory, GGUF file or hub id (default: the default model)")
    p.add_argument("--layers", default="6", help='"6": the first six layers; "0-3,26-29": those')
    args = p.parse_args()
    print(truncated_copy(resolve_model(args.model), args.out, parse_layers(args.layers)))


if __name__ == "__main__":
    main()
