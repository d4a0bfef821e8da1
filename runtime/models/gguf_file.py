"""A GGUF file's tensors under Hugging Face's names, read one at a time, so that a model loads
from the file with no float32 copy of the whole model anywhere (on disk or in memory):

- dense: a tensor dequantized to float32 by gguf's own dequantizer and put into HF's layout by
  transformers' tensor processor for the architecture (Llama's q/k row order, Gemma's norms,
  stacked MoE experts), as transformers' own GGUF loader does, tensor by tensor;
- blocks: a 2-D tensor as blocks the C linear reads (Q8_0, Q4_0, Q4_1 and F16 as the file
  holds them; Q4_K, Q5_K, Q6_K repacked 32 values a block, weight_formats.py; Q5_0, Q5_1, Q2_K,
  Q3_K and the IQ and TQ types repacked into k3, l4, k6, k5 or x8, gguf_repack.py), rows in HF's
  order, where the processor only reorders rows.

Which HF name each GGUF tensor has comes from transformers' own map over HF's model built on
the meta device; the file's header is parsed here (gguf's reader also builds every metadata
field: 4 s for a 49k-token vocabulary)."""

from __future__ import annotations

import math
import re
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pageserve.runtime.models.loader import (GGUF_SOURCE, cache_root, gguf_parsed_once, gguf_source, publish,
                                             read_config)
from pageserve.runtime.models.gguf_repack import REPACKED, repack
from pageserve.runtime.models.weight_formats import GGUF_BLOCKS, GGUF_KQUANTS, as_x8
from pageserve.triton_kernels.cpu_kernels import BLOCK_FORMATS

# GGUF metadata value types: fixed sizes; 8 is a string, 9 an array
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


@dataclass(frozen=True)
class Entry:
    """One tensor of the file: its GGUF name, numpy shape (experts, rows, columns), GGML type,
    and where its bytes lie."""
    name: str
    shape: tuple[int, ...]
    qtype: int
    start: int
    nbytes: int

    def block_format(self) -> str | None:
        """The C linear's format this matrix (2-D) or these experts' matrices (3-D) are kept in,
        or None (dequantized)."""
        if len(self.shape) not in (2, 3):
            return None
        columns = self.shape[-1]
        if self.qtype in GGUF_KQUANTS:
            return GGUF_KQUANTS[self.qtype][0] if columns % 256 == 0 else None
        if self.qtype in REPACKED:
            return REPACKED[self.qtype][2] if columns % REPACKED[self.qtype][0] == 0 else None
        fmt = GGUF_BLOCKS.get(self.qtype)
        return fmt if fmt is not None and columns % 32 == 0 else None


def read_tensor(path: Path, e: Entry) -> np.ndarray:
    """A tensor's bytes, [..., bytes a row] uint8, read rather than mapped: a mapped file's
    pages count as the process's own memory for as long as they stay mapped."""
    return np.fromfile(path, dtype=np.uint8, count=e.nbytes, offset=e.start).reshape(*e.shape[:-1], -1)


def kept_blocks(raw: np.ndarray, e: Entry) -> np.ndarray:
    """A tensor of block_format, its bytes `raw`, as the C linear's rows: as the file holds
    them, or repacked (K-quants; the other types: gguf_repack.py)."""
    if e.qtype in REPACKED:
        return repack(raw, e.qtype)
    return GGUF_KQUANTS[e.qtype][2](raw) if e.qtype in GGUF_KQUANTS else raw


def _skip(buf: memoryview, kind: int, at: int) -> int:
    """The offset after a metadata value of type `kind` at `at`."""
    if kind == 8:
        return at + 8 + struct.unpack_from("<Q", buf, at)[0]
    if kind == 9:
        item, count = struct.unpack_from("<IQ", buf, at)
        at += 12
        if item in _SIZES:
            return at + count * _SIZES[item]
        for _ in range(count):
            at = _skip(buf, item, at)
        return at
    return at + _SIZES[kind]


def read_header(path: Path) -> tuple[str, list[Entry]]:
    """(general.architecture, the file's tensors); ValueError for a file it cannot parse."""
    return read_metadata(path)[:2]


def read_metadata(path: Path) -> tuple[str, list[Entry], dict[str, int | float]]:
    """read_header's, and the file's numeric metadata values (key -> value)."""
    try:
        return _parse_header(path)
    except (struct.error, KeyError, IndexError, UnicodeDecodeError, OverflowError, ZeroDivisionError) as e:
        raise ValueError(f"{path}: a damaged GGUF header ({type(e).__name__}: {e})") from None


