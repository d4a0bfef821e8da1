"""W8A8 linear layers: activations quantized per token at run time (float8_e4m3fn or int8),
weights quantized per output channel ahead of time; y = (xq @ wq^T) * x_scale * w_scale.

The product runs in torch's scaled matmuls where the device and shapes allow them
(torch._scaled_mm with row-wise scales for fp8 on compute capability 8.9+, torch._int_mm for
int8 with more than 16 rows), otherwise in the Triton GEMM here, which Triton's interpreter
also runs. The Triton kernels never name an fp8 type: the codes travel as bytes and are
decoded to float16 exactly (every e4m3 value is a float16), so that they also run on GPUs
without fp8 support and under the interpreter, whose fp8 rounding is wrong."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pageserve.triton_kernels import torch_ops
from pageserve.triton_kernels.paged_attention import _dot  # float32 accumulation, IEEE precision
from pageserve.triton_kernels.rms_norm import rows_per_program

KINDS = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}


@triton.jit
def _round_even(y):
    """float32 y (|y| < 2^22) to the nearest integer, ties to even: adding 1.5 * 2^23 leaves no
    fraction bits (the interpreter has no rint)."""
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _e4m3_code(y):
    """The float8_e4m3fn byte of y (float32, |y| <= 448), rounded to nearest even: y is rounded
    onto the e4m3 grid in float32 (every other step exact), then y * 2^-8 is a float16 whose
    exponent and top 3 mantissa bits are e4m3's."""
    a = tl.abs(y)
    exponent = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # e4m3 has no lower binade
    step = ((exponent + 124) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - 3): 3 mantissa bits
    inv_step = ((130 - exponent) << 23).to(tl.float32, bitcast=True)
    a = _round_even(a * inv_step) * step
    bits = (a * 0.00390625).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80
    return ((bits >> 7) | sign).to(tl.uint8)


@triton.jit
def _e4m3_to_f16(code):
    """float8_e4m3fn bytes to float16, exactly (the inverse of _e4m3_code's last step)."""
    magnitude = ((code & 0x7F).to(tl.int16) << 7).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return tl.where((code & 0x80) != 0, -magnitude, magnitude).to(tl.float16)


