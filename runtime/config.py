"""Frozen, validated configs: one per component, built once from the engine args."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field

import torch

from pageserve.runtime.pooling import PoolerConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class _Choice(str, enum.Enum):
    """A setting with a fixed set of values: compares equal to its string, and a string that
    is none of them fails here, once, with the list."""

    @classmethod
    def _missing_(cls, value):
        raise ValueError(f"{cls.__doc__.split(':')[0]} must be one of "
                         f"{', '.join(m.value for m in cls)}; got {value!r}")


class PreemptionMode(_Choice):
    """preemption_mode: what happens to a preempted request's blocks"""
    SWAP = "swap"  # copied to the CPU swap space (recompute when it is full)
    RECOMPUTE = "recompute"  # freed; the request is computed again later


class SchedulingPolicy(_Choice):
    """scheduling_policy: the order in which requests get the engine"""
    FCFS = "fcfs"  # by arrival
    PRIORITY = "priority"  # by the request's priority (lowest value first), then by arrival


class Backend(_Choice):
    """attention_backend: which kernels run"""
    TORCH = "torch"  # triton_kernels/torch_ops.py, the CPU path
    TRITON = "triton"  # the Triton kernels (CUDA, or Triton's CPU interpreter in tests)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    path: str  # a Hugging Face style directory (a GGUF file's: its config, tokenizer and the file's name)
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype
    max_model_len: int
    # config.json as read: what one architecture alone needs (expert counts, layer plans)
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)
    # tensor parallelism: this process holds rank tp_rank's part of every split layer
    tp_size: int = 1
    tp_rank: int = 0
    # pipeline parallelism: this process runs stage pp_rank of pp_size, the layers pp_layers
    # (a partition of num_layers, one count per stage) give it
    pp_size: int = 1
    pp_rank: int = 0
    pp_layers: tuple[int, ...] = ()
    # the window every layer attends within (the widest, where they differ), so that KV wholly
    # before it is never read again; 0 when any layer attends to the whole context
    sliding_window: int = 0
    # CPU C kernels with AVX512-BF16 (--dtype bfloat16 or auto): every matmul rounds its inputs
    # and weights to bfloat16 and sums in float32, each op's output is rounded to bfloat16;
    # `dtype` (the tensors, the KV cache) is float32
    bf16_matmuls: bool = False
    # --quantization: the checkpoint's method forced, or "fp8" made at load time (None: config.json's)
    quantization: str | None = None
    # what the KV cache holds (--kv-cache-dtype; None: `dtype`). bfloat16 or float8 e4m3fn under
    # float32 activations rounds each new K and V value as it is written, and the attention widens
    # it as it reads it
    kv_cache_dtype: torch.dtype | None = None
    # how /v1/embeddings pools the last hidden states (runtime/pooling.py)
    pooler: PoolerConfig = field(default_factory=PoolerConfig)
    # o_proj's bias (Llama's, Qwen3's and Gemma's attention_bias), the MLP's (Llama's mlp_bias)
    o_bias: bool = False
    mlp_bias: bool = False
    # the first rotary_dim values of each q and k head turn with RoPE, the rest pass (Phi-4-mini's
    # partial_rotary_factor); None: all head_dim
    rotary_dim: int | None = None

    def __post_init__(self):
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.bf16_matmuls and self.dtype != torch.float32:
            raise ValueError("bf16_matmuls takes float32 activations")
        if self.rotary_dim is None:
            object.__setattr__(self, "rotary_dim", self.head_dim)
        elif not 2 <= self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and within 2..head_dim ({self.head_dim}), got {self.rotary_dim}")
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type")) == "longrope":  # a factor per turned pair of values
            for key in ("short_factor", "long_factor"):
                if len(scaling.get(key) or ()) != self.rotary_dim // 2:
                    raise ValueError(f"LongRoPE's {key} has {len(scaling.get(key) or ())} values; RoPE over "
                                     f"{self.rotary_dim} values of each head takes {self.rotary_dim // 2}")
        if self.kv_cache_dtype is None:
            object.__setattr__(self, "kv_cache_dtype", self.dtype)
        elif self.kv_cache_dtype not in (*_DTYPES.values(), torch.float8_e4m3fn):
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(_DTYPES)} or float8_e4m3fn; "
                             f"got {self.kv_cache_dtype}")
        if self.max_model_len > self.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({self.max_model_len}) is larger than the model's own limit "
                f"(max_position_embeddings = {self.max_position_embeddings})"
            )
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0, got {self.sliding_window}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.tp_size > 1:
            kv, tp = self.num_kv_heads, self.tp_size
            # the vocabulary need not divide: runtime/models/parallel.py pads it
            splits = {"num_attention_heads": self.num_heads, "intermediate_size": self.intermediate_size}
            for name, value in splits.items():
                if value % tp:
                    raise ValueError(f"{name} ({value}) must be divisible by --tensor-parallel-size ({tp})")
            if kv % tp and tp % kv:  # fewer KV heads than ranks: each is replicated on tp // kv ranks
                raise ValueError(f"num_key_value_heads ({kv}) and --tensor-parallel-size ({tp}) must "
                                 "divide one another")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside 0..{self.tp_size - 1}")
        if self.pp_size > 1 and (len(self.pp_layers) != self.pp_size or sum(self.pp_layers) != self.num_layers
                                 or min(self.pp_layers) < 1):
            raise ValueError(f"the pipeline's layer partition {list(self.pp_layers)} must give each of the "
                             f"{self.pp_size} stages at least one layer and {self.num_layers} in all")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank {self.pp_rank} is outside 0..{self.pp_size - 1}")

    @property
    def stage_layers(self) -> range:
        """The decoder layers this process runs: all of them without pipeline parallelism."""
        if self.pp_size == 1:
            return range(self.num_layers)
        start = sum(self.pp_layers[:self.pp_rank])
        return range(start, start + self.pp_layers[self.pp_rank])

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.tp_size

    @property
    def kv_heads_per_rank(self) -> int:
        """Split across ranks, or one replicated KV head per rank when there are fewer."""
        return max(1, self.num_kv_heads // self.tp_size)


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    num_swap_blocks: int = 0
    preemption_mode: PreemptionMode = PreemptionMode.SWAP
    # every layer's window (ModelConfig.sliding_window): a request's blocks wholly before the
    # window of its next token go back to the pool; 0 keeps them all
    sliding_window: int = 0

    def __post_init__(self):
        object.__setattr__(self, "preemption_mode", PreemptionMode(self.preemption_mode))
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0, got {self.sliding_window}")
        if self.num_swap_blocks < 0:
            raise ValueError(f"the swap space cannot be negative ({self.num_swap_blocks} blocks)")
        if self.block_size not in (8, 16, 32):
            raise ValueError(f"block_size must be 8, 16 or 32, got {self.block_size}")
        if self.num_blocks < 1:
            raise ValueError(f"the KV cache has no room for a single block (num_blocks={self.num_blocks})")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    # a step that admits new prompts leaves the running decodes to the next step (the CPU
    # default: there a step's time is its rows' arithmetic, so mixing saves nothing and the new
    # requests' first tokens wait for the decodes; a GPU decodes beside a prompt for free)
    prompts_first: bool = False
    max_loras: int = 0  # distinct LoRA adapters the running batch may hold (0: adapters are off)
    # a decoding request runs in the next step too before its token is known (runtime/scheduler.py)
    async_scheduling: bool = False
    # a streamed request reports every this many tokens (its first and its last at once)
    stream_interval: int = 1
    policy: SchedulingPolicy = SchedulingPolicy.FCFS

    def __post_init__(self):
        object.__setattr__(self, "policy", SchedulingPolicy(self.policy))
        if not isinstance(self.stream_interval, int) or self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be an integer >= 1, got {self.stream_interval!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})"
            )


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """--enable-lora: adapters in `max_loras` slots beside the base weights (sized at start-up),
    up to `max_cpu_loras` kept loaded in host memory (least recently used out)."""
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    def __post_init__(self):
        if self.max_loras < 1:
            raise ValueError(f"--max-loras must be >= 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"--max-lora-rank must be in 1..512, got {self.max_lora_rank}")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be >= --max-loras ({self.max_loras})")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """--speculative-config, as vLLM's: {"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_min": a, "prompt_lookup_max": b} or {"method": "draft_model", "model": DIR,
    "num_speculative_tokens": k} (a model given without a method means draft_model, as in
    vLLM); speculation stops for a step with more than `disable_by_batch_size` running requests
    (default 8: above that, drafts gain little even when accepted; docs/performance.md)."""
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = 8
    model: str | None = None  # the draft model (draft_model): a directory, GGUF file or hub id

    @classmethod
    def parse(cls, value: dict | str | None) -> SpeculativeConfig | None:
        if value is None or value == "":
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError(f"--speculative-config is not JSON: {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"--speculative-config must be a JSON object, got {value!r}")
        method = value.get("method") or ("draft_model" if value.get("model") else "ngram")
        if method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative method {method!r} is not supported (supported: ngram, draft_model)")
        known = {"method", "num_speculative_tokens", "disable_by_batch_size"} | (
            {"prompt_lookup_min", "prompt_lookup_max"} if method == "ngram" else {"model"})
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"--speculative-config: {', '.join(unknown)} not supported with method {method} "
                             f"(known: {', '.join(sorted(known))})")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        lo, hi = (lo or hi or 2), (hi or max(lo or 0, 5))  # one given: the other follows it, as vLLM
        return cls(method, value.get("num_speculative_tokens", 4), lo, hi, value.get("disable_by_batch_size", 8),
                   value.get("model"))

    def __post_init__(self):
        ints = {"num_speculative_tokens": self.num_speculative_tokens, "prompt_lookup_min": self.prompt_lookup_min,
                "prompt_lookup_max": self.prompt_lookup_max}
        for name, v in ints.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative {name} must be an integer >= 1, got {v!r}")
        if self.num_speculative_tokens > 16:
            raise ValueError(f"speculative num_speculative_tokens must be <= 16, got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        b = self.disable_by_batch_size
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ValueError(f"speculative disable_by_batch_size must be an integer >= 1, got {b!r}")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError('speculative method draft_model needs "model": the draft model\'s directory or file')


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    device: torch.device
    attention_backend: Backend
    num_threads: int
    enforce_eager: bool = False  # no compiled CPU kernels, no CUDA graphs
    cuda_graph_sizes: tuple[int, ...] = ()  # --cuda-graph-sizes; empty: the default

    def __post_init__(self):
        object.__setattr__(self, "attention_backend", Backend(self.attention_backend))


class ExecutorBackend(_Choice):
    """distributed_executor_backend: how ranks above one run"""
    MP = "mp"  # one worker process per rank on this machine (multiprocessing)


SECRET_ENV = "PAGESERVE_DISTRIBUTED_SECRET"
MIN_SECRET_BYTES = 16


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1  # stages of contiguous layers, tensor_parallel_size ranks each
    batches_in_flight: int = 1  # steps the engine keeps in the pipeline at once (1 without one)
    distributed_executor_backend: ExecutorBackend = ExecutorBackend.MP
    master_addr: str = "127.0.0.1"  # torch.distributed's rendezvous (MASTER_ADDR)
    master_port: int = 0  # MASTER_PORT; 0: a free port on this machine
    nnodes: int = 1  # machines the ranks span; node 0 runs the engine, the others only workers
    node_rank: int = 0
    # the key that authenticates every message between nodes (HMAC-SHA256); needed with nnodes > 1
    secret: bytes = field(default=b"", repr=False)

    def __post_init__(self):
        object.__setattr__(self, "distributed_executor_backend",
                           ExecutorBackend(self.distributed_executor_backend))
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"MASTER_PORT must be a port number, got {self.master_port}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        if not 1 <= self.batches_in_flight <= max(1, self.pipeline_parallel_size):
            raise ValueError(f"--max-batches-in-flight must be in 1..--pipeline-parallel-size "
                             f"({self.pipeline_parallel_size}), got {self.batches_in_flight}")
        if self.nnodes < 1 or self.world_size % self.nnodes:
            raise ValueError(f"--tensor-parallel-size x --pipeline-parallel-size ({self.world_size}) must be a "
                             f"multiple of --nnodes ({self.nnodes}): every node runs as many ranks")
        if self.nnodes > 1 and self.tensor_parallel_size % self.ranks_per_node \
                and self.ranks_per_node % self.tensor_parallel_size:
            raise ValueError(f"{self.ranks_per_node} ranks per node split a tensor-parallel group of "
                             f"{self.tensor_parallel_size} unevenly: give each node whole stages, or whole "
                             "parts of one")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in 0..{self.nnodes - 1}, got {self.node_rank}")
        if self.nnodes > 1 and not self.master_port:
            raise ValueError("--nnodes above 1 needs the rendezvous port that every node is given: "
                             "--master-port (or MASTER_PORT)")
        if self.nnodes > 1 and len(self.secret) < MIN_SECRET_BYTES:
            raise ValueError(f"--nnodes above 1 needs a shared secret of at least {MIN_SECRET_BYTES} bytes, the "
                             f"same on every node: {SECRET_ENV} (or --distributed-secret); for example "
                             "`export PAGESERVE_DISTRIBUTED_SECRET=$(openssl rand -hex 32)` on one node, copied "
                             "to the others")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def stage_of(self, rank: int) -> int:
        """A rank's pipeline stage. Ranks count from the last stage (TP ranks 0..T-1 are the
        last stage's), so that rank 0, on the engine's node, is the one that samples, and the
        first stages go to the other nodes."""
        return self.pipeline_parallel_size - 1 - rank // self.tensor_parallel_size

    def stage_ranks(self, stage: int) -> range:
        first = (self.pipeline_parallel_size - 1 - stage) * self.tensor_parallel_size
        return range(first, first + self.tensor_parallel_size)

    @property
    def node_ranks(self) -> range:
        """The ranks that run on this node."""
        return range(self.node_rank * self.ranks_per_node, (self.node_rank + 1) * self.ranks_per_node)


@dataclass(frozen=True, slots=True)
class MultiModalConfig:
    """A model that takes images: at most `max_images` a prompt (--limit-mm-per-prompt), and
    the vision encoder's outputs kept within `encoder_cache_bytes` (--mm-encoder-cache-mb)."""
    max_images: int
    encoder_cache_bytes: int
    whole_images: bool = False  # an image's tokens attend to each other: never split across steps
    encoder_step_tokens: int | None = None  # image tokens a step may encode (one image always may)

    def __post_init__(self):
        if self.max_images < 0:
            raise ValueError(f"the image limit a prompt must be >= 0, got {self.max_images}")
        if self.encoder_cache_bytes <= 0:
            raise ValueError(f"mm_encoder_cache_mb must be > 0, got {self.encoder_cache_bytes / 2 ** 20}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: DeviceConfig
    seed: int
    debug_checks: bool  # check pool integrity after every step (tests)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    multimodal: MultiModalConfig | None = None  # None: the model takes text only
    lora: LoRAConfig | None = None  # None: no adapters (--enable-lora off)
    speculative: SpeculativeConfig | None = None  # None: one token a step


def parse_dtype(name: str) -> torch.dtype:
    """A dtype named other than auto (EngineArgs.resolve_dtype settles auto)."""
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
    return _DTYPES[name]


def cpu_flags() -> set[str]:
    """The feature flags /proc/cpuinfo gives the first CPU (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def cpu_has_fast_bf16() -> bool:
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags
