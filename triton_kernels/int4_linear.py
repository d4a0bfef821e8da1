"""W4A16 linear layer: 4-bit weights with a scale and a zero point per group of G input
columns, unpacked and scaled inside the matmul's inner loop (no dequantized weight in memory).

Layout: qweight int32 [N, K / 8], word i of row n holding columns 8i..8i+7, column 8i + j in
bits 4j..4j+3; scales float32 and zeros uint8 [N, K / G]; y = x @ ((q - z) * s)^T.

One program computes a BLOCK_M x BLOCK_N tile over its share of K, reading the weight tile
transposed (each row's words are contiguous) and repeating each word for its 8 columns before
the shifts. Where BLOCK_K divides G a
tile of K lies in one group: the kernel multiplies x by the small integers q - z (exact in the
model dtype) and scales the float32 partial product once per tile; otherwise each weight is
scaled before the product. Few rows (decode) read the weight once and leave most SMs idle, so
K is split over the grid's third axis: each split writes float32 partial sums that torch adds
afterwards (no atomics, no host sync, a launch grid fixed by the shapes: capturable in a CUDA
graph)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pageserve.triton_kernels.paged_attention import _dot  # float32 accumulation, IEEE precision


# the token count, the input's row stride and the partial sums' split stride (M * N) change
# every step; the layer's sizes and strides are the model's and stay specialized
@triton.jit(do_not_specialize=["m_dim", "stride_xm", "stride_om", "stride_os"])
def _int4_linear_kernel(
        x_ptr, qw_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr,
        m_dim, n_dim, k_dim, group_size, k_per_split,
        stride_xm, stride_qn, stride_sn, stride_zn, stride_om, stride_os,
        HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, ONE_GROUP: tl.constexpr, EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """out[m, n] = sum over this split's k of x[m, k] * (q[n, k] - z[n, k // G]) * s[n, k // G].
    SPLIT: out is the float32 partial-sum buffer [splits, M, N] (bias added later); else out is
    y [M, N] in the model dtype. ONE_GROUP: BLOCK_K divides G (each K tile has one scale)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < m_dim
    n_ok = offs_n < n_dim
    rows_n = offs_n.to(tl.int64)
    k_start = tl.program_id(2) * k_per_split
    offs_k = k_start + tl.arange(0, BLOCK_K)
    offs_w = k_start // 8 + tl.arange(0, BLOCK_K // 8)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    # the weight tile transposed, [BLOCK_N, BLOCK_K]: each row's words are contiguous in memory
    q_ptrs = qw_ptr + rows_n[:, None] * stride_qn + offs_w[None, :]
    shifts = ((tl.arange(0, BLOCK_K) % 8) * 4)[None, :]
    s_row = scales_ptr + rows_n * stride_sn
    z_row = zeros_ptr + rows_n * stride_zn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, k_per_split, BLOCK_K):
        k_ok = offs_k < k_dim - k
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            words = tl.load(q_ptrs, mask=n_ok[:, None], other=0)
        else:
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            words = tl.load(q_ptrs, mask=n_ok[:, None] & (offs_w * 8 < k_dim - k)[None, :], other=0)
        # each word repeated for its 8 columns, then column j of a word shifted down by 4j
        words = tl.interleave(words, words)
        words = tl.interleave(words, words)
        words = tl.interleave(words, words)
        q = (words >> shifts) & 0xF
        if ONE_GROUP:
            # a split's last tiles may lie past K: their x is 0, any group's scale will do
            group = tl.minimum(k_start + k, k_dim - 1) // group_size
            s = tl.load(s_row + group, mask=n_ok, other=0.0)
            z = tl.load(z_row + group, mask=n_ok, other=0).to(tl.int32)
            # q - z is a small integer, exact in any dtype (through float32: the interpreter's
            # int-to-bfloat16 cast is wrong)
            w = (q - z[:, None]).to(tl.float32).to(x.dtype)
            acc += _dot(x, tl.trans(w), UPCAST) * s[None, :]
        else:
            groups = ((offs_k + k) // group_size)[None, :]
            inside = n_ok[:, None] & k_ok[None, :]
            s = tl.load(s_row[:, None] + groups, mask=inside, other=0.0)
            z = tl.load(z_row[:, None] + groups, mask=inside, other=0).to(tl.int32)
            acc += _dot(x, tl.trans(((q - z).to(tl.float32) * s).to(x.dtype)), UPCAST)
        x_ptrs += BLOCK_K
        q_ptrs += BLOCK_K // 8
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        tl.store(out_ptrs + tl.program_id(2) * stride_os, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, not a GPU's worth
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_config(m: int, n: int, k: int, group_size: int, dtype: torch.dtype,
                   device: torch.device) -> dict:
    """Tiles by the row count; split-K for up to 16 rows, enough splits to give every SM about
    two programs. block_k is at most the largest power of two dividing G, so that a K tile has
    one scale, where that is at least 16."""
    if m <= 16:
        config = dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
    elif m <= 64:
        config = dict(block_m=32, block_n=128, block_k=64, num_warps=4, num_stages=4)
    else:
        config = dict(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)
    if dtype == torch.float32:  # tiles of twice the bytes
        config["block_k"] //= 2
    if group_size & -group_size >= 16:
        config["block_k"] = min(config["block_k"], group_size & -group_size)
    split = 1
    if m <= 16:
        tiles = triton.cdiv(m, config["block_m"]) * triton.cdiv(n, config["block_n"])
        split = max(1, min(2 * _num_sms(device) // tiles, triton.cdiv(k, config["block_k"]), 16))
    config["split_k"] = split
    return config


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_inputs(x, qweight, scales, zeros, group_size, bias) -> None:
    _check(x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16, torch.float32),
           f"int4_linear: x must be 2-D float16/bfloat16/float32, got {x.dtype} {tuple(x.shape)}")
    _check(x.stride(1) == 1, "int4_linear: x's columns must be contiguous (stride 1)")
    _check(qweight.dtype == torch.int32 and qweight.dim() == 2,
           f"int4_linear: qweight must be 2-D int32 [N, K / 8], got {qweight.dtype} {tuple(qweight.shape)}")
    n, k = qweight.shape[0], qweight.shape[1] * 8
    _check(x.shape[1] == k, f"int4_linear: x has {x.shape[1]} columns but qweight packs K = {k} "
                            f"(qweight {tuple(qweight.shape)}: 8 columns a word)")
    _check(isinstance(group_size, int) and group_size > 0 and group_size % 8 == 0 and k % group_size == 0,
           f"int4_linear: group_size must be a positive multiple of 8 dividing K = {k}, got {group_size}")
    groups = k // group_size
    _check(scales.dtype == torch.float32 and tuple(scales.shape) == (n, groups),
           f"int4_linear: scales must be float32 [{n}, {groups}], got {scales.dtype} {tuple(scales.shape)}")
    _check(zeros.dtype == torch.uint8 and tuple(zeros.shape) == (n, groups),
           f"int4_linear: zeros must be uint8 [{n}, {groups}], got {zeros.dtype} {tuple(zeros.shape)}")
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros)):
        _check(t.stride(1) == 1 or t.shape[1] <= 1, f"int4_linear: {name}'s rows must be contiguous (stride 1)")
    if bias is not None:
        _check(bias.dtype == x.dtype and tuple(bias.shape) == (n,) and bias.is_contiguous(),
               f"int4_linear: bias must be contiguous [{n}] in {x.dtype}, got {bias.dtype} {tuple(bias.shape)}")
    devices = {t.device for t in (x, qweight, scales, zeros) + ((bias,) if bias is not None else ())}
    _check(len(devices) == 1, f"int4_linear: all tensors must be on one device, got {sorted(map(str, devices))}")


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int, bias: torch.Tensor | None = None, *, split_k: int | None = None,
                block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
                num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """Same contract as torch_ops.int4_linear: x [M, K] float16/bfloat16/float32 with unit
    column stride; qweight int32 [N, K / 8]; scales float32 and zeros uint8 [N, K / G]; bias
    [N] in x's dtype or None. Returns y [M, N] in x's dtype, accumulated in float32. split_k,
    block_m/n/k (powers of two, at least 16) and num_warps/num_stages tune the launch; unset
    ones come from default_config. Raises ValueError on inputs that do not fit the layout."""
    _check_inputs(x, qweight, scales, zeros, group_size, bias)
    m, k = x.shape
    n = qweight.shape[0]
    if m == 0 or n == 0:
        return torch.empty((m, n), dtype=x.dtype, device=x.device)
    config = default_config(m, n, k, group_size, x.dtype, x.device)
    config.update({key: v for key, v in dict(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split_k,
                                             num_warps=num_warps, num_stages=num_stages).items() if v is not None})
    for key in ("block_m", "block_n", "block_k"):
        _check(config[key] >= 16 and config[key] & (config[key] - 1) == 0, f"int4_linear: {key} must be a power "
                                                                           f"of two >= 16, got {config[key]}")
    bm, bn, bk = config["block_m"], config["block_n"], config["block_k"]
    k_blocks = triton.cdiv(k, bk)
    _check(isinstance(config["split_k"], int) and config["split_k"] >= 1,
           f"int4_linear: split_k must be a positive int, got {config['split_k']}")
    split = min(config["split_k"], k_blocks)
    k_per_split = triton.cdiv(k_blocks, split) * bk
    split = triton.cdiv(k, k_per_split)  # no split left with nothing to do
    if split == 1:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:
        out = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    _int4_linear_kernel[grid](
        x, qweight, scales, zeros, bias if bias is not None else out, out,
        m, n, k, group_size, k_per_split,
        x.stride(0), qweight.stride(0), scales.stride(0), zeros.stride(0), out.stride(-2),
        out.stride(0) if split > 1 else 0,
        HAS_BIAS=bias is not None, SPLIT=split > 1, ONE_GROUP=group_size % bk == 0,
        EVEN_K=k_per_split * split == k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        UPCAST=x.dtype != torch.float32 and triton.knobs.runtime.interpret,
        num_warps=config["num_warps"], num_stages=config["num_stages"])
    if split == 1:
        return out
    y = out.sum(0)
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
