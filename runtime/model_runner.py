"""Owns the model and the paged KV cache; turns one SchedulerOutput into sampled tokens."""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pageserve.runtime import startup
from pageserve.runtime.config import Backend, CacheConfig, DeviceConfig, LoRAConfig, ModelConfig
from pageserve.runtime.cpu_env import huge_page_bytes, release_freed_memory, resident_kib, weights_in_huge_pages
from pageserve.runtime.cuda_graphs import DecodeGraphs, capture_sizes
from pageserve.runtime.device import CudaDevice, HostDevice, device_for
from pageserve.runtime.draft_model import DraftModel
from pageserve.runtime.kernels import AttentionMetadata, TorchKernels, make_kernels
from pageserve.runtime.kv_swap import KVSwapper
from pageserve.runtime.lora.manager import LoRAManager
from pageserve.runtime.models import parallel, registry
from pageserve.runtime.models.layers import CausalLM, Experts
from pageserve.runtime.models.rope import rope_cos_sin_cache
from pageserve.runtime.models.loader import ModelLoadError, cache_root, gguf_source, iter_safetensors
from pageserve.runtime.models.gguf_file import GGUFFile
from pageserve.runtime.models.weight_formats import GGUFBlocks, narrow_exact_matrices, round_to_bfloat16
from pageserve.runtime.multimodal import EncoderOutputs
from pageserve.runtime.quantization.kv_scales import KVScales
from pageserve.runtime.quantization.load import BlockStorage, PackedStorage, quantized_load
from pageserve.runtime.pipeline import StageLink
from pageserve.runtime.pooling import chunk_part
from pageserve.runtime.request import child_id
from pageserve.runtime.scheduler import SchedulerOutput
from pageserve.runtime.step_inputs import BlockTables, step_inputs
from pageserve.runtime.step_sampler import StepSampler
from pageserve.runtime.synthetic_steps import GREEDY_PARAMS, build_step, warm_up_steps, worst_case_steps
from pageserve.sampling.logprobs import TokenLogprobs
from pageserve.sampling.sampler import topk_logprobs
from pageserve.triton_kernels import cpu_kernels, torch_ops

logger = logging.getLogger(__name__)


_LOGPROB_ROWS = 256  # prompt positions whose logits are materialized at once


@dataclass(slots=True)
class StepResult:
    sampled: list[int] = field(default_factory=list)  # in order; num_samples per sampling request
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # by (child) request id
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    pooled: list[torch.Tensor] = field(default_factory=list)  # per pooling request, in order
    encoder_seconds: dict[str, float] = field(default_factory=dict)  # request id -> in the vision encoder
    # requests with draft tokens: the drafts kept and the token sampled after them
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # one per kept token
    pending: tuple | None = None  # (host tensor, event): `sampled` once the device is done (resolve)

    def resolve(self) -> "StepResult":
        """The sampled tokens on the host, waiting for the device to have them (and no more)."""
        if self.pending is not None:
            host, event = self.pending
            event.synchronize()
            self.sampled, self.pending = host.tolist(), None
        return self


