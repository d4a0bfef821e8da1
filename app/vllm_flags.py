"""vLLM `serve` flags that pageserve does not take, each with what to do instead. A command line
moved from vLLM gets that line for such a flag, rather than argparse's bare "unrecognized
arguments"; docs/serving.md's table of them is made from this one."""

from __future__ import annotations

_EVERY_MODEL_EMBEDS = ("every model serves /v1/embeddings, /score and /rerank beside generation, pooled as its "
                       "sentence-transformers files say or as --pooler-config sets; classification and reward "
                       "heads are not served")

NOT_TAKEN = {
    "--trust-remote-code": "pageserve runs its own code for the architectures it knows (docs/models.md), never "
                           "code from a checkpoint: leave the flag out",
    "--tokenizer-mode": "the tokenizer loads through transformers' AutoTokenizer, the fast one where its files "
                        "allow (vLLM's auto)",
    "--load-format": "the weights are read from the model's safetensors or GGUF files, whichever it has",
    "--cpu-offload-gb": "the weights stay on the device; spread a larger model with --tensor-parallel-size or "
                        "--pipeline-parallel-size",
    "--num-gpu-blocks-override": "the KV pool is sized by --gpu-memory-utilization (CUDA) or --kv-cache-memory "
                                 "(GiB)",
    "--max-seq-len-to-capture": "CUDA graphs are captured for the batch sizes in --cuda-graph-sizes",
    "--data-parallel-size": "run one server per replica behind a load balancer (docs/parallel.md)",
    "--enable-expert-parallel": "MoE experts are split by tensor parallelism only",
    "--guided-decoding-backend": "structured output is always compiled with outlines-core",
    "--max-logprobs": "logprobs and top_logprobs go up to 20, as in OpenAI's API",
    "--enable-sleep-mode": "the weights and the KV pool stay on the device while the server runs",
    "--root-path": "serve behind a proxy that strips the path prefix",
    "--tool-parser-plugin": "the tool-call parsers are built in (--tool-call-parser)",
    "--task": _EVERY_MODEL_EMBEDS,
    "--runner": _EVERY_MODEL_EMBEDS,
    "--convert": _EVERY_MODEL_EMBEDS,
}


def explain(unknown: list[str]) -> str | None:
    """One line per vLLM flag in `unknown` (the arguments the parser did not take) that this
    table knows; None when there is none."""
    lines = [f"{flag} is vLLM's: {NOT_TAKEN[flag]}"
             for flag in dict.fromkeys(arg.split("=", 1)[0] for arg in unknown) if flag in NOT_TAKEN]
    return "\n".join(lines) or None
