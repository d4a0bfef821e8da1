"""Quantized weights: which method a checkpoint uses (its config.json's `quantization_config`, or
`--quantization`), how its tensors become QuantTensors (methods.py and the formats' own modules,
qtensor.py), and how those
are stored for the device's kernels (load.py)."""

from __future__ import annotations

from pageserve.runtime.quantization.bitsandbytes import BitsAndBytes
from pageserve.runtime.quantization.compressed_tensors import CompressedTensors
from pageserve.runtime.quantization.methods import (AWQ, GPTQ, FP8Checkpoint, OnlineFP8, QuantMethod,
                                                    UnsupportedQuantization)
from pageserve.runtime.quantization.modelopt import ModelOpt
from pageserve.runtime.quantization.qtensor import QuantTensor

# quant_method of a checkpoint -> its reader
CHECKPOINT_METHODS = {"compressed-tensors": CompressedTensors, "awq": AWQ, "gptq": GPTQ, "fp8": FP8Checkpoint,
                      "modelopt": ModelOpt, "bitsandbytes": BitsAndBytes}
# what --quantization takes: a checkpoint's own method by name, or fp8 made at load time
CHOICES = ("compressed-tensors", "awq", "gptq", "fp8", "modelopt", "bitsandbytes")
# vLLM's name for ModelOpt's NVFP4 checkpoints: one reader here
_ALIASES = {"modelopt_fp4": "modelopt"}
# names vLLM users may type, and why they are not served here
_REFUSED = {
    "awq_marlin": "Marlin kernels are not part of pageserve; an AWQ GEMM checkpoint loads with --quantization awq",
    "gptq_marlin": "Marlin kernels are not part of pageserve; a GPTQ checkpoint loads with --quantization gptq",
    "marlin": "Marlin-only layouts are not supported",
    "gguf": "give the .gguf file itself as --model",
}


def method_for(hf_config: dict, forced: str | None = None) -> QuantMethod | None:
    """The quantization method of a checkpoint (None: unquantized), checked against
    `--quantization` where given. Raises UnsupportedQuantization with one line naming what is
    not served."""
    qcfg = hf_config.get("quantization_config") or hf_config.get("compression_config")
    own = None
    if qcfg is not None:
        own = str(qcfg.get("quant_method", "")).lower()
        own = _ALIASES.get(own, own)
        if own not in CHECKPOINT_METHODS:
            why = _REFUSED.get(own, f"supported: {', '.join(CHECKPOINT_METHODS)}")
            raise UnsupportedQuantization(f"quantization method {own or '(none named)'} of this checkpoint is not "
                                          f"supported ({why})")
    if forced is not None:
        forced = forced.lower()
        forced = _ALIASES.get(forced, forced)
        if forced in _REFUSED:
            raise UnsupportedQuantization(f"--quantization {forced}: {_REFUSED[forced]}")
        if forced not in CHOICES:
            raise UnsupportedQuantization(f"--quantization {forced} is not supported (choices: {', '.join(CHOICES)})")
        if forced == "fp8" and own is None:
            return OnlineFP8()
        if forced != own:
            raise UnsupportedQuantization(f"--quantization {forced}, but the checkpoint is "
                                          f"{'quantized with ' + own if own else 'not quantized'}")
    return None if own is None else CHECKPOINT_METHODS[own](qcfg)


__all__ = ["CHOICES", "QuantMethod", "QuantTensor", "UnsupportedQuantization", "method_for"]
