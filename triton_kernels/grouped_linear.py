"""Weight-only quantized linear layers whose weights come in groups of G input columns, each
group with its own scale, unpacked and scaled inside the matmul's inner loop (no dequantized
weight in memory):

- W4A16 (int4_linear): qweight int32 [N, K / 8], word i of row n holding columns 8i..8i+7,
  column 8i + j in bits 4j..4j+3; scales float32 and zeros uint8 [N, K / G];
  y = x @ ((q - z) * s)^T.
- block-wise FP8 (fp8_group_linear): weight float8_e4m3fn [N, K], scales float32 [N, K / G];
  y = x @ (float(w) * s)^T. The codes travel as bytes and are widened exactly (scaled_linear's
  decoder), so the kernel also runs on GPUs without fp8 and under the interpreter.
- grouped INT8 (int8_group_linear, 8-bit GPTQ and W8A16): weight int8 [N, K], scales float32
  [N, K / G]; y = x @ (w * s)^T.
- FP4 (fp4_linear, NVFP4 weight-only): qweight int32 [N, K / 8] of FP4 e2m1 codes packed as
  W4A16's, scales float32 [N, K / G]; y = x @ (e2m1(q) * s)^T. NF4 (nf4_linear, bitsandbytes'
  4-bit) alike, through NormalFloat4's table.

One program computes a BLOCK_M x BLOCK_N tile over its share of K, reading the weight tile
transposed (each row's codes are contiguous; a 4-bit word is repeated for its 8 columns before
the shifts). Where BLOCK_K divides G a tile of K lies in one group: the kernel multiplies x by
the unscaled values (q - z, or the FP8, FP4 or int8 value: exact in the model dtype) and scales the
float32 partial product once per tile; otherwise each weight is scaled before the product. Few rows
(decode) read the weight once and leave most SMs idle, so K is split over the grid's third
axis: each split writes float32 partial sums that torch adds afterwards (no atomics, no host
sync, a launch grid fixed by the shapes: capturable in a CUDA graph)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pageserve.triton_kernels import torch_ops
from pageserve.triton_kernels.paged_attention import _dot  # float32 accumulation, IEEE precision
from pageserve.triton_kernels.scaled_linear import _e4m3_to_f16


INT4, FP8, FP4, INT8, NF4 = (tl.constexpr(i) for i in range(5))  # the kernel's CODES


# the token count, the input's row stride and the partial sums' split stride (M * N) change
# every step; the layer's sizes and strides are the model's and stay specialized
@triton.jit(do_not_specialize=["m_dim", "stride_xm", "stride_om", "stride_os"])
def _grouped_linear_kernel(
        x_ptr, qw_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr,
        m_dim, n_dim, k_dim, group_size, k_per_split,
        stride_xm, stride_qn, stride_sn, stride_zn, stride_om, stride_os,
        CODES: tl.constexpr, PER_WORD: tl.constexpr,
        HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, ONE_GROUP: tl.constexpr, EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """out[m, n] = sum over this split's k of x[m, k] * w[n, k] * s[n, k // G], w by CODES:
    q[n, k] - z[n, k // G] (INT4), the FP8 value (FP8), the FP4 e2m1 value (FP4), the int8
    value (INT8) or the NF4 value (NF4: zeros_ptr is the table of 16 float32 values) of the code.
    PER_WORD: codes a stored element holds (8 or 1).
    SPLIT: out is the float32 partial-sum buffer [splits, M, N] (bias added later); else out is
    y [M, N] in the model dtype. ONE_GROUP: BLOCK_K divides G (each K tile has one scale)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < m_dim
    n_ok = offs_n < n_dim
    rows_n = offs_n.to(tl.int64)
    k_start = tl.program_id(2) * k_per_split
    offs_k = k_start + tl.arange(0, BLOCK_K)
    offs_w = k_start // PER_WORD + tl.arange(0, BLOCK_K // PER_WORD)
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
            words = tl.load(q_ptrs, mask=n_ok[:, None] & (offs_w * PER_WORD < k_dim - k)[None, :], other=0)
        if CODES == FP8:
            q = _e4m3_to_f16(words).to(tl.float32)
        elif CODES == INT8:
            q = words.to(tl.float32)
        else:
            # each word repeated for its 8 columns, then column j of a word shifted down by 4j
            words = tl.interleave(words, words)
            words = tl.interleave(words, words)
            words = tl.interleave(words, words)
            q = (words >> shifts) & 0xF
            if CODES == NF4:  # a table of 16 values, passed in the zero points' place
                q = tl.load(zeros_ptr + q)
            if CODES == FP4:  # sign, exponent e (2 bits), mantissa m: twice the size is m, or (2 + m) << (e - 1)
                e = (q >> 1) & 3
                twice = tl.where(e == 0, q & 1, (2 + (q & 1)) << tl.maximum(e - 1, 0))
                q = tl.where(q >= 8, -twice, twice).to(tl.float32) * 0.5
        if ONE_GROUP:
            # a split's last tiles may lie past K: their x is 0, any group's scale will do
            group = tl.minimum(k_start + k, k_dim - 1) // group_size
            s = tl.load(s_row + group, mask=n_ok, other=0.0)
            if CODES == INT4:
                q = (q - tl.load(z_row + group, mask=n_ok, other=0).to(tl.int32)[:, None]).to(tl.float32)
            # q - z or an int8 is a small integer, an FP8 or FP4 value has at most 3 mantissa bits: exact in any
            # dtype
            # (through float32: the interpreter's int-to-bfloat16 cast is wrong)
            acc += _dot(x, tl.trans(q.to(x.dtype)), UPCAST) * s[None, :]
        else:
            groups = ((offs_k + k) // group_size)[None, :]
            inside = n_ok[:, None] & k_ok[None, :]
            s = tl.load(s_row[:, None] + groups, mask=inside, other=0.0)
            if CODES == INT4:
                q = (q - tl.load(z_row[:, None] + groups, mask=inside, other=0).to(tl.int32)).to(tl.float32)
            acc += _dot(x, tl.trans((q * s).to(x.dtype)), UPCAST)
        x_ptrs += BLOCK_K
        q_ptrs += BLOCK_K // PER_WORD
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


def _check_inputs(who, x, n, k, scales, zeros, group_size, bias, codes) -> None:
    """x, scales (and zeros) and bias against a weight of N rows and K columns; `codes`: the
    stored weight tensors, by name, whose rows must be contiguous."""
    _check(isinstance(group_size, int) and group_size > 0 and group_size % 8 == 0 and k % group_size == 0,
           f"{who}: group_size must be a positive multiple of 8 dividing K = {k}, got {group_size}")
    groups = k // group_size
    _check(scales.dtype == torch.float32 and tuple(scales.shape) == (n, groups),
           f"{who}: scales must be float32 [{n}, {groups}], got {scales.dtype} {tuple(scales.shape)}")
    if zeros is not None:
        _check(zeros.dtype == torch.uint8 and tuple(zeros.shape) == (n, groups),
               f"{who}: zeros must be uint8 [{n}, {groups}], got {zeros.dtype} {tuple(zeros.shape)}")
    for name, t in {**codes, "scales": scales, **({} if zeros is None else {"zeros": zeros})}.items():
        _check(t.stride(1) == 1 or t.shape[1] <= 1, f"{who}: {name}'s rows must be contiguous (stride 1)")
    if bias is not None:
        _check(bias.dtype == x.dtype and tuple(bias.shape) == (n,) and bias.is_contiguous(),
               f"{who}: bias must be contiguous [{n}] in {x.dtype}, got {bias.dtype} {tuple(bias.shape)}")
    tensors = (x, scales, *codes.values()) + tuple(t for t in (zeros, bias) if t is not None)
    devices = {t.device for t in tensors}
    _check(len(devices) == 1, f"{who}: all tensors must be on one device, got {sorted(map(str, devices))}")


def _check_x(who: str, x: torch.Tensor) -> None:
    _check(x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16, torch.float32),
           f"{who}: x must be 2-D float16/bfloat16/float32, got {x.dtype} {tuple(x.shape)}")
    _check(x.stride(1) == 1, f"{who}: x's columns must be contiguous (stride 1)")


def _launch(who, x, codes, n, scales, zeros, group_size, bias, kind, launch) -> torch.Tensor:
    """The kernel over x [M, K] and a checked weight of N rows (codes: int32 words of 8 4-bit
    values, int4 or fp4, or FP8 or int8 bytes)."""
    unknown = set(launch) - {"split_k", "block_m", "block_n", "block_k", "num_warps", "num_stages"}
    _check(not unknown, f"{who}: unknown launch settings {sorted(unknown)}")
    m, k = x.shape
    if m == 0 or n == 0:
        return torch.empty((m, n), dtype=x.dtype, device=x.device)
    config = default_config(m, n, k, group_size, x.dtype, x.device)
    config.update({key: v for key, v in launch.items() if v is not None})
    for key in ("block_m", "block_n", "block_k"):
        _check(config[key] >= 16 and config[key] & (config[key] - 1) == 0,
               f"{who}: {key} must be a power of two >= 16, got {config[key]}")
    bm, bn, bk = config["block_m"], config["block_n"], config["block_k"]
    k_blocks = triton.cdiv(k, bk)
    _check(isinstance(config["split_k"], int) and config["split_k"] >= 1,
           f"{who}: split_k must be a positive int, got {config['split_k']}")
    split = min(config["split_k"], k_blocks)
    k_per_split = triton.cdiv(k_blocks, split) * bk
    split = triton.cdiv(k, k_per_split)  # no split left with nothing to do
    if split == 1:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    else:
        out = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    _grouped_linear_kernel[grid](
        x, codes, scales, zeros if zeros is not None else scales, bias if bias is not None else out, out,
        m, n, k, group_size, k_per_split,
        x.stride(0), codes.stride(0), scales.stride(0), zeros.stride(0) if zeros is not None else 0,
        out.stride(-2), out.stride(0) if split > 1 else 0,
        CODES={"int4": INT4, "fp8": FP8, "fp4": FP4, "int8": INT8, "nf4": NF4}[kind],
        PER_WORD=1 if kind in ("fp8", "int8") else 8,
        # NF4's values are not exact in 16 bits: scaled first, each product rounded as bitsandbytes rounds it
        HAS_BIAS=bias is not None, SPLIT=split > 1, ONE_GROUP=group_size % bk == 0 and kind != "nf4",
        EVEN_K=k_per_split * split == k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        UPCAST=x.dtype != torch.float32 and triton.knobs.runtime.interpret,
        num_warps=config["num_warps"], num_stages=config["num_stages"])
    if split == 1:
        return out
    y = out.sum(0)
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group_size: int, bias: torch.Tensor | None = None, *, split_k: int | None = None,
                block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
                num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """Same contract as torch_ops.int4_linear: x [M, K] float16/bfloat16/float32 with unit
    column stride; qweight int32 [N, K / 8]; scales float32 and zeros uint8 [N, K / G]; bias
    [N] in x's dtype or None. Returns y [M, N] in x's dtype, accumulated in float32. split_k,
    block_m/n/k (powers of two, at least 16) and num_warps/num_stages tune the launch; unset
    ones come from default_config. Raises ValueError on inputs that do not fit the layout."""
    who = "int4_linear"
    _check_x(who, x)
    _check(qweight.dtype == torch.int32 and qweight.dim() == 2,
           f"{who}: qweight must be 2-D int32 [N, K / 8], got {qweight.dtype} {tuple(qweight.shape)}")
    n, k = qweight.shape[0], qweight.shape[1] * 8
    _check(x.shape[1] == k, f"{who}: x has {x.shape[1]} columns but qweight packs K = {k} "
                            f"(qweight {tuple(qweight.shape)}: 8 columns a word)")
    _check_inputs(who, x, n, k, scales, zeros, group_size, bias, {"qweight": qweight})
    launch = dict(split_k=split_k, block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps,
                  num_stages=num_stages)
    return _launch(who, x, qweight, n, scales, zeros, group_size, bias, "int4", launch)


def fp8_group_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, group_size: int,
                     bias: torch.Tensor | None = None, **launch) -> torch.Tensor:
    """Same contract as torch_ops.group_linear: x [M, K] float16/bfloat16/float32 with unit
    column stride; weight float8_e4m3fn [N, K]; scales float32 [N, K / G]; bias [N] in x's
    dtype or None. Returns y [M, N] in x's dtype, accumulated in float32. launch: int4_linear's
    split_k, block_m/n/k, num_warps and num_stages."""
    return _byte_group_linear("fp8_group_linear", torch.float8_e4m3fn, x, weight, scales, group_size, bias, launch)


def int8_group_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, group_size: int,
                      bias: torch.Tensor | None = None, **launch) -> torch.Tensor:
    """fp8_group_linear for int8 weights [N, K] (8-bit GPTQ, W8A16): y = x @ (w * s)^T."""
    return _byte_group_linear("int8_group_linear", torch.int8, x, weight, scales, group_size, bias, launch)


def _byte_group_linear(who, dtype, x, weight, scales, group_size, bias, launch) -> torch.Tensor:
    """The grouped kernel over a weight of one byte a code (FP8 or int8), checked."""
    _check_x(who, x)
    _check(weight.dtype == dtype and weight.dim() == 2,
           f"{who}: weight must be 2-D {str(dtype).removeprefix('torch.')} [N, K], got {weight.dtype} "
           f"{tuple(weight.shape)}")
    n, k = weight.shape
    _check(x.shape[1] == k, f"{who}: x has {x.shape[1]} columns but weight has {k}")
    _check_inputs(who, x, n, k, scales, None, group_size, bias, {"weight": weight})
    kind = "fp8" if dtype == torch.float8_e4m3fn else "int8"
    return _launch(who, x, weight.view(torch.uint8) if kind == "fp8" else weight, n, scales, None, group_size, bias,
                   kind, launch)


def fp4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int,
               bias: torch.Tensor | None = None, **launch) -> torch.Tensor:
    """Same contract as torch_ops.fp4_linear: x [M, K] float16/bfloat16/float32 with unit column
    stride; qweight int32 [N, K / 8] of FP4 e2m1 codes (int4_linear's packing); scales float32
    [N, K / G]; bias [N] in x's dtype or None. Returns y [M, N] in x's dtype, accumulated in
    float32. launch: int4_linear's split_k, block_m/n/k, num_warps and num_stages."""
    return _table4_linear("fp4_linear", "fp4", x, qweight, scales, group_size, bias, launch)


