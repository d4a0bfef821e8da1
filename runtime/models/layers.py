"""The pieces decoder-only models share, written against the engine's kernels (RoPE tables are
rope.py's): RMSNorm, attention over the paged KV cache (fused q/k/v, optional per-head q/k
norms), the gated MLP, the sparse mixture of experts, the decoder layer, and `CausalLM`, the
model shell that every architecture file specializes (its MLP per layer, its weight names).

Tokens of the whole step are one flat [T, hidden] batch: there is no batch or padding
dimension. Weights load under Hugging Face's names; q/k/v, gate/up and the experts' matrices
are fused into one tensor each as they arrive (`CausalLM.load_weights`)."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from pageserve.runtime.config import ModelConfig
from pageserve.runtime.kernels import AttentionMetadata, Kernels
from pageserve.runtime.models import parallel
from pageserve.runtime.models.rope import rope_cos_sin_cache
from pageserve.runtime.quantization.qtensor import QuantTensor
from pageserve.triton_kernels import torch_ops


class RMSNorm(nn.Module):
    """Only the weight: the kernels' rms_norm (fused with the residual add) does the work."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps


class Attention(nn.Module):
    """q/k/v in one matmul, optional RMSNorm of each head of q and k (Qwen3), RoPE, paged
    attention (which also writes the step's K/V into the cache), the output projection."""

    def __init__(self, cfg: ModelConfig, kernels: Kernels, qk_norm: bool = False):
        super().__init__()
        self.cfg, self.kernels, self.ops = cfg, kernels, kernels.ops
        d = cfg.head_dim
        self.num_heads, self.num_kv_heads = cfg.heads_per_rank, cfg.kv_heads_per_rank  # this rank's heads
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.scale = d ** -0.5
        self.sliding_window = 0  # this layer's window (0: full attention); an architecture sets it
        self.softcap = 0.0  # attention logit soft-capping (Gemma 2)
        self.kv_scales = None  # a float8 cache's scales from the checkpoint (quantization/kv_scales.py)
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if qk_norm else None

    def _head_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        t, heads, d = x.shape
        return self.ops.rms_norm(x.reshape(t * heads, d), norm.weight, norm.eps)[0].view(t, heads, d)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor],
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cfg, linear = self.cfg, self.kernels.linear
        qkv = linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, cfg.head_dim)
        k = k.reshape(t, self.num_kv_heads, cfg.head_dim)
        v = v.reshape(t, self.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:  # written back into qkv: q, k and v stay views of one tensor,
            q.copy_(self._head_norm(q, self.q_norm))  # with the token stride the kernels
            k.copy_(self._head_norm(k, self.k_norm))  # expect of all three
        rot = cfg.rotary_dim  # all of each head, or its first values (partial rotary: the rest pass as they are)
        self.ops.rotary_embedding(q[..., :rot], k[..., :rot], *rope)
        scales = self.kv_scales
        if scales is not None:  # the cache keeps K / k_scale and V / v_scale
            q, k, v = q * scales.query, k / scales.key, v / scales.value
        attn = self.kernels.attention(q, k, v, kv_cache, meta, self.scale, self.sliding_window, self.softcap)
        if scales is not None:
            attn = attn * scales.output
        return row_parallel(linear, attn.reshape(t, self.q_size), self.o_proj, cfg.tp_size)


def row_parallel(linear, x: torch.Tensor, proj: nn.Linear, tp_size: int) -> torch.Tensor:
    """A row-parallel projection (o_proj, down_proj): the ranks' partial sums all-reduced, its
    bias (where it has one) added once, after them."""
    if tp_size == 1:
        return linear(x, proj.weight, proj.bias)
    out = parallel.all_reduce(linear(x, proj.weight), tp_size)
    return out if proj.bias is None else out + proj.bias


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up in one matmul; biases where the checkpoint has
    them (Llama's mlp_bias)."""

    def __init__(self, hidden_size: int, intermediate_size: int, kernels: Kernels, tp_size: int = 1,
                 reduce: bool = True, bias: bool = False):
        """tp_size > 1: this rank's slice of the intermediate size (runtime/models/parallel.py);
        reduce=False leaves the partial sums to the caller's all-reduce (a shared expert)."""
        super().__init__()
        if bias and not reduce:
            raise ValueError("a shared expert's MLP with biases")
        self.kernels, self.ops = kernels, kernels.ops
        self.tp_size = tp_size if reduce else 1
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size // tp_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size // tp_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = self.kernels.linear
        act = self.ops.silu_and_mul(linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias))
        return row_parallel(linear, act, self.down_proj, self.tp_size)


class Experts(nn.Module):
    """Every expert's gated MLP stacked: w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I];
    under tensor parallelism I is this rank's slice of each expert's intermediate size."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # a quantized checkpoint's experts: "w13" / "w2" -> each expert's matrix as the kernels'
        # matmul takes it (runtime/quantization/load.py), the stacked parameters holding them
        self.parts: dict[str, list[torch.Tensor]] = {}

    def weights(self) -> tuple:
        """(w13, w2) as fused_moe indexes them by expert: the stacked tensors, or the lists of
        quantized matrices."""
        return self.parts.get("w13", self.w13), self.parts.get("w2", self.w2)


class SparseMoE(nn.Module):
    """A router picks top_k of num_experts per token (softmax over all experts, then the top
    k; `normalize` rescales their weights to sum to one, as Mixtral and Qwen3-MoE do), the
    experts run through the kernels' fused_moe; an optional shared expert, scaled by a
    sigmoid gate of its own, is added (Qwen2-MoE). With tp_size > 1 each rank holds every
    expert's slice of the intermediate size and the whole router, so every rank routes alike;
    the experts' and the shared expert's partial sums are all-reduced once, at the end."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 normalize: bool, kernels: Kernels, shared_intermediate_size: int = 0, tp_size: int = 1):
        super().__init__()
        self.kernels, self.ops = kernels, kernels.ops
        self.top_k, self.normalize, self.tp_size = top_k, normalize, tp_size
        self.intermediate_size, self.shared_intermediate_size = intermediate_size, shared_intermediate_size
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden_size, intermediate_size // tp_size)
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, kernels, tp_size, reduce=False)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = self.kernels.linear
        probs = linear(x, self.gate.weight).float().softmax(dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.experts.parts:  # quantized experts: one matmul an expert, as each kernel path takes the matrix
            out = torch_ops.fused_moe(x, *self.experts.weights(), weights, ids, linear=self.kernels.matmul)
        else:
            out = self.ops.fused_moe(x, self.experts.w13, self.experts.w2, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(linear(x, self.shared_expert_gate.weight)) * self.shared_expert(x)
        return parallel.all_reduce(out, self.tp_size)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: Kernels, mlp: nn.Module, qk_norm: bool = False):
        super().__init__()
        self.cfg, self.ops = cfg, kernels.ops
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, kernels, qk_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor],
                rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        eps = self.cfg.rms_norm_eps
        x, residual = self.ops.rms_norm(x, self.input_layernorm.weight, eps, residual)
        x = self.self_attn(x, meta, kv_cache, rope)
        x, residual = self.ops.rms_norm(x, self.post_attention_layernorm.weight, eps, residual)
        return self.mlp(x), residual


