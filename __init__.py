"""pageserve: an LLM inference server with a paged KV cache, continuous batching and an
OpenAI-compatible API. `from pageserve import LLM, SamplingParams` for the offline API;
`pageserve serve` for the server. Importing the package loads no torch until `LLM` is touched.

The repository's top-level folders (app, runtime, grammar, sampling, triton_kernels, loadtest)
install as this package's subpackages: pageserve.app, pageserve.runtime, ..."""

from pageserve.sampling.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "LoRARequest"]


def __getattr__(name: str):
    if name in __all__:
        from pageserve import runtime
        return getattr(runtime, name)
    raise AttributeError(f"module 'pageserve' has no attribute {name!r}")
