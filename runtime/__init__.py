"""The engine: paged KV cache, scheduler, model runner, and the offline LLM API. Importing the
package loads no torch; `LLM` (and what it needs) is imported when first touched."""

from pageserve.sampling.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "LoRARequest"]


def __getattr__(name: str):
    if name == "LLM":
        from pageserve.runtime.llm import LLM
        return LLM
    if name == "LoRARequest":
        from pageserve.runtime.lora.request import LoRARequest
        return LoRARequest
    if name in ("RequestOutput", "CompletionOutput"):
        from pageserve.runtime import outputs
        return getattr(outputs, name)
    raise AttributeError(f"module 'pageserve.runtime' has no attribute {name!r}")
