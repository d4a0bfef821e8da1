"""A copy of a model directory with some of its decoder layers (by default: the default model,
converted from its GGUF file): a draft model with the model's own tokenizer, embedding and
head, for speculative decoding's draft_model method where no smaller model of the family is at
hand. `--layers 6` keeps the first six; `--layers 0-3,26-29` the first and last four (a
layer-skipping draft: the last layers are the ones that map to the head's space). A model read
from a GGUF file is copied as a GGUF file (`<out>/model.gguf`), its tensors as the file holds
them, so that the CPU path keeps its layers in the file's blocks.

    python -m pageserve.loadtest.truncated_copy /tmp/smollm2-draft --layers 0-3,26-29
    pageserve serve --speculative-config '{"model": "/tmp/smollm2-draft/model.gguf", "num_speculative_tokens": 4}'
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np

from pageserve.loadtest.bf16_copy import copy_model_files
from pageserve.runtime.models.loader import gguf_source, resolve_model

_LAYER = re.compile(r"\.layers\.(\d+)\.")
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


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
    from 0 in order, under `out`; returns the model to load (`out`, or the GGUF file in it)."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((src / "config.json").read_text())
    total = cfg["num_hidden_layers"]
    keep = sorted(set(range(layers) if isinstance(layers, int) else layers))
    if not keep or keep[0] < 0 or keep[-1] >= total:
        raise ValueError(f"layers must be in 0..{total - 1}, got {layers}")
    if (source := gguf_source(src)) is not None:
        out.mkdir(parents=True, exist_ok=True)
        return truncated_gguf(source, out / "model.gguf", keep)
    new_index = {old: new for new, old in enumerate(keep)}
    copy_model_files(src, out)
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


def truncated_gguf(source: Path, out: Path, keep: list[int]) -> Path:
    """The GGUF file `source` with the decoder layers `keep` only, renumbered, written to `out`;
    metadata as it was (block_count, and per-layer lists, cut)."""
    import gguf

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    total = reader.fields[f"{arch}.block_count"].contents()
    w = gguf.GGUFWriter(str(out), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == "general.alignment":  # the writer pads to it only when told so
            w.add_custom_alignment(field.contents())
            continue
        value = len(keep) if name == f"{arch}.block_count" else field.contents()
        if isinstance(value, list) and len(value) == total:
            value = [value[i] for i in keep]
        array = field.types[0] == gguf.GGUFValueType.ARRAY
        w.add_key_value(name, value, field.types[0], sub_type=field.types[-1] if array else None)
    new_index = {old: new for new, old in enumerate(keep)}
    for t in reader.tensors:
        name = t.name
        if m := _BLOCK.match(name):
            if int(m.group(1)) not in new_index:
                continue
            name = f"blk.{new_index[int(m.group(1))]}.{m.group(2)}"
        w.add_tensor(name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
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
