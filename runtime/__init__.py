"""The engine: paged KV cache, scheduler, model runner, and the offline LLM API."""

from runtime.llm import LLM
from runtime.outputs import CompletionOutput, RequestOutput
from sampling.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
