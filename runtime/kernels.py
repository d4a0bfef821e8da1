"""The set of kernels a model calls (paged attention, reshape_and_cache, RMS norm, rotary,
SiLU-and-mul, the grammar bitmask), in torch (the CPU path) or Triton (CUDA), and the
attention metadata of one step that they are given as an argument."""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pageserve.runtime.config import Backend
from pageserve.triton_kernels import torch_ops
from pageserve.triton_kernels.cpu_kernels import CpuKernels, blocks
from pageserve.triton_kernels.linear_plan import LinearPlan

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64 cache slot of each new token
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32 context length after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # torch backend: sliding window (0: full attention) -> its plan, built on first use, so that
    # a model whose every layer has a window never plans the whole context
    window_plans: dict = field(default_factory=dict)
    # [T] int64: the last position each query token may attend, where that is past its own:
    # an image's tokens see the whole image in models whose image tokens attend both ways
    # (None: every token is causal)
    key_limit: torch.Tensor | None = None
    lora: LoRABatch | None = None  # the step's adapter tokens (None: every token is the base model's)


@dataclass(slots=True)
class LoRABatch:
    """Which adapter slot each token of the step runs under, grouped by slot. Only tokens of
    requests with an adapter are in a group; the others get the base model alone."""
    rows: torch.Tensor  # [n] int64: the adapter tokens, grouped by slot
    groups: list[tuple[int, int, int]]  # (slot, first index into rows, count), on the host
    group_table: torch.Tensor  # the same as an int64 [groups, 3] host tensor (the C kernel's)
    # the same on the device, padded to the number of slots (slot -1: unused) for the Triton
    # kernels, whose launch grid must not depend on the step's contents
    sorted_tokens: torch.Tensor  # [T] int32: rows, then the base model's tokens
    group_slots: torch.Tensor  # [S] int32
    group_starts: torch.Tensor  # [S] int32
    group_counts: torch.Tensor  # [S] int32


# a step whose requests compute at most this many tokens each (decodes, speculative runs being
# verified) may run the C decoder stack, each token as a decode of its own position
STACK_ROWS = 17
# and so may a step of up to STACK_PROMPT_ROWS tokens in all (prompts, later chunks, decodes beside
# them; the CPU's default token budget), its attention taking each chunk's rows as the layers'
# prompt attention does. Its activations stay allocated at the largest step's size.
STACK_PROMPT_ROWS = 512