_NUMBERS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q", 6: "<f", 12: "<d"}


def _parse_header(path: Path) -> tuple[str, list[Entry], dict[str, int | float]]:
    import gguf

    data = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(data)
    u32 = lambda at: struct.unpack_from("<I", buf, at)[0]  # noqa: E731
    u64 = lambda at: struct.unpack_from("<Q", buf, at)[0]  # noqa: E731
    if bytes(buf[:4]) != b"GGUF" or u32(4) < 2:
        raise ValueError(f"{path}: not a GGUF file of version 2 or later")
    n_tensors, n_kv, at, alignment, arch, numbers = u64(8), u64(16), 24, 32, "", {}
    for _ in range(n_kv):
        key = bytes(buf[at + 8:at + 8 + u64(at)]).decode()
        at += 8 + u64(at)
        kind, at = u32(at), at + 4
        if key == "general.alignment":
            alignment = u32(at)
        elif key == "general.architecture" and kind == 8:
            arch = bytes(buf[at + 8:at + 8 + u64(at)]).decode()
        elif kind in _NUMBERS:
            numbers[key] = struct.unpack_from(_NUMBERS[kind], buf, at)[0]
        at = _skip(buf, kind, at)
    infos = []
    for _ in range(n_tensors):
        name = bytes(buf[at + 8:at + 8 + u64(at)]).decode()
        at += 8 + u64(at)
        n_dims, at = u32(at), at + 4
        dims = [u64(at + 8 * i) for i in range(n_dims)]
        at += 8 * n_dims
        infos.append((name, dims, u32(at), u64(at + 4)))
        at += 12
    start = -(-at // alignment) * alignment
    entries = []
    for name, dims, qtype, offset in infos:
        try:
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
        except (ValueError, KeyError):
            raise ValueError(f"{path}: tensor {name} has GGML type {qtype}, which gguf does not know") from None
        nbytes = math.prod(dims) // block * size
        if start + offset + nbytes > len(data):
            raise ValueError(f"{path}: tensor {name} runs past the end of the file")
        entries.append(Entry(name, tuple(reversed(dims)), qtype, start + offset, nbytes))
    return arch, entries, numbers


class GGUFFile:
    """The tensors of one GGUF file, by HF name, for the model its converted directory's
    `config` (config.json, as read) describes."""

    def __init__(self, path: Path, config: dict):
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                              get_gguf_hf_weights_map)

        self.path = path
        arch, entries = read_header(path)
        hf_cfg = AutoConfig.for_model(**{k: v for k, v in config.items() if not k.startswith("_")})
        mixtral = hf_cfg.model_type == "mixtral"  # (transformers reads no Mixtral GGUF: its names are ours)
        self.processor = (mixtral_processor() if mixtral else TENSOR_PROCESSORS.get(arch, TensorProcessor))(
            config=hf_cfg.to_dict())
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(hf_cfg)
        # GGUF name -> HF name (stacked experts are named without ".weight" on both sides)
        with gguf_parsed_once():
            self.hf_names = get_gguf_hf_weights_map(hf, self.processor, model_type=arch if mixtral else None)
        self.entries = [e for e in entries if self._hf(e.name)]
        # HF tensors made of several GGUF ones (an MoE's gate and up experts): how many
        self._parts: dict[str, int] = {}
        for e in self.entries:
            self._parts[self._hf(e.name)] = self._parts.get(self._hf(e.name), 0) + 1

    def _hf(self, name: str) -> str | None:
        return self.hf_names.get(name) or self.hf_names.get(name.removesuffix(".weight"))

    def _expert_names(self, e: Entry) -> list[str] | None:
        """The HF name of each expert's matrix in a stacked experts tensor (None: not one)."""
        name = self._hf(e.name)
        stacked = re.search(r"ffn_(gate|up|down)_exps", e.name)
        if len(e.shape) != 3 or not stacked or not name.endswith(STACKED):
            return None
        prefix = name.rpartition(".experts.")[0]
        return [f"{prefix}.experts.{i}.{stacked.group(1)}_proj.weight" for i in range(e.shape[0])]

    def checkpoint_names(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """HF name -> (shape, dtype name) of each tensor `stream` gives (stacked experts by
        expert), as quantization.load.checkpoint_names gives a safetensors directory's."""
        out = {}
        for e in self.entries:
            if (experts := self._expert_names(e)) is not None:
                out.update(dict.fromkeys(experts, (e.shape[1:], "F32")))
            elif self._parts[self._hf(e.name)] == 1:
                out[self._hf(e.name)] = (e.shape, "F32")
        return out

    def block_formats(self) -> dict[str, tuple[str, int, int]]:
        """HF name -> (block format, rows, columns) of each matrix whose blocks can be kept
        (`blocks`), experts by expert."""
        out = {}
        for e in self.entries:
            if e.block_format() is None:
                continue
            if (experts := self._expert_names(e)) is not None:
                if self._experts_in_place(e, experts):
                    out.update(dict.fromkeys(experts, (e.block_format(), *e.shape[1:])))
            elif len(e.shape) == 2 and self._parts[self._hf(e.name)] == 1 and self._row_order(e) is not None:
                out[self._hf(e.name)] = (e.block_format(), *e.shape)
        return out

    def _experts_in_place(self, e: Entry, experts: list[str]) -> bool:
        """Whether the processor gives each expert's matrix the file's rows in the file's order
        (stacking gate and up into one tensor, as stream() then splits it): a probe of row
        numbers through both."""
        probe = np.arange(e.shape[0] * e.shape[1], dtype=np.float64).reshape(e.shape[0], e.shape[1], 1)
        parsed: dict[str, dict] = {"tensors": {}}
        out = self.processor.process(weights=probe, name=e.name, tensor_key_mapping=self.hf_names,
                                     parsed_parameters=parsed)
        hf_name = self._hf(e.name)
        stacked = parsed["tensors"].get(hf_name) if out.name is None else out.weights
        if stacked is None:
            return False
        got = dict(per_expert(self._hf(out.name or e.name) or hf_name, torch.as_tensor(np.asarray(stacked))))
        return all(name in got and np.array_equal(np.asarray(got[name]), probe[i]) for i, name in enumerate(experts))

    def _row_order(self, e: Entry) -> np.ndarray | None:
        """The file's row of each HF row, where the processor does no more than reorder rows
        (None where it does)."""
        rows = e.shape[0]
        probe = self.processor.process(weights=np.arange(rows, dtype=np.float64)[:, None], name=e.name)
        order = np.asarray(probe.weights).ravel()
        if probe.name != e.name or order.shape != (rows,) or not np.array_equal(np.sort(order), np.arange(rows)):
            return None
        return order.astype(np.int64)

    def blocks(self, e: Entry, fmt: str | None = None) -> torch.Tensor:
        """A matrix of block_formats as uint8 rows of the C linear's blocks, in HF's row order:
        its own format's, or `fmt`'s (x8)."""
        order = self._row_order(e)
        if order is None or e.block_format() is None or len(e.shape) != 2:
            raise ValueError(f"{e.name}: its blocks cannot be kept")
        raw = kept_blocks(read_tensor(self.path, e), e)
        if not np.array_equal(order, np.arange(len(order))):  # (Llama's q and k) a copy only where reordered
            raw = raw[order]
        return self._as(raw, e, fmt)

    @staticmethod
    def _as(raw: np.ndarray, e: Entry, fmt: str | None) -> torch.Tensor:
        """Rows of e's blocks as the C linear reads them, in its own format or `fmt`'s (x8)."""
        own = e.block_format()
        if fmt not in (None, own):
            raw = as_x8(raw, own)
        assert raw.shape[1] == e.shape[-1] // 32 * BLOCK_FORMATS[fmt or own][1]
        return torch.from_numpy(np.ascontiguousarray(raw))

    def stream(self, as_blocks: dict[str, str] | None = None):
        """(HF name, tensor) of every tensor the model takes: uint8 blocks for the names in
        `as_blocks` (of block_formats; -> the format to load each in), float32 for the rest."""
        import gguf
        from gguf.quants import dequantize

        as_blocks = as_blocks or {}
        parsed: dict[str, dict] = {"tensors": {}}  # where a processor stacks MoE experts
        seen: dict[str, int] = {}
        for e in self.entries:
            hf_name = self._hf(e.name)
            if hf_name in as_blocks:
                yield hf_name, self.blocks(e, as_blocks[hf_name])
                continue
            experts = self._expert_names(e)
            if experts and experts[0] in as_blocks:  # (the plan keeps all of a stack or none)
                stack = read_tensor(self.path, e)
                for i, name in enumerate(experts):
                    yield name, self._as(kept_blocks(stack[i], e), e, as_blocks[name])
                continue
            try:
                values = dequantize(read_tensor(self.path, e), gguf.GGMLQuantizationType(e.qtype)).reshape(e.shape)
            except NotImplementedError:
                raise ValueError(f"{e.name}: gguf cannot dequantize its type "
                                 f"{gguf.GGMLQuantizationType(e.qtype).name}") from None
            out = self.processor.process(weights=values, name=e.name, tensor_key_mapping=self.hf_names,
                                         parsed_parameters=parsed)
            if out.name is not None:
                tensor = torch.from_numpy(np.ascontiguousarray(out.weights))
                yield from per_expert(self._hf(out.name) or hf_name, tensor)
                continue
            seen[hf_name] = seen.get(hf_name, 0) + 1  # written into parsed: whole once all its parts are
            if seen[hf_name] == self._parts[hf_name]:
                yield from per_expert(hf_name, parsed["tensors"].pop(hf_name))


def mixtral_processor():
    """transformers' tensor processor for a Mixtral GGUF, which it has none of: Llama's (q and k
    rows put back in HF's order) for attention, Qwen2-MoE's for the stacked experts (gate and up
    stacked into `experts.gate_up_proj`), the two layouts being the same."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, Qwen2MoeTensorProcessor

    class MixtralTensorProcessor(Qwen2MoeTensorProcessor):
        def process(self, weights, name, **kwargs):
            if ".attn_q." in name or ".attn_k." in name:
                return LlamaTensorProcessor(config=self.config).process(weights, name, **kwargs)
            return super().process(weights, name, **kwargs)
    return MixtralTensorProcessor


# transformers 5's names of stacked experts tensors
STACKED = ("experts.gate_up_proj", "experts.down_proj")


def per_expert(name: str, tensor: torch.Tensor):
    """A stacked experts tensor of transformers 5 (`experts.gate_up_proj` [E, 2I, H], gate rows
    first; `experts.down_proj` [E, H, I]) as the per-expert tensors our models take."""
    prefix, _, last = name.rpartition(".experts.")
    if not prefix or not name.endswith(STACKED) or tensor.dim() != 3:
        yield name, tensor
        return
    for e, w in enumerate(tensor):
        if last == "down_proj":
            yield f"{prefix}.experts.{e}.down_proj.weight", w
        else:
            gate, up = w.chunk(2)
            yield f"{prefix}.experts.{e}.gate_proj.weight", gate
            yield f"{prefix}.experts.{e}.up_proj.weight", up


# our names of a Mixtral's experts and router -> its checkpoints' (MixtralForCausalLM.rename's inverse)
_MIXTRAL_NAMES = ((r"\.mlp\.experts\.(\d+)\.gate_proj\.", r".block_sparse_moe.experts.\1.w1."),
                  (r"\.mlp\.experts\.(\d+)\.up_proj\.", r".block_sparse_moe.experts.\1.w3."),
                  (r"\.mlp\.experts\.(\d+)\.down_proj\.", r".block_sparse_moe.experts.\1.w2."),
                  (r"\.mlp\.gate\.weight$", r".block_sparse_moe.gate.weight"))


def dense_copy(model_dir: Path) -> Path:
    """A model directory whose weights are safetensors: `model_dir` itself, or for a GGUF
    file's directory a float32 copy of its weights (with its config and tokenizer) written once
    under the cache, for the tools that read a checkpoint's tensors (loadtest's copies)."""
    source = gguf_source(model_dir)
    if source is None or any(model_dir.glob("*.safetensors")):  # (a cache of an earlier version holds them)
        return model_dir
    from safetensors.torch import save_file

    out = cache_root() / "gguf-float32" / model_dir.name
    config = read_config(model_dir)
    if (out / "model.safetensors").is_file():
        if read_config(out).get("model_type") == config.get("model_type"):
            return out
        shutil.rmtree(out)  # an earlier version's copy of a Mixtral file: a Llama without its experts
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        for f in model_dir.iterdir():
            if f.is_file() and f.name != GGUF_SOURCE:
                shutil.copy2(f, tmp / f.name)
        names = _MIXTRAL_NAMES if config.get("model_type") == "mixtral" else ()
        tensors = {}
        for name, t in GGUFFile(source, config).stream():
            for pattern, repl in names:  # transformers reads a Mixtral checkpoint's experts by these names only
                name = re.sub(pattern, repl, name)
            tensors[name] = t.contiguous()
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        publish(tmp, out, "model.safetensors")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