def nf4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group_size: int,
               bias: torch.Tensor | None = None, **launch) -> torch.Tensor:
    """fp4_linear for bitsandbytes' NormalFloat4 codes (torch_ops.nf4_linear's contract)."""
    return _table4_linear("nf4_linear", "nf4", x, qweight, scales, group_size, bias, launch)


@functools.lru_cache(maxsize=None)
def _nf4_table(device: torch.device) -> torch.Tensor:
    return torch.tensor(torch_ops.NF4, dtype=torch.float32, device=device)


def _table4_linear(who, kind, x, qweight, scales, group_size, bias, launch) -> torch.Tensor:
    """The grouped kernel over 4-bit codes read through a table (FP4's, computed; NF4's, loaded)."""
    _check_x(who, x)
    _check(qweight.dtype == torch.int32 and qweight.dim() == 2,
           f"{who}: qweight must be 2-D int32 [N, K / 8], got {qweight.dtype} {tuple(qweight.shape)}")
    n, k = qweight.shape[0], qweight.shape[1] * 8
    _check(x.shape[1] == k, f"{who}: x has {x.shape[1]} columns but qweight packs K = {k}")
    _check_inputs(who, x, n, k, scales, None, group_size, bias, {"qweight": qweight})
    table = _nf4_table(x.device) if kind == "nf4" else None
    return _launch(who, x, qweight, n, scales, table, group_size, bias, kind, launch)