class Kernels:
    """Every kernel the engine launches. `attention` (with `prepare`, once per step) runs paged
    attention; `ops` holds the rest."""
    name: Backend
    compiles_kernels = False  # whether a kernel variant is compiled on its first launch
    # whether a decode step's launches can be captured in a CUDA graph: nothing on the host
    # reads device data, and every launch grid follows from the batch size alone
    graph_safe = False
    # rms_norm, rope_cos_sin, rotary_embedding, silu_and_mul, apply_token_bitmask, fused_moe: torch_ops, a
    # namespace of Triton launchers, or torch_ops with C versions (_CpuOps)
    ops: object

    def __init__(self, block_size: int, num_heads: int, num_kv_heads: int):
        self.block_size = block_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads

    lora_batch: LoRABatch | None = None  # the step's, set by prepare(): read by linear()

    def prepare(self, meta: AttentionMetadata) -> None:
        """Per-step work shared by all layers."""
        self.lora_batch = meta.lora

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Every linear layer's matmul, the lm_head's included, and the delta of each token's
        LoRA adapter where the weight has adapter slots (`weight.lora`, runtime/lora/slots.py)."""
        out = self.matmul(x, weight, bias)
        lora = getattr(weight, "lora", None)
        if lora is not None and self.lora_batch is not None:
            self.lora_delta(out, x, lora, self.lora_batch)
        return out

    def lora_delta(self, out: torch.Tensor, x: torch.Tensor, lora, batch: LoRABatch) -> None:
        """out += B[slot] @ (A[slot] @ x) for each adapter token, slice by slice (torch, by group)."""
        torch_ops.lora_delta(out, x, lora.a, lora.bt, lora.slices, batch.rows, batch.groups)

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The base layer's matmul. A quantized weight (packed: runtime/quantization/load.py)
        carries `quant`, and takes `quant_linear`."""
        quant = getattr(weight, "quant", None)
        if quant is not None:
            return self.quant_linear(x, weight, quant, bias)
        return F.linear(x, weight, bias)

    def quant_linear(self, x: torch.Tensor, weight: torch.Tensor, quant, bias: torch.Tensor | None) -> torch.Tensor:
        """Torch: the weight dequantized to float32 and multiplied in x's dtype (the CPU path
        without the C kernels, which read the blocks themselves)."""
        return F.linear(x, quant.dequantize(weight).to(x.dtype), bias)

    def embedding(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The rows of an embedding table."""
        return F.embedding(ids, weight)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """The greedy token of each row of [B, V] logits (the first of equal maxima)."""
        return logits.argmax(dim=-1)

    def attention(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float,
                  sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """sliding_window: the layer's window (0: full attention); blocks wholly before it are
        not read. softcap: scores become softcap * tanh(score / softcap) (0: none)."""
        raise NotImplementedError

    def decoder_stack(self, model, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                      kv_caches: list) -> torch.Tensor | None:
        """The final normed hidden states of the whole decoder stack in one call, where this
        backend has one for the step and the model; None: the model runs layer by layer."""
        return None

    def decode_shapes(self, max_seq_len: int, device: torch.device) -> list[tuple[int, int]]:
        """(requests, context length) of the smallest decode-only step that launches each
        decode variant to compile."""
        return []

    def largest_split_decode(self, max_seq_len: int, device: torch.device) -> tuple[int, int] | None:
        """(requests, context length) of the decode-only step with the largest split-KV
        partition buffers, if this backend splits."""
        return None

    def graph_max_seq_len(self, num_seqs: int, max_context: int, device: torch.device) -> int:
        """The max_seq_len a CUDA graph of `num_seqs` decodes is captured with: 1 keeps the
        attention on its one-pass path; a backend that splits long contexts over the GPU's
        SMs at this batch size gives `max_context`, so the graph holds the split for any
        context (partitions past a request's context exit at once)."""
        return 1

    def split_buffer_bytes(self, num_seqs: int, max_seq_len: int, head_dim: int) -> int:
        """Bytes of a split-KV decode's partial results (0: this backend does not split)."""
        return 0


class _CpuOps:
    """torch_ops with the C versions of the ops that have one."""

    def __init__(self, lib: CpuKernels):
        self.rms_norm = lib.rms_norm
        self.rotary_embedding = lib.rotary_embedding
        self.silu_and_mul = lib.silu_and_mul

    def __getattr__(self, name: str):
        return getattr(torch_ops, name)


class TorchKernels(Kernels):
    """triton_kernels/torch_ops.py: the CPU path."""
    name = Backend.TORCH
    ops = torch_ops

    def __init__(self, block_size: int, num_heads: int, num_kv_heads: int):
        super().__init__(block_size, num_heads, num_kv_heads)
        self.workspace = torch_ops.Workspace()
        self.linear_plan: LinearPlan | None = None  # the matmul by rows per step, with the C kernels
        self.cpu_lib: CpuKernels | None = None
        self._stack: tuple | None = None  # (key, DecodeStack or None) of the last model seen

    def use_cpu_kernels(self, lib: CpuKernels) -> None:
        """Float32: each linear layer runs the C kernel or torch's matmul as the plan says
        (measured once the weights are in), and, where the library was built with AVX2, the
        C versions of the small ops and of paged attention replace torch's. Before the
        model is built: layers keep a reference to `ops`."""
        self.linear_plan = LinearPlan(lib)
        if lib.vectorized:
            self.ops = _CpuOps(lib)
            self.cpu_lib = lib

    def matmul(self, x, weight, bias=None):
        if self.linear_plan is None:
            return super().matmul(x, weight, bias)
        return self.linear_plan(x, weight, bias)

    def lora_delta(self, out, x, lora, batch):
        lib = self.cpu_lib
        if lib is None or out.dtype != torch.float32:
            return super().lora_delta(out, x, lora, batch)
        lib.lora(out, x, lora.a, lora.bt, lora.slice_table, batch.rows, batch.group_table)

    def embedding(self, ids, weight):
        if weight.dtype != torch.uint8:
            return F.embedding(ids, weight)
        # a tied table kept in GGUF blocks (runtime/models/weight_formats.py): the rows' blocks, widened
        rows = blocks(F.embedding(ids, weight), weight.block_format, weight.in_features)
        return self.linear_plan.kernel.multiplied(rows)

    def argmax(self, logits):
        lib = self.cpu_lib
        if lib is not None and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1:
            ids = lib.argmax(logits)
            if ids is not None:
                return ids
        return logits.argmax(dim=-1)

    def decoder_stack(self, model, x, positions, meta, kv_caches):
        """Decode steps and steps of few tokens (STACK_ROWS, STACK_PROMPT_ROWS) of a Llama-style model
        (`model.stack_weights()`) on a CPU, at a number of rows the linear plan gives to the C
        kernel: one C call for every layer (one stream of the default model: 21 -> 16 ms a step,
        a third of it was the interpreter between the kernels)."""
        lib, plan, rows = self.cpu_lib, self.linear_plan, meta.max_query_len
        if lib is None or not kv_caches or not plan.uses_kernel(x.shape[0]) or meta.lora is not None \
                or meta.key_limit is not None or rows > STACK_ROWS and x.shape[0] > STACK_PROMPT_ROWS:
            return None
        first, last = kv_caches[0][0], kv_caches[-1][1]
        key = (id(model), first.data_ptr(), last.data_ptr(), tuple(first.shape), first.dtype, len(kv_caches))
        if self._stack is None or self._stack[0] != key:
            layers, stack = model.stack_weights(), None
            if layers is not None:
                try:
                    stack = lib.decode_stack(layers, model.norm.weight, model.cfg.rms_norm_eps, kv_caches)
                except ValueError as e:  # a layout the C stack does not take: layer by layer, as before
                    logger.warning("the C decoder stack does not take this model (%s); layer by layer", e)
            self._stack = (key, stack)
        stack = self._stack[1]
        if stack is None:
            return None
        cos_sin = model.cos_sin_cache[positions]
        seq_lens, tables = meta.seq_lens, meta.block_tables
        if meta.max_query_len > 1:  # each token a decode of its own: its K/V is written before any row attends
            seq_lens = (positions + 1).to(torch.int32)
            tables = tables.repeat_interleave(meta.query_start_loc.diff(), dim=0)
        return lib.decode_layers(stack, x, cos_sin, meta.slot_mapping, tables, seq_lens, stack.head_dim ** -0.5)

    def attention(self, q, k, v, kv_cache, meta, scale, sliding_window=0, softcap=0.0):
        k_cache, v_cache = kv_cache
        if self.cpu_lib is not None and meta.key_limit is None:
            return self.cpu_lib.paged_attention(q, k, v, k_cache, v_cache, meta.slot_mapping, meta.block_tables,
                                                meta.seq_lens, scale,
                                                None if meta.max_query_len == 1 else meta.query_start_loc,
                                                sliding_window, softcap)
        torch_ops.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        plan = meta.window_plans.get(sliding_window)  # one plan per window, shared by its layers
        if plan is None:
            plan = meta.window_plans[sliding_window] = torch_ops.plan_paged_attention(
                meta.block_tables, meta.query_start_loc, meta.seq_lens, self.block_size,
                self.num_heads, self.num_kv_heads, sliding_window, meta.key_limit)
        return torch_ops.paged_attention(q, k_cache, v_cache, meta.block_tables,
                                         meta.query_start_loc, meta.seq_lens, scale, plan,
                                         self.workspace, sliding_window, softcap)


class TritonKernels(Kernels):
    """Every kernel in Triton; the CUDA path (and, under TRITON_INTERPRET=1, a slow CPU one
    for tests). Imported only when chosen: @triton.jit reads TRITON_INTERPRET when it runs."""
    name = Backend.TRITON
    compiles_kernels = True
    graph_safe = True

    def __init__(self, block_size: int, num_heads: int, num_kv_heads: int):
        super().__init__(block_size, num_heads, num_kv_heads)
        from pageserve.triton_kernels import paged_attention as attention_module
        from pageserve.triton_kernels.apply_token_bitmask import apply_token_bitmask
        from pageserve.triton_kernels.fused_moe import fused_moe
        from pageserve.triton_kernels.lora import lora_expand, lora_shrink
        from pageserve.triton_kernels.paged_attention import paged_attention
        from pageserve.triton_kernels.reshape_and_cache import reshape_and_cache
        from pageserve.triton_kernels.rms_norm import rms_norm
        from pageserve.triton_kernels.rotary_embedding import rotary_embedding
        from pageserve.triton_kernels.silu_and_mul import silu_and_mul

        self.ops = types.SimpleNamespace(
            rms_norm=rms_norm, rope_cos_sin=torch_ops.rope_cos_sin, rotary_embedding=rotary_embedding,
            silu_and_mul=silu_and_mul, apply_token_bitmask=apply_token_bitmask, fused_moe=fused_moe)
        self._reshape_and_cache = reshape_and_cache
        self._paged_attention = paged_attention
        self._lora_shrink, self._lora_expand = lora_shrink, lora_expand
        self._kernels = attention_module

    def lora_delta(self, out, x, lora, batch):
        """Punica's shrink and expand, one launch each for the whole step; they read the token
        groups from device tensors only, so a CUDA graph captures them."""
        groups = (batch.sorted_tokens, batch.group_slots, batch.group_starts, batch.group_counts)
        y = self._lora_shrink(x, lora.a, *groups)
        self._lora_expand(out, y, lora.bt.transpose(1, 2), lora.slices, *groups)

    def quant_linear(self, x, weight, quant, bias):
        """W4A16, FP4, NF4, grouped INT8 and block-wise FP8 through the Triton GEMM that unpacks and
        scales in its inner loop; per-channel FP8 and INT8 with the activations quantized per token, or with the
        checkpoint's static scale (torch's scaled matmul where the device has it)."""
        if quant.kind == "int4":
            from pageserve.triton_kernels.grouped_linear import int4_linear

            return int4_linear(x, weight, quant.scales, quant.zeros, quant.group_size, bias)
        if quant.kind in ("fp4", "nf4"):
            from pageserve.triton_kernels.grouped_linear import fp4_linear, nf4_linear

            return (fp4_linear if quant.kind == "fp4" else nf4_linear)(x, weight, quant.scales, quant.group_size, bias)
        if quant.group_size:
            from pageserve.triton_kernels.grouped_linear import fp8_group_linear, int8_group_linear

            grouped = int8_group_linear if quant.kind == "int8" else fp8_group_linear
            return grouped(x, weight, quant.scales, quant.group_size, bias)
        from pageserve.triton_kernels.scaled_linear import scaled_linear

        return scaled_linear(x, weight, quant.scales, quant.kind, bias, quant.input_scale)

    def decode_shapes(self, max_seq_len, device):
        shapes = [(1, 1)]  # the one-pass decode
        partition = self._kernels.PARTITION_SIZE
        if max_seq_len > partition and self._kernels.max_split_seqs(self.num_kv_heads, device) >= 1:
            shapes.append((1, partition + 1))  # split-KV decode and its reduce
        return shapes

    def largest_split_decode(self, max_seq_len, device):
        num_seqs = self._kernels.max_split_seqs(self.num_kv_heads, device)
        if max_seq_len <= self._kernels.PARTITION_SIZE or num_seqs < 1:
            return None
        return num_seqs, max_seq_len

    def split_buffer_bytes(self, num_seqs, max_seq_len, head_dim):
        parts = -(-max_seq_len // self._kernels.PARTITION_SIZE)
        head_pad = 1 << (head_dim - 1).bit_length()
        return num_seqs * self.num_heads * parts * (2 + head_pad) * 4  # float32 maxima, sums, partial outputs

    def graph_max_seq_len(self, num_seqs, max_context, device):
        splits = self._kernels.split_partitions(num_seqs, self.num_kv_heads, 1, max_context, device)
        return max_context if splits else 1

    def attention(self, q, k, v, kv_cache, meta, scale, sliding_window=0, softcap=0.0):
        k_cache, v_cache = kv_cache
        self._reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.key_limit is not None:  # image tokens seeing each other: prefill chunks with images only
            plan = torch_ops.plan_paged_attention(meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                                  self.block_size, self.num_heads, self.num_kv_heads,
                                                  sliding_window, meta.key_limit)
            return torch_ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                             meta.seq_lens, scale, plan, None, sliding_window, softcap)
        return self._paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                     meta.seq_lens, scale, meta.max_query_len, meta.max_seq_len,
                                     sliding_window, softcap)


def make_kernels(backend: Backend, block_size: int, num_heads: int, num_kv_heads: int) -> Kernels:
    cls = TritonKernels if backend == Backend.TRITON else TorchKernels
    return cls(block_size, num_heads, num_kv_heads)
