"""Float32 kernels for the CPU path in C: the linear layer over float32, bfloat16 or blocks of
32 values (cpu_blocks.py's formats; cpu_linear.c); RMSNorm with the residual, rotary embedding,
SiLU-and-mul, causal paged attention of any step, and the whole decoder stack of a Llama-style
model for a decode-only step in one call (cpu_kernels.c). linear_plan.py chooses between the C
linear and torch's matmul by the number of rows in a step.

The C files are compiled once per machine (cpu_build.py) into a cache folder the caller names,
and called through ctypes (which releases the GIL). Where there is no compiler, or the build
fails, `load` returns None and the engine keeps torch's matmul: the kernel is a speed-up, never
a requirement."""

from __future__ import annotations

import ctypes
import logging
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pageserve.triton_kernels.cpu_blocks import BLOCK_FORMATS, blocks, in_features, weight_format
from pageserve.triton_kernels.cpu_build import FLAGS, build, build_key, source_files, untrusted

__all__ = ["BLOCK_FORMATS", "blocks", "in_features", "weight_format", "CpuKernels", "DecodeStack", "load"]

logger = logging.getLogger(__name__)


# bytes of weights laid out for AMX tiles (CpuKernels.packed) a process keeps at most: past it,
# each step of 16 rows or more widens and lays out a matrix again (about a quarter of a 64-row
# step of the default model); the default model's copies take 270 MB
def _packed_budget() -> int:
    try:
        return int(float(os.environ.get("PAGESERVE_AMX_PACKED_GIB", "1")) * 2**30)
    except ValueError:
        logger.warning("PAGESERVE_AMX_PACKED_GIB=%r is not a number of GiB: 1 GiB",
                       os.environ["PAGESERVE_AMX_PACKED_GIB"])
        return 2**30


PACKED_BUDGET = _packed_budget()
_packed = {"bytes": 0, "full": False}  # the copies held now; whether the budget has turned one away


def _unpacked(nbytes: int) -> None:
    _packed["bytes"] -= nbytes


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """t as [rows, last] with unit stride along the last dimension (copied only if needed).
    The model's tensors are already so: that case costs no new tensor (a view or a reshape
    costs microseconds, and a decode step makes hundreds of these calls)."""
    if t.dtype != torch.float32 or not t.is_cpu:
        raise TypeError(f"{name}: the CPU kernels take float32 CPU tensors, got {t.dtype} on {t.device}")
    if t.dim() == 2 and t.stride(1) == 1:
        return t
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


# what the attention's KV cache may hold, in the order of the C kernels' kv_format codes
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)