# Hugging Face names whose tensors are parts of one of ours: q/k/v stack into qkv_proj,
# gate/up into gate_up_proj, and each expert's gate/up/down into the experts' w13 and w2
_LAYER = re.compile(r"layers\.(\d+)\.")
_QKV = re.compile(r"(.+)\.([qkv])_proj\.(weight|bias)")
_GATE_UP = re.compile(r"(.+)\.(gate|up)_proj\.(weight|bias)")
_EXPERT = re.compile(r"(.+)\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm, lm_head (or the tied embedding). An
    architecture file says what differs: `mlp(cfg, layer)` (the feed-forward of each layer),
    `qk_norm`, and `rename` (its checkpoint's names onto the layout above)."""
    qk_norm = False
    towers: tuple[str, ...] = ()  # submodules a multimodal model loads itself (its vision encoder)

    def __init__(self, cfg: ModelConfig, kernels: Kernels):
        super().__init__()
        self.cfg, self.ops, self.kernels = cfg, kernels.ops, kernels
        self.embed_tokens = parallel.embedding(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg, kernels, self.mlp(cfg, i), self.qk_norm)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, parallel.vocab_rows(cfg),
                                                                      bias=False)
        self.register_buffer("cos_sin_cache", rope_cos_sin_cache(cfg), persistent=False)

    def mlp(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, self.kernels, cfg.tp_size, bias=cfg.mlp_bias)

    @staticmethod
    def rename(name: str) -> str:
        """A checkpoint tensor's name (without "model.") in this file's layout."""
        return name

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                images: tuple[torch.Tensor, torch.Tensor] | None = None,
                carry: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Final hidden states (after the last norm) of every token of the step. `images`:
        (rows, embeddings) that replace those rows' token embeddings (image tokens). A pipeline
        stage runs its own layers (`kv_caches` are theirs): the first from the tokens, the
        others from `carry`, the previous stage's (hidden, residual); every stage but the last
        returns its (hidden, residual) for the next."""
        if carry is None:
            x, residual = self.embed(input_ids, images), None
            stacked = self.kernels.decoder_stack(self, x, positions, meta, kv_caches)
            if stacked is not None:
                return stacked
        else:
            x, residual = carry
        layers = self.stage()
        for layer, kv_cache, rope in zip(layers, kv_caches, self.layer_ropes(layers, positions, x.dtype)):
            x, residual = layer(x, residual, meta, kv_cache, rope)
        if not self.cfg.last_stage:
            return x, residual
        x, _ = self.ops.rms_norm(x, self.norm.weight, self.cfg.rms_norm_eps, residual)
        return x

    def stage(self) -> list[nn.Module]:
        """The decoder layers this process runs (all of them but under pipeline parallelism)."""
        return [self.layers[i] for i in self.cfg.stage_layers]

    def layer_ropes(self, layers: list[nn.Module], positions: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
        """Each layer's RoPE rows for the step's positions (computed once per step)."""
        return [self.ops.rope_cos_sin(positions, self.cos_sin_cache, dtype)] * len(layers)

    def keep_stage(self) -> None:
        """Pipeline parallelism: drop what this stage does not run (before any weight loads):
        the other stages' layers (placeholders, so that layer i keeps its name), the embedding
        but on the first stage (and on the last where it is the tied lm_head), lm_head but on
        the last."""
        cfg = self.cfg
        if cfg.pp_size == 1:
            return
        for i in range(len(self.layers)):
            if i not in cfg.stage_layers:
                self.layers[i] = nn.Module()
        if not cfg.first_stage and not (cfg.last_stage and self.lm_head is None):
            self.embed_tokens = None
        if not cfg.last_stage:
            self.lm_head = None

    def holds(self, name: str) -> bool:
        """Whether this stage keeps the checkpoint tensor `name` (in this file's layout)."""
        if m := _LAYER.match(name):
            return int(m.group(1)) in self.cfg.stage_layers
        return self.embed_tokens is not None or not name.startswith("embed_tokens.")

    def stack_weights(self) -> list[tuple] | None:
        """Per layer (input norm, qkv weight, qkv bias or None, o_proj, post-attention norm,
        gate_up, down, q norm and k norm or Nones), where every layer is exactly this file's
        DecoderLayer with a GatedMLP, no window, soft cap, o_proj or MLP bias, KV-cache scales, partial rotary or other
        attention scale than head_dim ** -0.5, on one rank, and the model runs this class's forward:
        the layers a backend may run as one decoder stack (Kernels.decoder_stack). Else None."""
        if type(self).forward is not CausalLM.forward or self.cfg.tp_size != 1 or self.cfg.pp_size != 1 \
                or type(self).layer_ropes is not CausalLM.layer_ropes or self.cfg.rotary_dim != self.cfg.head_dim:
            return None
        out = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if type(layer) is not DecoderLayer or type(mlp) is not GatedMLP or type(attn) is not Attention \
                    or attn.sliding_window or attn.softcap or attn.kv_scales is not None \
                    or attn.scale != self.cfg.head_dim ** -0.5 \
                    or attn.o_proj.bias is not None or mlp.gate_up_proj.bias is not None:
                return None
            heads = (None, None) if attn.q_norm is None else (attn.q_norm.weight, attn.k_norm.weight)
            out.append((layer.input_layernorm.weight, attn.qkv_proj.weight, attn.qkv_proj.bias, attn.o_proj.weight,
                        layer.post_attention_layernorm.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight, *heads))
        return out

    def embed(self, input_ids: torch.Tensor, images: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The token embeddings in the activations' dtype (the norms'): a tied embedding may be
        kept in bfloat16 or GGUF blocks under float32 activations (weight_formats.py). `images`:
        (rows, embeddings) written over those rows."""
        if type(self.embed_tokens) is nn.Embedding:
            x = self.kernels.embedding(input_ids, self.embed_tokens.weight).to(self.norm.weight.dtype)
        else:
            x = self.embed_tokens(input_ids)
        if images is not None:
            rows, values = images
            x[rows] = values.to(x.dtype)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return parallel.gather_logits(self.kernels.linear(hidden, weight).float(), self.cfg)

    def _target(self, name: str) -> tuple[str, tuple]:
        """Our parameter and the index inside it that a checkpoint tensor fills."""
        if m := _EXPERT.fullmatch(name):
            prefix, e, part = m.group(1), int(m.group(2)), m.group(3)
            inter = self.get_submodule(f"{prefix}.experts").intermediate_size
            if part == "down":
                return f"{prefix}.experts.w2", (e,)
            return f"{prefix}.experts.w13", (e, slice(0, inter) if part == "gate" else slice(inter, 2 * inter))
        if m := _QKV.fullmatch(name):
            prefix, part, kind = m.groups()
            attn = self.get_submodule(prefix)
            start = {"q": 0, "k": attn.q_size, "v": attn.q_size + attn.kv_size}[part]
            rows = attn.q_size if part == "q" else attn.kv_size
            return f"{prefix}.qkv_proj.{kind}", (slice(start, start + rows),)
        if m := _GATE_UP.fullmatch(name):
            prefix, part, kind = m.groups()
            inter = self.get_submodule(prefix).down_proj.in_features
            return f"{prefix}.gate_up_proj.{kind}", (slice(0, inter) if part == "gate" else slice(inter, 2 * inter),)
        return name, ()

    def checkpoint_target(self, name: str) -> str | None:
        """Our parameter that the checkpoint tensor `name` fills (None: none of ours)."""
        try:
            return self._target(self.rename(name.removeprefix("model.")))[0]
        except AttributeError:
            return None

    def checkpoint_held(self, name: str) -> bool:
        """Whether this pipeline stage keeps the checkpoint tensor `name`."""
        return self.holds(self.rename(name.removeprefix("model.")))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take Hugging Face tensor names; fuse q/k/v, gate/up and the experts as they arrive.
        Every element of every parameter must be written exactly once."""
        params = {n: p for n, p in self.named_parameters() if not n.startswith(self.towers)}
        written = dict.fromkeys(params, 0)
        seen: set[tuple[str, str]] = set()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            try:
                renamed = self.rename(name.removeprefix("model."))
                if not self.holds(renamed):  # another pipeline stage's
                    continue
                tensor = parallel.shard(renamed, tensor, self.cfg)  # this rank's part (all of it at TP 1)
                target, index = self._target(renamed)
            except AttributeError:  # a prefix naming no module of ours
                raise ValueError(f"unexpected weight {name}") from None
            if target not in params:
                raise ValueError(f"unexpected weight {name}")
            if isinstance(tensor, QuantTensor):  # a quantized layer's storage (runtime/quantization/load.py)
                loader = getattr(self.get_submodule(target.rpartition(".")[0]), "quant_load", None)
                if loader is None:
                    raise ValueError(f"weight {name} is quantized, but {target} is not a quantized layer")
                if (target, repr(index)) in seen:
                    raise ValueError(f"weight {name} fills a part of {target} that another tensor filled")
                seen.add((target, repr(index)))
                module = target.rpartition(".")[0]
                for part, count in loader.write(target, index, tensor).items():
                    written[f"{module}.{part}"] += count
                continue
            owner = getattr(self.get_submodule(target.rpartition(".")[0]), "quant_load", None)
            if owner is not None and target in owner.layers:
                raise ValueError(f"weight {name} is not quantized, but other parts of {target} are: a layer "
                                 "(or a block of experts) quantized in part is not supported")
            dst = params[target][index]
            if dst.shape != tensor.shape:
                raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            if (target, repr(index)) in seen:
                raise ValueError(f"weight {name} fills a part of {target} that another tensor filled")
            seen.add((target, repr(index)))
            dst.copy_(tensor)
            written[target] += dst.numel()
        short = [n for n, p in params.items() if written[n] != p.numel()]
        if short:
            raise ValueError(f"checkpoint is missing weights (or repeats them): {', '.join(short[:4])}"
                             + (f" and {len(short) - 4} more" if len(short) > 4 else ""))