def kv_block_bytes(model: ModelConfig, block_size: int) -> int:
    """Bytes of one block across the layers of one rank (its stage's), K and V (of its KV heads)."""
    elem = model.kv_cache_dtype.itemsize
    return 2 * len(model.stage_layers) * block_size * model.kv_heads_per_rank * model.head_dim * elem


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, device_cfg: DeviceConfig, block_size: int, seed: int,
                 dev: CudaDevice | HostDevice | None = None, lora: LoRAConfig | None = None,
                 draft: ModelConfig | None = None, link: StageLink | None = None):
        """dev: streams, events, pinned memory and memory statistics (a test may pass a fake).
        lora: adapter slots beside the weights (--enable-lora). draft: the draft model of
        speculative decoding's draft_model method (runtime/draft_model.py). link: a pipeline
        stage's sends and receives of hidden states (runtime/pipeline.py)."""
        self.link = link
        self.model_cfg = model_cfg
        self.device_cfg = device_cfg
        self.device = device_cfg.device
        self.dev = dev or device_for(self.device)
        self.block_size = block_size
        self.kernels = make_kernels(device_cfg.attention_backend, block_size, model_cfg.heads_per_rank,
                                    model_cfg.kv_heads_per_rank)
        if isinstance(self.kernels, TorchKernels) and model_cfg.dtype == torch.float32 \
                and self.device.type == "cpu" and not device_cfg.enforce_eager:
            # None without a C compiler
            lib = cpu_kernels.load(cache_root() / "kernels", bf16_dot=model_cfg.bf16_matmuls)
            if lib is not None:
                self.kernels.use_cpu_kernels(lib)
            startup.check()
        if model_cfg.bf16_matmuls and getattr(self.kernels, "linear_plan", None) is None:
            raise ModelLoadError("bfloat16 matmuls were chosen but the CPU kernels did not load")
        self.model = self._load_model(Path(model_cfg.path))
        startup.check()
        self._plan_linear()
        self.lora = None if lora is None else LoRAManager(self.model, lora, model_cfg, self.device)
        self.sampler = StepSampler(model_cfg.vocab_size, self.device, seed, self.kernels, self.dev)
        self.seeded, self.counts = self.sampler.seeded, self.sampler.counts
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._kv_storage: torch.Tensor | None = None
        self.swapper: KVSwapper | None = None
        self.profiled_peak: int | None = None  # bytes, KV cache excluded (CUDA profile)
        self.profiled_graph_pool = 0  # bytes kept for the CUDA graphs' memory pool (CUDA profile)
        self.graphs: DecodeGraphs | None = None  # decode steps as CUDA graphs, once captured
        self.images = EncoderOutputs(model_cfg.bf16_matmuls)  # the vision encoder's outputs (multimodal models)
        self.block_tables = BlockTables()  # the requests' block tables, brought up to date each step
        self.draft = None if draft is None else DraftModel(ModelRunner(draft, device_cfg, block_size, seed, self.dev))
        if self.draft is not None:  # under the same block tables
            self.draft.runner.block_tables = self.block_tables

    def block_bytes(self) -> int:
        """Bytes of one KV block: the model's, and its draft model's where it has one."""
        return kv_block_bytes(self.model_cfg, self.block_size) + (self.draft.runner.block_bytes() if self.draft else 0)

    def _load_model(self, path: Path) -> CausalLM:
        cfg = self.model_cfg
        with torch.device("meta"):
            model = registry.model_class(cfg.architecture)(cfg, self.kernels)
        model.keep_stage()
        parallel.check_supported(model, cfg)
        model = model.to(cfg.dtype)  # on the meta device: nothing is allocated in any other dtype
        c_kernels = self.device.type == "cpu" and cfg.dtype == torch.float32 and getattr(self.kernels, "linear_plan", None)
        storage = BlockStorage() if c_kernels else PackedStorage(self.kernels.name == Backend.TRITON)
        source = gguf_source(path)
        try:
            gguf = None if source is None else GGUFFile(source, cfg.hf_config)
        except (ValueError, NotImplementedError) as e:  # a damaged header, an architecture gguf-py does not name
            raise ModelLoadError(f"cannot read GGUF file {source}: {e}") from None
        quant = quantized_load(cfg.hf_config, cfg.quantization, model, path, storage,
                               gguf.checkpoint_names() if gguf else None)
        kept = GGUFBlocks()
        if gguf is not None and c_kernels:  # (a layer quantized at load time has its own storage already)
            kept = GGUFBlocks.plan(model, gguf.block_formats(), gguf.checkpoint_names())
        kv_scales = KVScales.for_checkpoint(cfg.hf_config, model)
        model = model.to_empty(device=self.device)
        # the file's blocks go straight there
        early = torch.nn.ModuleList(list({id(m): m for m, _, _, _ in kept.matrices}.values()))
        if self.device.type == "cpu":
            weights_in_huge_pages(early, values=False)
        try:
            weights = iter_safetensors(path) if gguf is None else gguf.stream(kept.names)
            weights = kv_scales.stream(weights)
            model.load_weights(weights if quant is None else quant.stream(weights))
            kv_scales.apply(cfg.kv_cache_dtype)
        except ModelLoadError:
            raise
        except ValueError as e:
            raise ModelLoadError(f"weights in {source or path} do not fit the model: {e}") from None
        if quant is not None:
            quant.finish()
        if c_kernels:
            self._compact_matrices(model, kept)
        if self.device.type == "cpu":
            weights_in_huge_pages(model, exclude=frozenset(p.data_ptr() for p in early.parameters()))
            release_freed_memory()
        if quant is not None:
            quant.bind_experts()  # views of the weights where they now lie
        # the RoPE table stays float32 (it was lost on the meta device)
        model.cos_sin_cache = rope_cos_sin_cache(cfg).to(self.device)
        return model.eval()

    def _compact_matrices(self, model: CausalLM, kept: GGUFBlocks) -> None:
        """Float32 with the C linear: the matrices loaded in a GGUF file's own blocks marked as
        such, the rest in bfloat16 where exact (weight_formats.py): the same values, fewer bytes
        for each step to read. With bfloat16 matmuls every weight is rounded to bfloat16 (GGUF
        blocks as they are widened)."""
        t = time.perf_counter()
        blocks = kept.finish()
        if self.model_cfg.bf16_matmuls:
            narrowed = round_to_bfloat16(model)
            how = "every weight rounded to bfloat16"
        else:
            narrowed, how = narrow_exact_matrices(model), "their values exact"
        if blocks or narrowed:
            logger.info("matrices kept smaller, %s: %.0f MB saved by GGUF blocks, %.0f MB by 16-bit ones (%.1f s)", how,
                        blocks / 1e6, narrowed / 1e6, time.perf_counter() - t)

    def _plan_linear(self) -> None:
        """CPU with the C kernels: time torch's matmul against the C linear on two decoder
        layers' weights at each step size, so that every step runs the faster one."""
        plan = getattr(self.kernels, "linear_plan", None)
        if plan is None:
            return
        plan.measure([m.weight for layer in self.model.stage()[:2] for m in layer.modules()
                      if isinstance(m, torch.nn.Linear)])

    def profile_num_blocks(self, gpu_memory_utilization: float, max_num_batched_tokens: int,
                           max_num_seqs: int) -> int:
        """CUDA: run the worst-case steps (synthetic_steps.worst_case_steps: the largest batch,
        every sampling path, prompt logprobs, grammar masks, split-KV buffers) through `execute`
        on a small temporary KV cache, then give the KV cache what their peak leaves of the
        allowed fraction of device memory, in blocks."""
        dev, cfg = self.dev, self.model_cfg
        dev.empty_cache()
        free, total = dev.mem_get_info()
        used_by_others = total - free - dev.memory_allocated()
        block_bytes = self.block_bytes()
        num_temp = -(-max_num_batched_tokens // self.block_size)  # a slot for every token
        self._set_kv_storage(num_temp)
        # penalty rows for the most sequences that can run, at the size serving keeps them (rows
        # grow by doubling and stay: grown inside a step, they would miss that step's peak)
        self.counts.reserve(max_num_seqs)
        dev.reset_peak_memory_stats()
        steps = worst_case_steps(max_num_batched_tokens, max_num_seqs, cfg.max_model_len,
                                 self.kernels.largest_split_decode(cfg.max_model_len, self.device),
                                 self.block_size, num_temp, cfg.vocab_size, cfg.eos_token_ids)
        for step in steps:  # each step's requests finish before the next, as no more can run at once
            self.execute(step)
            self.execute(SchedulerOutput(finished_ids=[child_id(r.request_id, i) for r in step.requests
                                                       for i in range(r.num_samples)]))
        dev.synchronize()
        # the real cache replaces the temporary one
        self.profiled_peak = dev.max_memory_allocated() - num_temp * block_bytes
        self.profiled_graph_pool = graph_pool = self._profile_graph_pool(max_num_seqs)
        self._set_kv_storage(0)
        dev.empty_cache()
        budget = total * gpu_memory_utilization - used_by_others - self.profiled_peak - graph_pool
        logger.info("memory profile: worst-case step peak %.2f GiB (weights included), %.2f GiB "
                    "used outside torch, %.2f GiB kept for CUDA graphs", self.profiled_peak / 2 ** 30,
                    used_by_others / 2 ** 30, graph_pool / 2 ** 30)
        return int(budget // block_bytes)

    def graph_sizes(self, max_num_seqs: int) -> list[int]:
        """The decode batch sizes captured as CUDA graphs; none on CPU, with --enforce-eager,
        with kernels that cannot be captured (the torch backend reads plans on the host; the
        loop over quantized experts reads their token counts), or under tensor or pipeline
        parallelism (for now)."""
        if self.dev.type != "cuda" or self.device_cfg.enforce_eager or not self.kernels.graph_safe:
            return []
        if self.model_cfg.tp_size > 1 or self.model_cfg.pp_size > 1:  # NCCL inside graphs: not checked on GPUs yet
            return []
        if getattr(self.model, "mrope_section", None):  # the graphs take 1-D positions
            return []
        if any(isinstance(m, Experts) and m.parts for m in self.model.modules()):  # a loop that reads counts
            return []
        return capture_sizes(self.device_cfg.cuda_graph_sizes or None, max_num_seqs)

    def _profile_graph_pool(self, max_num_seqs: int) -> int:
        """Bytes the graphs' memory pool will hold for good: the activations of a decode step
        at the largest captured size (the smaller graphs reuse that memory), and the split-KV
        partitions of the largest size that splits, captured for the longest context."""
        sizes = self.graph_sizes(max_num_seqs)
        if not sizes:
            return 0
        step = build_step([(1, 1, 1)] * sizes[-1], [GREEDY_PARAMS] * sizes[-1], self.block_size, 1,
                          self.model_cfg.vocab_size, self.model_cfg.eos_token_ids, "profile-graph",
                          write=False)
        ids, pos, meta = self._prepare(step)[:3]
        self.block_tables.release(r.request_id for r in step.requests)
        self.dev.synchronize()
        before = self.dev.memory_allocated()
        self.dev.reset_peak_memory_stats()
        with torch.inference_mode():
            self.model(ids, pos, meta, self.kv_caches)
        self.dev.synchronize()
        context = -(-self.model_cfg.max_model_len // self.block_size) * self.block_size
        split = [s for s in sizes if self.kernels.graph_max_seq_len(s, context, self.device) > 1]
        partitions = self.kernels.split_buffer_bytes(split[-1], context, self.model_cfg.head_dim) if split else 0
        return max(0, self.dev.max_memory_allocated() - before) + partitions

    @torch.inference_mode()
    def capture_cuda_graphs(self, max_num_seqs: int) -> None:
        """After the KV cache is allocated (the graphs hold its addresses) and the kernels are
        warm: capture the model's decode forward at each of graph_sizes."""
        sizes = self.graph_sizes(max_num_seqs)
        if not sizes:
            return
        max_blocks = -(-self.model_cfg.max_model_len // self.block_size)
        self.graphs = DecodeGraphs(self.model, self.kernels, self.kv_caches, self.dev, sizes,
                                   max_blocks, self.device, self.lora.config.max_loras if self.lora else 0)
        self.graphs.capture()

    def warm_up_kernels(self) -> None:
        """Launch every kernel variant serving can launch (mixed prefill/decode attention, the
        one-pass and split-KV decodes and the reduce, rms_norm with and without the residual,
        rotary, silu_and_mul, reshape_and_cache, apply_token_bitmask), so that none compiles in
        front of a user. Nothing to do for kernels that compile nothing. Writes no KV."""
        if not self.kernels.compiles_kernels:
            return
        start = time.perf_counter()
        cfg = self.model_cfg
        steps = warm_up_steps(self.kernels.decode_shapes(cfg.max_model_len, self.device),
                              self.block_size, cfg.vocab_size, cfg.eos_token_ids)
        for step in steps:
            self.execute(step)
            self.execute(SchedulerOutput(finished_ids=[r.request_id for r in step.requests]))
        self.dev.synchronize()
        logger.info("kernel warm-up: %d steps launching every kernel variant in %.1f s",
                    len(steps), time.perf_counter() - start)

    def _set_kv_storage(self, num_blocks: int) -> None:
        cfg = self.model_cfg
        self.graphs = None  # they hold the old pool's addresses
        self.kv_caches, self._kv_storage = [], None  # the old pool is freed before the new one
        if not num_blocks:
            if self.draft is not None:
                self.draft.runner._set_kv_storage(0)
            return
        shape = (len(cfg.stage_layers), 2, num_blocks, cfg.kv_heads_per_rank, self.block_size, cfg.head_dim)
        # zero-fill touches every page, so the pool's memory is committed now, not mid-run
        self._kv_storage = self._kv_pool(shape, cfg.kv_cache_dtype)
        self._kv_storage.zero_()
        kib = resident_kib(self._kv_storage) if self.device.type == "cpu" else None
        if kib:
            logger.info("KV pool in transparent huge pages: %.0f of %.0f MiB", kib[1] / 1024, kib[0] / 1024)
        self.kv_caches = [(self._kv_storage[i, 0], self._kv_storage[i, 1]) for i in range(len(cfg.stage_layers))]
        if self.draft is not None:  # the draft's pool: as many blocks, under the same block tables
            self.draft.runner._set_kv_storage(num_blocks)

    def _kv_pool(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """On CPU in transparent huge pages: a block's K (or V) rows of one head are 4 KiB in the
        default model (16 tokens x 64 x float32), a page each, so attention on 4 KiB pages missed
        the TLB at every block (docs/performance.md: huge pages)."""
        if self.device.type == "cpu":
            raw = huge_page_bytes(math.prod(shape) * dtype.itemsize)
            if raw is not None:
                return raw.view(dtype).view(shape)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def allocate_kv_cache(self, cache: CacheConfig) -> None:
        self._set_kv_storage(cache.num_blocks)
        if cache.num_swap_blocks:
            self.swapper = KVSwapper(self._kv_storage, cache.num_swap_blocks, self.dev)
            logger.info("swap space: %.2f GiB of %s host memory", self.swapper.nbytes / 2 ** 30,
                        "pinned" if self.dev.type == "cuda" else "pageable")
        if self.draft is not None:
            self.draft.runner.allocate_kv_cache(cache)

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write of forked requests' partial blocks, all layers at once."""
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        pool = torch_ops.indexable(self._kv_storage)
        pool[:, :, dst] = pool[:, :, src]
        if self.draft is not None:
            self.draft.runner.copy_blocks(pairs)

    def _prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int],
                                                      torch.Tensor]:
        inputs = step_inputs(out, self.dev, self.device, self.block_tables, self.lora, self.sampler.last_draws)
        self.kernels.prepare(inputs[2])
        return inputs

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one step: swaps, the forward, then sampling (`num_samples` tokens per
        request whose `sample` is set), prompt logprobs and pooling. The sampled tokens are on
        their way to the host (StepResult.resolve): on a GPU this returns once the step is
        queued (but for what needs the host: logprobs, drafts), so that the next step can be
        prepared while it runs."""
        self.sampler.release(out.finished_ids, out.preempted)
        self.block_tables.release(out.finished_ids)  # before the step's updates: a preempted
        self.block_tables.release(out.preempted)  # request may come back in it, sent whole
        for swapper in (self.swapper, self.draft and self.draft.runner.swapper):
            if swapper is not None:
                swapper.swap(out.swap_out, out.swap_in)  # copies run on side streams
        self.images.free(out.freed_images)
        result = StepResult()
        if not out.requests:
            return result
        if self.draft is not None:  # its tokens into the speculating requests' chunks first
            if self.draft.runner.swapper is not None:
                self.draft.runner.swapper.wait_ready()
            self.draft.propose(out)
        ids, pos, meta, logits_rows, rows_on_device = self._prepare(out)
        pos, images, result.encoder_seconds = self.images.prepare(self.model, out.requests, pos, meta, self.device)
        if self.swapper is not None:
            self.swapper.wait_ready()  # the forward reads swapped-in blocks, rewrites swapped-out ones
        size = self.graphs.size_for(meta) if self.graphs is not None and images is None else None
        if self.link is not None:  # a pipeline stage: from the previous one, to the next one
            carry = None if self.link.prev is None else self.link.recv(len(ids))
            hidden = self.model(ids, pos, meta, self.kv_caches, carry=carry)
            if self.link.next is not None:
                self.link.send(*hidden)
                return result
        elif images is not None:
            hidden = self.model(ids, pos, meta, self.kv_caches, images)
        elif size is None:
            hidden = self.model(ids, pos, meta, self.kv_caches)
        else:
            hidden = self.graphs.run(size, ids, pos, meta)
        spec_rows = []
        # one pass for what most steps have none of (each request's rows, pooling, prompt logprobs, drafts)
        if any(r.pool or r.draft_tokens or r.sampling_params.prompt_logprobs is not None for r in out.requests):
            starts = [0, *itertools.accumulate(len(r.token_ids) for r in out.requests)]
            if any(r.pool for r in out.requests):
                pooling_type = self.model_cfg.pooler.pooling_type
                result.pooled = [chunk_part(hidden[starts[i]:starts[i + 1]], pooling_type)
                                 for i, r in enumerate(out.requests) if r.pool]
            if any(r.sampling_params.prompt_logprobs is not None for r in out.requests):
                result.prompt_logprobs = self._prompt_logprobs(out, hidden, starts)
            spec_rows = [starts[i + 1] - len(r.draft_tokens) - 1 + j for i, r in enumerate(out.requests)
                         if r.draft_tokens for j in range(len(r.draft_tokens) + 1)]
        if not logits_rows and not spec_rows:
            return result
        # every rank computes the logits (gathered on rank 0), which samples
        # the rows on the device: indexing with a list copies from pageable memory and waits for
        # the step; no indexing where every token samples (a decode step: the rows are all, in order)
        sampled = hidden if len(logits_rows) == len(hidden) else hidden[rows_on_device]
        plain = self.sample_logits(sampled, out) if logits_rows else None
        at_drafts = self.model.compute_logits(hidden[spec_rows]) if spec_rows else None
        if not self.model_cfg.tp_rank:
            self.sampler.sample(out, plain, at_drafts, result)
        if self.draft is not None and result.spec_tokens:
            self.draft.catch_up(out, result.spec_tokens)
        return result

    def sample_logits(self, hidden: torch.Tensor, out: SchedulerOutput) -> torch.Tensor:
        """[requests that sample, vocab] logits from their last hidden states, in the order of
        `out.requests` (the seam where tests/scripted.py scripts the output)."""
        return self.model.compute_logits(hidden)

    def _prompt_logprobs(self, out: SchedulerOutput, hidden: torch.Tensor,
                         starts: list[int]) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """For each prompt position of the step whose next token is also in the prompt: that
        token's log-probability and the top k. Keyed by request: (position of the first
        target token, entries)."""
        rows, targets, ks, spans = [], [], [], {}
        for i, r in enumerate(out.requests):
            k = r.sampling_params.prompt_logprobs
            if k is None:
                continue
            first = r.start_pos + 1
            last = min(r.start_pos + len(r.token_ids), r.num_prompt_tokens - 1)  # last target pos
            if last < first:
                continue
            spans[r.request_id] = (first, len(rows), last - first + 1)
            rows.extend(range(starts[i], starts[i] + last - first + 1))
            targets.extend(r.request_tokens[first:last + 1])
            ks.extend([k] * (last - first + 1))
        if not rows:
            return {}
        entries = []
        for i in range(0, len(rows), _LOGPROB_ROWS):  # [rows, vocab] logits, a piece at a time
            logits = self.model.compute_logits(hidden[rows[i:i + _LOGPROB_ROWS]])
            if self.model_cfg.tp_rank:  # gathered on rank 0
                continue
            piece = torch.tensor(targets[i:i + _LOGPROB_ROWS], device=self.device)
            entries += topk_logprobs(logits, piece, ks[i:i + _LOGPROB_ROWS], max(ks))
        return {rid: (first, entries[at:at + n]) for rid, (first, at, n) in spans.items()}