class CpuKernels:
    """The compiled library. `linear` is F.linear; `rms_norm`, `rotary_embedding` and
    `silu_and_mul` are torch_ops' functions of the same names, for float32 CPU tensors.
    bf16_dot: bfloat16 arithmetic (ValueError where the build has no AVX512-BF16): every matmul
    rounds x and the weights to bfloat16 and sums their products in float32 (vdpbf16ps), and
    every op rounds its output to bfloat16 where torch's bfloat16 op would; the tensors stay
    float32."""

    def __init__(self, path: Path, bf16_dot: bool = False):
        torch.get_num_threads()  # torch (and its libgomp) first: the kernels share that runtime
        lib = ctypes.CDLL(str(path))
        p, n, f = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
        i = ctypes.c_int
        # a library built before the AMX layouts (an A/B benchmark's base commit) lacks them, and
        # its decoder stack takes no `packed`
        self._layouts = hasattr(lib, "pageserve_pack_amx")
        stack_args = [p, n, n, n, p, p, *([p] if self._layouts else []), p, i, p, f, p, n, p, p, n, p, n, n, n, n, n, f,
                      p, p]
        for name, args in (("pageserve_linear", [p, n, n, n, p, i, n, n, p, p, n]),
                           ("pageserve_widen", [p, i, n, n, n, p]),
                           ("pageserve_rms_norm", [p, n, p, n, p, f, n, n, p, p, n, i]),
                           ("pageserve_rotary", [p, n, n, n, n, n, p, n, i]),
                           ("pageserve_silu_and_mul", [p, n, n, n, p, i]),
                           ("pageserve_paged_attention", [p, n, p, p, n, p, p, p, n, p, n, p, p, n, n, n, n, n, f,
                                                          p, i, i, n, f]),
                           ("pageserve_argmax", [p, n, n, n, p]),
                           ("pageserve_lora", [p, n, n, p, n, n, p, n, p, n, p, n, p, p, n, p]),
                           *((("pageserve_linear_packed", [p, n, n, n, p, i, n, n, p, p, p, n]),
                              ("pageserve_pack_amx", [p, i, n, n, n, p])) if self._layouts else ()),
                           ("pageserve_decode_layers", stack_args)):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, None
        for name in ("pageserve_linear", "pageserve_paged_attention", "pageserve_decode_layers", "pageserve_argmax",
                     *(("pageserve_linear_packed", "pageserve_pack_amx") if self._layouts else ())):
            getattr(lib, name).restype = ctypes.c_int
        # the layouts' sizes (a library from before the 4-bit layouts writes bfloat16 tiles alone, no header)
        self._packed_bytes = getattr(lib, "pageserve_packed_bytes", None)
        if self._packed_bytes is not None:
            self._packed_bytes.argtypes, self._packed_bytes.restype = [i, n, n], n
        # where a weight keeps its layout: one attribute per generation of layouts (a benchmark
        # loads two builds in one process)
        self._packed_attr = "_amx_packed" if self._packed_bytes is not None else "_amx_packed_bf16"
        lib.pageserve_vectorized.restype = ctypes.c_int
        lib.pageserve_has_bf16_dot.restype = ctypes.c_int
        lib.pageserve_isa.restype = ctypes.c_char_p
        # built with AVX2 + FMA: without them the small ops are plain loops (libm's expf a
        # value), not worth putting in torch's place; only the timed linear is used then
        self.vectorized = bool(lib.pageserve_vectorized())
        self.has_bf16_dot = bool(lib.pageserve_has_bf16_dot())
        self.isa = lib.pageserve_isa().decode()  # the vector instructions it was built for
        self.amx = self.isa.endswith("and AMX")  # AMX tiles from 16 rows (bfloat16 arithmetic)
        if bf16_dot and not self.has_bf16_dot:
            raise ValueError(f"the CPU kernels have no bfloat16 dot product on this CPU ({self.isa})")
        self.bf16_dot = bf16_dot
        # the bit or'ed into a format code for bfloat16 arithmetic, as the library has it (the A/B
        # benchmarks load libraries built from older commits, whose bit is 16)
        try:
            lib.pageserve_dot16_flag.restype = ctypes.c_int
            dot16 = lib.pageserve_dot16_flag()
        except AttributeError:
            dot16 = 16
        self._dot = dot16 if bf16_dot else 0
        self._lib = lib
        self.path = path

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear of float32 x; the weight float32, bfloat16 or in blocks
        (`weight_format`), widened as it is read: the same sums as of its float32 values, bit
        for bit."""
        fmt, k_w = weight_format(weight)
        x2 = _rows(x, "linear")
        rows, k = x2.shape
        out_features = weight.shape[0]
        if k != k_w or weight.stride(1) != 1 or (bias is not None and not (
                bias.is_contiguous() and bias.dtype == torch.float32 and bias.is_cpu and bias.numel() == out_features)):
            raise ValueError(f"cpu linear: x {tuple(x.shape)} against weight {tuple(weight.shape)} "
                             f"with strides {weight.stride()}")
        out = torch.empty((*x.shape[:-1], out_features), dtype=torch.float32)  # [rows, O] in memory
        packed = self.packed(weight) if rows >= 16 else None
        args = (x2.data_ptr(), rows, k, x2.stride(0), weight.data_ptr(), fmt | self._dot, out_features,
                weight.stride(0))
        if self._lib.pageserve_linear(*args, None if bias is None else bias.data_ptr(), out.data_ptr(), out_features) \
                if packed is None else self._lib.pageserve_linear_packed(
                    *args, packed.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(), out_features):
            raise MemoryError("cpu linear: no memory for its scratch (widened weights, panels of x)")
        return out

    def packed(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The weight laid out for the AMX tiles (pageserve_pack_amx: rounded to bfloat16, or
        Q4_1 and Q4_0 blocks' codes in the tiles' order, widened a group of rows at a time as they
        are multiplied), which `linear` then reads at 16 rows and more instead of widening the
        matrix each call: made on first use and kept on the weight, and made again where the weight was written
        through itself (its version) or given other memory since; a write through `.data`, or
        after a decoder stack was built, goes unseen (the engine writes weights only while
        loading). None without AMX or bfloat16 arithmetic, for an inference-mode tensor (no
        version to check), or past the budget."""
        if not (self.amx and self.bf16_dot and self._layouts) or weight.is_inference():
            return None
        held = getattr(weight, self._packed_attr, None)
        if held is not None and held[1:] == (weight._version, weight.data_ptr()):
            return held[0]
        fmt, k = weight_format(weight)
        nbytes = 2048 * ((k + 31) // 32) * ((weight.shape[0] + 31) // 32) if self._packed_bytes is None \
            else self._packed_bytes(fmt, k, weight.shape[0])
        if _packed["bytes"] + nbytes > PACKED_BUDGET:
            if not _packed["full"]:
                _packed["full"] = True
                logger.info("AMX: %.0f MiB of weights laid out for the tiles, the most PAGESERVE_AMX_PACKED_GIB "
                            "allows; the rest are laid out at each step", _packed["bytes"] / 2**20)
            return None
        out = torch.empty(nbytes // 4, dtype=torch.int32)
        if self._lib.pageserve_pack_amx(weight.data_ptr(), fmt, k, weight.shape[0], weight.stride(0), out.data_ptr()):
            return None
        _packed["bytes"] += nbytes
        weakref.finalize(out, _unpacked, nbytes)
        setattr(weight, self._packed_attr, (out, weight._version, weight.data_ptr()))
        return out

    def widen(self, weight: torch.Tensor) -> torch.Tensor:
        """A weight's float32 values [rows, in_features] (`weight_format`)."""
        fmt, k = weight_format(weight)
        if weight.stride(1) != 1:
            raise ValueError(f"widen: a weight with strides {weight.stride()}")
        out = torch.empty(weight.shape[0], k, dtype=torch.float32)
        self._lib.pageserve_widen(weight.data_ptr(), fmt, weight.shape[0], k, weight.stride(0), out.data_ptr())
        return out

    def multiplied(self, weight: torch.Tensor) -> torch.Tensor:
        """The float32 values `linear` multiplies by: the widened weight, rounded to bfloat16
        with bf16_dot (for torch's matmul where it runs instead, and a tied embedding's rows)."""
        wide = self.widen(weight) if weight.dtype == torch.uint8 else weight.float()
        return wide.bfloat16().float() if self.bf16_dot else wide

    __call__ = linear

    def argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """x.argmax(dim=-1) of float32 rows [R, V] (the first of equal values), or None where
        a row holds a NaN (torch's answer is then wanted)."""
        x2 = _rows(x, "argmax")
        out = torch.empty(x2.shape[0], dtype=torch.int64)
        if x2.shape[1] == 0 or self._lib.pageserve_argmax(x2.data_ptr(), x2.shape[0], x2.shape[1], x2.stride(0),
                                                          out.data_ptr()):
            return None
        return out.view(x.shape[:-1])

    def lora(self, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, slices: torch.Tensor,
             rows: torch.Tensor, groups: torch.Tensor) -> None:
        """torch_ops.lora_delta of float32 tensors in one call: a [S, L, K], bt [S, R, N] (B
        transposed), slices and groups int64 [n, 3] tables on the host."""
        x2 = _rows(x, "lora")
        if out.stride(1) != 1 or not (a.is_contiguous() and bt.is_contiguous()) or a.shape[2] != x2.shape[1] \
                or bt.shape[2] != out.shape[1] or a.dtype != torch.float32 or bt.dtype != torch.float32:
            raise ValueError(f"cpu lora: x {tuple(x.shape)}, out {tuple(out.shape)}, a {tuple(a.shape)}, "
                             f"bt {tuple(bt.shape)}")
        scratch = torch.empty(rows.shape[0], a.shape[1], dtype=torch.float32)
        self._lib.pageserve_lora(x2.data_ptr(), x2.stride(0), x2.shape[1], out.data_ptr(), out.stride(0), out.shape[1],
                                 a.data_ptr(), a.shape[1], bt.data_ptr(), bt.shape[1], slices.data_ptr(),
                                 slices.shape[0], rows.data_ptr(), groups.data_ptr(), groups.shape[0],
                                 scratch.data_ptr())

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        x2 = _rows(x, "rms_norm")
        r2 = None if residual is None else _rows(residual, "rms_norm")
        if weight.dtype != torch.float32 or not weight.is_cpu or not weight.is_contiguous() or weight.numel() != x2.shape[1] \
                or (r2 is not None and r2.shape != x2.shape):
            raise ValueError(f"rms_norm: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                             f"residual {None if residual is None else tuple(residual.shape)}")
        t, h = x2.shape
        shape = tuple(x.shape)
        out = torch.empty(shape, dtype=torch.float32)  # [t, h] in memory
        res = torch.empty(shape, dtype=torch.float32)
        self._lib.pageserve_rms_norm(x2.data_ptr(), x2.stride(0), None if r2 is None else r2.data_ptr(),
                                     0 if r2 is None else r2.stride(0), weight.data_ptr(), eps, t, h,
                                     out.data_ptr(), res.data_ptr(), h, self.bf16_dot)
        return out, res

    def rotary_embedding(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """In place on q [T, H, R] and k [T, Hkv, R] (views of the fused qkv rows are fine, and of
        each head's first R values: partial rotary); cos and sin: the halves of one [T, R] row
        (torch_ops.rope_cos_sin's views)."""
        t, _, d = q.shape
        if cos.dtype != torch.float32 or not cos.is_cpu or cos.stride(-1) != 1 or cos.shape[0] != t \
                or cos.shape[-1] != d // 2 or sin.data_ptr() != cos.data_ptr() + 4 * (d // 2) \
                or cos.stride(0) != sin.stride(0):
            raise ValueError("rotary_embedding: cos and sin must be the two halves of one float32 row")
        for x in (q, k):
            if x.dtype != torch.float32 or not x.is_cpu or x.stride(2) != 1 or x.stride(1) < d \
                    or x.shape[0] != t or x.shape[2] != d:
                raise ValueError(f"rotary_embedding: {tuple(x.shape)} with strides {x.stride()}")
            self._lib.pageserve_rotary(x.data_ptr(), t, x.shape[1], x.stride(0), x.stride(1), d, cos.data_ptr(),
                                       cos.stride(0), self.bf16_dot)

    def paged_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float,
                        query_start_loc: torch.Tensor | None = None, sliding_window: int = 0,
                        softcap: float = 0.0) -> torch.Tensor:
        """Any step: reshape_and_cache (a negative slot writes nothing), then causal paged
        attention straight from the cache blocks, with no gathered copy: each query token sees
        its own position and every one before it. query_start_loc [B + 1] int32: request b's
        query tokens are rows query_start_loc[b]:query_start_loc[b + 1], the last of its
        seq_lens[b] positions; None: one token per request (a decode step). The block tables
        must cover each request's seq_lens (the engine's invariant; not checked here, it would
        cost a pass over the tables a layer). q: [T, H, D]; k, v: [T, Hkv, D] (views of the
        fused qkv rows are fine); caches [N, Hkv, block_size, D], float32, bfloat16 or float8
        e4m3fn (a new K or V value rounded to nearest even as it is written, as torch rounds it,
        an old one widened exactly as it is read: the arithmetic does not depend on it).
        sliding_window > 0: each token sees its last sliding_window positions only, and no
        block wholly before them is read (its table entry may be a placeholder). softcap > 0:
        each score (after the scale) becomes softcap * tanh(score / softcap), as Gemma 2's."""
        t, h, d = q.shape
        b = block_tables.shape[0]
        hkv, bs = k_cache.shape[1], k_cache.shape[2]
        ok = (q.dtype == k.dtype == v.dtype == torch.float32 and k_cache.dtype == v_cache.dtype in KV_DTYPES
              and q.is_cpu and k.is_cpu and k_cache.is_cpu and v_cache.is_cpu and block_tables.is_cpu
              and k_cache.shape[3] == d and v_cache.shape == k_cache.shape
              and q.stride(2) == 1 and q.stride(1) == d and k.shape == v.shape == (t, hkv, d)
              and k.stride() == v.stride() and k.stride(2) == 1 and k.stride(1) == d
              and k_cache.is_contiguous() and v_cache.is_contiguous() and h % hkv == 0 and h // hkv <= 64
              and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() and slot_mapping.numel() == t
              and block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
              and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous() and seq_lens.numel() == b
              and (b == t if query_start_loc is None else (
                  query_start_loc.dtype == torch.int32 and query_start_loc.is_contiguous()
                  and query_start_loc.numel() == b + 1 and query_start_loc.is_cpu)))
        if not ok:
            raise ValueError(f"paged_attention: q {tuple(q.shape)} {q.dtype} {q.stride()}, k {tuple(k.shape)} "
                             f"{k.stride()}, cache {tuple(k_cache.shape)}, block tables {tuple(block_tables.shape)}")
        out = torch.empty(t, h, d, dtype=torch.float32)
        failed = self._lib.pageserve_paged_attention(
            q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0), k_cache.data_ptr(),
            v_cache.data_ptr(), slot_mapping.data_ptr(), t, block_tables.data_ptr(), block_tables.stride(0),
            None if query_start_loc is None else query_start_loc.data_ptr(), seq_lens.data_ptr(), b, h, hkv, d,
            bs, scale, out.data_ptr(), self.bf16_dot, KV_DTYPES.index(k_cache.dtype), max(sliding_window, 0),
            max(softcap, 0.0))
        if failed:
            raise MemoryError("paged_attention: no memory for the attention scores")
        return out

    def paged_decode(self, q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale) -> torch.Tensor:
        """paged_attention of a decode-only step (one query token per request)."""
        return self.paged_attention(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale)

    def decode_stack(self, layers: list[tuple[torch.Tensor, ...]], final_norm: torch.Tensor, eps: float,
                     kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> "DecodeStack":
        """The decoder stack of a Llama-style model for `decode_layers`: per layer its input
        norm, qkv weight, qkv bias (or None), o_proj, post-attention norm, gate_up and down
        weights, and optionally the q and k norms of each head (Qwen3) (contiguous; the norms and
        the bias float32, each matrix in any `weight_format`), and its K/V caches, held by address
        only: a stack is for the caches it was built with (TorchKernels.decoder_stack keys it on them)."""
        layers = [tuple(lw) + (None,) * (9 - len(lw)) for lw in layers]  # no q/k norms
        first = layers[0]
        mats = (1, 3, 5, 6)  # the matrices' places in a layer's tuple

        def dims(lw):  # the shape of each, in values; its format
            try:
                return [(t.shape[0], weight_format(t)[1]) if j in mats else None if t is None else tuple(t.shape)
                        for j, t in enumerate(lw)], [weight_format(lw[j])[0] for j in mats]
            except TypeError as e:
                raise ValueError(f"decode_stack: {e}") from None

        shapes = dims(first)[0]
        hidden, qkv, inter = shapes[0][0], shapes[1][0], shapes[6][1]
        caches = [c for pair in kv_caches for c in pair]
        if len(kv_caches) != len(layers) or any(c.dtype != caches[0].dtype or not c.is_contiguous() or c.dim() != 4
                                                or c.shape != caches[0].shape for c in caches) \
                or caches[0].dtype not in KV_DTYPES:
            raise ValueError("decode_stack: one pair of contiguous caches per layer, all of one dtype of KV_DTYPES")
        _, hkv, block_size, head_dim = caches[0].shape
        heads = qkv // head_dim - 2 * hkv
        if qkv % head_dim or heads <= 0 or heads % hkv or heads // hkv > 64 or shapes[1][1] != hidden \
                or shapes[3] != (hidden, heads * head_dim) or shapes[5] != (2 * inter, hidden) \
                or shapes[6] != (hidden, inter) or (first[2] is not None and shapes[2] != (qkv,)) \
                or (first[7] is None) != (first[8] is None) or shapes[7] not in (None, (head_dim,)) \
                or shapes[8] not in (None, (head_dim,)):
            raise ValueError(f"decode_stack: {heads} query heads over {hkv} KV heads of {head_dim}, "
                             f"weights {shapes}")
        formats = []
        for lw in layers:
            layer_shapes, layer_formats = dims(lw)
            formats += layer_formats
            if layer_shapes != shapes or any(t is not None and (not t.is_cpu or not t.is_contiguous() or (
                    j not in mats and t.dtype != torch.float32)) for j, t in enumerate(lw)):
                raise ValueError(f"decode_stack: layers differ or are not contiguous, float32 but the matrices: "
                                 f"{layer_shapes}")
        if not (final_norm.dtype == torch.float32 and final_norm.is_contiguous() and final_norm.numel() == hidden):
            raise ValueError("decode_stack: the final norm")
        ptr = ctypes.c_void_p
        weights = (ptr * (9 * len(layers)))(*(None if t is None else t.data_ptr() for lw in layers for t in lw))
        packed = [self.packed(lw[j]) for lw in layers for j in mats]  # AMX layouts: the stack keeps them alive
        kv = (ptr * len(caches))(*(c.data_ptr() for c in caches))
        formats = (ctypes.c_int * len(formats))(*(f | self._dot for f in formats))
        layouts = (ptr * len(packed))(*(None if t is None else t.data_ptr() for t in packed))
        return DecodeStack(weights, formats, layouts, kv, KV_DTYPES.index(caches[0].dtype), final_norm, eps, hidden,
                           len(layers), heads, hkv, head_dim, inter, block_size, [layers, packed], torch.empty(0))

    def decode_layers(self, stack: "DecodeStack", x: torch.Tensor, cos_sin: torch.Tensor, slot_mapping: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
        """A decode-only step (one token per request) through the whole stack in one call: x
        [T, hidden] the embeddings, cos_sin [T, head_dim] (cos then sin of each token's
        position); returns the final normed hidden states [T, hidden]. The same values as the
        layer-by-layer path over this library's kernels (linear, rms_norm, rotary, paged_decode,
        silu_and_mul), bit for bit."""
        t = x.shape[0]
        ok = (x.dtype == cos_sin.dtype == torch.float32 and x.is_contiguous() and x.shape == (t, stack.hidden)
              and cos_sin.shape == (t, stack.head_dim) and cos_sin.stride(1) == 1
              and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() and slot_mapping.numel() == t
              and block_tables.dtype == torch.int32 and block_tables.stride(1) == 1 and block_tables.shape[0] == t
              and seq_lens.dtype == torch.int32 and seq_lens.is_contiguous() and seq_lens.numel() == t)
        if not ok:
            raise ValueError(f"decode_layers: x {tuple(x.shape)}, cos_sin {tuple(cos_sin.shape)}, "
                             f"block tables {tuple(block_tables.shape)}")
        out = torch.empty_like(x)
        qkv = (stack.heads + 2 * stack.kv_heads) * stack.head_dim
        need = t * (3 * stack.hidden + qkv + stack.heads * stack.head_dim + 3 * stack.intermediate)
        if stack.scratch.numel() < need:
            stack.scratch = torch.empty(need, dtype=torch.float32)
        failed = self._lib.pageserve_decode_layers(
            x.data_ptr(), t, stack.hidden, stack.num_layers, stack.weights, stack.formats,
            *((stack.packed,) if self._layouts else ()), stack.kv, stack.kv_format,
            stack.final_norm.data_ptr(),
            stack.eps, cos_sin.data_ptr(), cos_sin.stride(0), slot_mapping.data_ptr(), block_tables.data_ptr(),
            block_tables.stride(0), seq_lens.data_ptr(), stack.heads, stack.kv_heads, stack.head_dim,
            stack.intermediate, stack.block_size, scale, stack.scratch.data_ptr(), out.data_ptr())
        if failed:
            raise MemoryError("decode_layers: no memory for the attention scores or a widened weight")
        return out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        x2 = _rows(x, "silu_and_mul")
        t, two_i = x2.shape
        out = torch.empty((*x.shape[:-1], two_i // 2), dtype=torch.float32)  # [t, I] in memory
        self._lib.pageserve_silu_and_mul(x2.data_ptr(), x2.stride(0), t, two_i // 2, out.data_ptr(), self.bf16_dot)
        return out


@dataclass(slots=True)
class DecodeStack:
    """What `CpuKernels.decode_layers` needs of a model, built once: the addresses of every
    layer's weights and caches, and the sizes."""
    weights: ctypes.Array
    formats: ctypes.Array  # per layer the four matrices' format codes (weight_format)
    packed: ctypes.Array  # per layer the four matrices laid out for AMX tiles (CpuKernels.packed), or NULLs
    kv: ctypes.Array
    kv_format: int  # what the caches hold: its index in KV_DTYPES
    final_norm: torch.Tensor
    eps: float
    hidden: int
    num_layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    block_size: int
    layers: list  # the weights and AMX layouts whose addresses `weights` and `packed` hold, kept alive
    scratch: torch.Tensor  # the step's intermediate activations, grown to the largest step


_announced: set[Path] = set()  # the libraries whose choice the log has said


def load(cache_dir: Path, bf16_dot: bool = False, extra_flags: tuple[str, ...] = ()) -> CpuKernels | None:
    """The library, built into `cache_dir` on first use (and again when the file there does not
    load); None where it cannot be built or must not be trusted. bf16_dot: see CpuKernels.
    extra_flags: for the compiler after FLAGS (tests build the AVX2 kernels on an AVX-512 CPU
    with -mno-avx512f)."""
    if os.environ.get("PAGESERVE_NO_CPU_KERNELS") == "1":
        return None
    flags, files = [*FLAGS, *extra_flags], source_files()
    path = cache_dir / f"cpu_kernels-{build_key(flags, files)}.so"
    for attempt in range(2):
        if not path.is_file() and not build(cache_dir, path, flags, files):
            return None
        if (why := untrusted(path)) is not None:
            logger.warning("not loading the CPU kernels from %s: %s; keeping torch's ops (remove it, or point "
                           "$PAGESERVE_CACHE at a folder only you can write)", path, why)
            return None
        try:
            lib = CpuKernels(path, bf16_dot) if not attempt else _load_fresh(path, bf16_dot)
        except (OSError, AttributeError) as e:  # a torn or foreign file, or one missing a kernel
            if attempt:
                logger.warning("loading the CPU kernels failed after a rebuild; keeping torch's ops: %s", e)
                return None
            logger.warning("the CPU kernels at %s do not load (%s): building them again", path, e)
            path.unlink(missing_ok=True)
            continue
        if path not in _announced:
            _announced.add(path)
            logger.info("CPU kernels: %s, from %s", lib.isa, path)
        return lib
    return None


def _load_fresh(path: Path, bf16_dot: bool) -> CpuKernels:
    """The rebuilt library, through a link of another name: dlopen would hand back the handle
    of the file that failed, as it is still loaded under `path`."""
    link = path.with_name(f"{path.stem}-{os.getpid()}.so")
    link.unlink(missing_ok=True)
    os.link(path, link)
    try:
        return CpuKernels(link, bf16_dot)
    finally:
        link.unlink()