# the token count and the input's row stride change every step
@triton.jit(do_not_specialize=["rows", "stride_xm"])
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, rows, cols, stride_xm, eps, qmin, qmax, static_scale,
                          IS_FP8: tl.constexpr, STATIC: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """Each row's codes and scale: the row's largest magnitude over qmax, or (STATIC) the given
    scale for every row; x / scale clamped to [qmin, qmax]."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    offs = tl.arange(0, BLOCK)[None, :]
    inside = (row < rows) & (offs < cols)
    x = tl.load(x_ptr + row * stride_xm + offs, mask=inside, other=0.0).to(tl.float32)
    # IEEE divisions, as torch's: the codes must match the torch path's bit for bit
    if STATIC:
        scale = tl.zeros([ROWS, 1], tl.float32) + static_scale
    else:
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), eps), qmax)[:, None]
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), qmin), qmax)
    if IS_FP8:
        code = _e4m3_code(y)
    else:
        code = _round_even(y).to(tl.int8)
    tl.store(q_ptr + row * cols + offs, code, mask=inside)
    tl.store(scale_ptr + row, scale, mask=row < rows)


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda or triton.knobs.runtime.interpret


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_x(x: torch.Tensor, kind: str, who: str) -> None:
    _check(kind in KINDS, f"{who}: kind must be one of {sorted(KINDS)}, got {kind!r}")
    _check(x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16, torch.float32),
           f"{who}: x must be 2-D float16/bfloat16/float32, got {x.dtype} {tuple(x.shape)}")
    _check(x.stride(1) == 1 or x.shape[1] <= 1, f"{who}: x's columns must be contiguous (stride 1)")


def _check_weight(wq, w_scale, bias, out_dtype, others, who: str) -> None:
    n = wq.shape[0]
    _check(w_scale.dtype == torch.float32 and tuple(w_scale.shape) == (n,) and w_scale.is_contiguous(),
           f"{who}: w_scale must be contiguous float32 [{n}], got {w_scale.dtype} {tuple(w_scale.shape)}")
    if bias is not None:
        _check(bias.dtype == out_dtype and tuple(bias.shape) == (n,) and bias.is_contiguous(),
               f"{who}: bias must be contiguous [{n}] in {out_dtype}, got {bias.dtype} {tuple(bias.shape)}")
    devices = {t.device for t in (wq, w_scale, *others) + ((bias,) if bias is not None else ())}
    _check(len(devices) == 1, f"{who}: all tensors must be on one device, got {sorted(map(str, devices))}")


def quantize_per_token(x: torch.Tensor, kind: str,
                       input_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as torch_ops.quantize_per_token (or, given a checkpoint's static
    input_scale, torch_ops.quantize_static): (xq [M, K] float8_e4m3fn or int8, x_scale [M, 1]
    float32), the same bits. The Triton kernel on CUDA (and under the interpreter), the torch
    version elsewhere."""
    _check_x(x, kind, "quantize_per_token")
    if not _use_triton(x):
        if input_scale is None:
            return torch_ops.quantize_per_token(x, kind)
        return torch_ops.quantize_static(x, kind, input_scale)
    rows, cols = x.shape
    xq = torch.empty((rows, cols), dtype=KINDS[kind], device=x.device)
    x_scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows == 0 or cols == 0:
        empty = torch_ops.QUANT_EPS / torch_ops.QUANT_MAX[kind] if input_scale is None else input_scale
        return xq, x_scale.fill_(empty)
    block = triton.next_power_of_2(cols)
    per_program = rows_per_program(block)
    qmax = torch_ops.QUANT_MAX[kind]
    qmin = -qmax if input_scale is None else torch_ops.STATIC_MIN[kind]
    _quantize_rows_kernel[(triton.cdiv(rows, per_program),)](
        x, xq.view(torch.uint8) if kind == "fp8" else xq, x_scale, rows, cols, x.stride(0),
        torch_ops.QUANT_EPS, qmin, qmax, 1.0 if input_scale is None else input_scale,
        IS_FP8=kind == "fp8", STATIC=input_scale is not None, BLOCK=block,
        ROWS=per_program, num_warps=min(16, max(4, block // 1024)))
    return xq, x_scale


# the token count and the activations' row stride change every step
@triton.jit(do_not_specialize=["m_dim", "stride_am", "stride_om"])
def _scaled_mm_kernel(a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, out_ptr, m_dim, n_dim, k_dim,
                      stride_am, stride_bn, stride_om,
                      IS_FP8: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      UPCAST: tl.constexpr):
    """out[m, n] = (sum_k a[m, k] b[n, k]) * a_scale[m] * b_scale[n] (+ bias[n]); fp8 codes
    multiplied as float16 into float32 (each product exact), int8 into int32 (exact)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < m_dim
    n_ok = offs_n < n_dim
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    if IS_FP8:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
    for k in range(0, k_dim, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=m_ok[:, None], other=0)
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0)
        else:
            a = tl.load(a_ptrs, mask=m_ok[:, None] & (offs_k[None, :] < k_dim - k), other=0)
            b = tl.load(b_ptrs, mask=n_ok[None, :] & (offs_k[:, None] < k_dim - k), other=0)
        if IS_FP8:
            acc += _dot(_e4m3_to_f16(a), _e4m3_to_f16(b), UPCAST)
        else:
            acc += tl.dot(a, b, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    a_scale = tl.load(a_scale_ptr + offs_m, mask=m_ok, other=0.0)
    b_scale = tl.load(b_scale_ptr + offs_n, mask=n_ok, other=0.0)
    y = acc.to(tl.float32) * a_scale[:, None] * b_scale[None, :]  # torch_ops's order of rounding
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def default_config(m: int) -> dict:
    """Tiles by the row count: few rows (decode) are bound by reading the weight, and narrow
    column tiles spread it over more programs."""
    if m <= 16:
        return dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
    if m <= 64:
        return dict(block_m=32, block_n=128, block_k=128, num_warps=4, num_stages=4)
    return dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)


# (kind, device, out dtype, with bias) where torch's scaled matmul raised once: not tried again
_TORCH_MM_REFUSED: set[tuple] = set()


def torch_mm_fits(m: int, n: int, k: int, kind: str, device: torch.device) -> bool:
    """Whether torch's scaled matmul's documented rules admit this product: torch._scaled_mm
    (row-wise scales) wants compute capability 8.9+ and K, N multiples of 16; torch._int_mm
    (cuBLAS) wants more than 16 rows and K, N multiples of 8."""
    if device.type != "cuda" or triton.knobs.runtime.interpret:
        return False
    if kind == "fp8":
        return (hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(device) >= (8, 9)
                and k % 16 == 0 and n % 16 == 0)
    return hasattr(torch, "_int_mm") and m > 16 and k % 8 == 0 and n % 8 == 0


def auto_gemm(m: int, n: int, k: int, kind: str, device: torch.device, out_dtype: torch.dtype,
              has_bias: bool) -> str:
    """The GEMM that gemm="auto" runs for these shapes now: "torch._scaled_mm", "torch._int_mm"
    or "triton"."""
    if (kind, device, out_dtype, has_bias) in _TORCH_MM_REFUSED or not torch_mm_fits(m, n, k, kind, device):
        return "triton"
    return "torch._scaled_mm" if kind == "fp8" else "torch._int_mm"


def _torch_scaled_mm(xq, x_scale, wq, w_scale, kind, out_dtype, bias):
    if kind == "fp8":
        # wq.t(): the column-major second operand that cuBLASLt wants, with no copy
        return torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1), bias=bias,
                                out_dtype=out_dtype)
    y = torch._int_mm(xq, wq.t()).float().mul_(x_scale).mul_(w_scale)
    if bias is not None:
        y += bias.float()
    return y.to(out_dtype)


def scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
              out_dtype: torch.dtype, bias: torch.Tensor | None = None, *, gemm: str = "auto",
              block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
              num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """(xq [M, K] @ wq [N, K]^T) * x_scale [M, 1] * w_scale [N] (+ bias [N]) in out_dtype, xq
    and wq both float8_e4m3fn or both int8. gemm "auto": torch's scaled matmul where
    torch_mm_fits (and it has not refused this kind before), else Triton; "triton": Triton
    always. block_m/n/k (powers of two, at least 16) and num_warps/num_stages tune the Triton
    launch."""
    kind = {v: key for key, v in KINDS.items()}.get(xq.dtype)
    _check(kind is not None and wq.dtype == xq.dtype,
           f"scaled_mm: xq and wq must both be float8_e4m3fn or both int8, got {xq.dtype} and {wq.dtype}")
    _check(xq.dim() == 2 and wq.dim() == 2 and xq.shape[1] == wq.shape[1],
           f"scaled_mm: xq [M, K] and wq [N, K] must share K, got {tuple(xq.shape)} and {tuple(wq.shape)}")
    (m, k), n = xq.shape, wq.shape[0]
    _check(xq.is_contiguous() and wq.stride(1) == 1, "scaled_mm: xq must be contiguous and wq's rows too")
    _check(x_scale.dtype == torch.float32 and tuple(x_scale.shape) == (m, 1) and x_scale.is_contiguous(),
           f"scaled_mm: x_scale must be contiguous float32 [{m}, 1], got {x_scale.dtype} {tuple(x_scale.shape)}")
    _check(out_dtype in (torch.float16, torch.bfloat16, torch.float32), f"scaled_mm: out_dtype {out_dtype}")
    _check_weight(wq, w_scale, bias, out_dtype, (xq, x_scale), "scaled_mm")
    _check(gemm in ("auto", "triton"), f"scaled_mm: gemm must be 'auto' or 'triton', got {gemm!r}")
    if m == 0 or n == 0:
        return torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if gemm == "auto" and auto_gemm(m, n, k, kind, xq.device, out_dtype, bias is not None) != "triton":
        try:
            return _torch_scaled_mm(xq, x_scale, wq, w_scale, kind, out_dtype, bias)
        except RuntimeError:  # rules of this torch build beyond the documented ones: Triton from now on
            _TORCH_MM_REFUSED.add((kind, xq.device, out_dtype, bias is not None))
    config = default_config(m)
    config.update({key: v for key, v in dict(block_m=block_m, block_n=block_n, block_k=block_k,
                                             num_warps=num_warps, num_stages=num_stages).items() if v is not None})
    for key in ("block_m", "block_n", "block_k"):
        _check(config[key] >= 16 and config[key] & (config[key] - 1) == 0,
               f"scaled_mm: {key} must be a power of two >= 16, got {config[key]}")
    bm, bn, bk = config["block_m"], config["block_n"], config["block_k"]
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    as_bytes = (lambda t: t.view(torch.uint8)) if kind == "fp8" else (lambda t: t)
    _scaled_mm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        as_bytes(xq), as_bytes(wq), x_scale, w_scale, bias if bias is not None else out, out, m, n, k,
        xq.stride(0), wq.stride(0), out.stride(0),
        IS_FP8=kind == "fp8", HAS_BIAS=bias is not None, EVEN_K=k % bk == 0, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, UPCAST=triton.knobs.runtime.interpret,
        num_warps=config["num_warps"], num_stages=config["num_stages"])
    return out


def scaled_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, kind: str,
                  bias: torch.Tensor | None = None, input_scale: float | None = None, *, gemm: str = "auto",
                  **launch) -> torch.Tensor:
    """Same contract as torch_ops.scaled_linear: x [M, K] float16/bfloat16/float32 quantized
    per token (or with the checkpoint's static input_scale), wq [N, K]
    (float8_e4m3fn for kind "fp8", int8 for "int8"), w_scale [N] float32, bias [N] in x's dtype
    or None; returns [M, N] in x's dtype. gemm and launch: scaled_mm's. The torch path where
    there is neither CUDA nor the interpreter."""
    _check_x(x, kind, "scaled_linear")
    _check(wq.dtype == KINDS[kind], f"scaled_linear: kind {kind!r} wants wq in {KINDS[kind]}, got {wq.dtype}")
    _check(wq.dim() == 2 and wq.shape[1] == x.shape[1],
           f"scaled_linear: wq must be [N, {x.shape[1]}] (x is {tuple(x.shape)}), got {tuple(wq.shape)}")
    _check(wq.stride(1) == 1 or wq.shape[1] <= 1, "scaled_linear: wq's rows must be contiguous (stride 1)")
    _check_weight(wq, w_scale, bias, x.dtype, (x,), "scaled_linear")
    _check(input_scale is None or 0 < input_scale < float("inf"),
           f"scaled_linear: input_scale must be finite and positive, got {input_scale}")
    if not _use_triton(x):
        return torch_ops.scaled_linear(x, wq, w_scale, kind, bias, input_scale)
    xq, x_scale = quantize_per_token(x, kind, input_scale)
    return scaled_mm(xq, x_scale, wq, w_scale, x.dtype, bias, gemm=gemm, **launch)
