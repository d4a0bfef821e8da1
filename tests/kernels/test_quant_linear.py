"""The quantized linear kernels against their torch references (torch_ops): int4_linear (W4A16),
fp8_group_linear (block-wise FP8, weight-only), int8_group_linear (8-bit GPTQ, W8A16) and
fp4_linear (NVFP4, weight-only) at K not a multiple of the K tile, groups of 32, 64 and K (and
FP4's 16), N not a multiple of the column tile, 1, 3 and 17 rows, split-K on and off, with and
without bias; quantize_per_token bit for bit
(ties and the fp8 grid's binade carries included); scaled_linear and its GEMM for fp8 and int8;
and the launchers' refusals. The references themselves are checked against the layout (an
independent packer) and hand-computed codes.

Tolerances. float32 outputs: the kernels and the references sum the same exact products in
another order: 1e-5 (int8: the products are summed exactly in int32 and scaled in the
reference's order, so only an FMA contraction on the GPU may move a last bit: 1e-6). bfloat16
outputs: two bfloat16 ulps (rtol 2^-6), since float32 results that differ in their last bits
round once to bfloat16 (and Triton's interpreter truncates where torch rounds to nearest); where
a K tile spans several groups, the grouped kernels round each scaled weight to bfloat16 before
the product: 2e-2 of the output's scale."""

from __future__ import annotations

import pytest
import torch

from pageserve.triton_kernels import torch_ops
from pageserve.triton_kernels.grouped_linear import (default_config, fp4_linear, fp8_group_linear, int4_linear,
                                                     int8_group_linear, nf4_linear)
from pageserve.triton_kernels.scaled_linear import KINDS, quantize_per_token, scaled_linear, scaled_mm

pytestmark = pytest.mark.unit

BF16_ULPS = 2.0 ** -6  # two bfloat16 ulps, relative: 1 / 128 each just above a power of two


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] in 0..15 -> int32 [N, K / 8], written from the layout's words, one nibble at a time."""
    n, k = q.shape
    words = torch.zeros(n, k // 8, dtype=torch.int64)
    for j in range(8):
        words |= q[:, j::8].long() << (4 * j)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def int4_case(m, k, group, n, dtype, device, with_bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    zeros = torch.randint(0, 16, (n, k // group), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 0.005
    x = torch.randn(m, k, generator=g).to(device, dtype)
    bias = torch.randn(n, generator=g).to(device, dtype) if with_bias else None
    return (x, pack_int4(q).to(device), scales.to(device), zeros.to(device), group, bias), q


def assert_near(out, want, rtol, atol=None):
    """|out - want| <= rtol * |want| + atol * max |want| elementwise (atol: rtol unless given)."""
    out, want = out.double().cpu(), want.double().cpu()
    scale = want.abs().max().item()
    torch.testing.assert_close(out, want, rtol=rtol, atol=(rtol if atol is None else atol) * scale)


def test_pack_matches_the_layout():
    """Column 8i + j sits in bits 4j..4j+3 of word i: columns 1..8 are 0x87654321."""
    q = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 15, 0, 0, 0, 0, 0, 0, 1]])
    words = pack_int4(q)
    assert words.tolist() == [[0x87654321 - 2 ** 32, 0x1000000F]]


@pytest.mark.parametrize("group", [8, 32, 96])
def test_dequantize_int4(device, group):
    (_, qweight, scales, zeros, _, _), q = int4_case(1, 96, group, 24, torch.float32, device, False)
    want = (q - zeros.cpu().int().repeat_interleave(group, 1)).float() * scales.cpu().repeat_interleave(group, 1)
    got = torch_ops.dequantize_int4(qweight, scales, zeros, group)
    assert got.dtype == torch.float32 and torch.equal(got.cpu(), want)


# (M, K, G, N, launch): K tiles past K (masked), several column tiles (N = 2.5 x 16), one group
# per K tile (block_k divides G) or several, split-K on (default for M <= 16, or forced) and off
INT4_CASES = [
    (1, 96, 32, 40, dict(block_n=16)),  # default split: 3 splits of one K tile
    (3, 160, 32, 40, dict(split_k=1)),  # 5 groups, split off
    (1, 160, 32, 40, dict(split_k=2)),  # 2 splits of 3 tiles: the last tile lies past K
    (17, 192, 64, 40, dict(block_k=128, block_n=16)),  # 3 groups, 2 per K tile, K tile masked
    (3, 160, 160, 24, dict(block_k=64, split_k=2)),  # G == K, K tiles masked, split
    (17, 96, 96, 40, dict(split_k=2)),  # G == K, split forced at 17 rows
]


def fp8_group_case(m, k, group, n, dtype, device, with_bias, seed=0):
    """Random FP8 codes over the whole e4m3 range (subnormals and +-448 included), a scale per
    group of each row."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # not NaN
    codes[0, :4] = torch.tensor([0x7E, 0xFE, 0x01, 0x81], dtype=torch.uint8)  # +-448, +-2^-9
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 0.005
    x = torch.randn(m, k, generator=g).to(device, dtype)
    bias = torch.randn(n, generator=g).to(device, dtype) if with_bias else None
    return x, codes.view(torch.float8_e4m3fn).to(device), scales.to(device), group, bias


def fp4_case(m, k, group, n, dtype, device, with_bias, seed=0):
    """Every FP4 code (+-0 to +-6), a scale per group of each row, packed as W4A16's words."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 0.005
    x = torch.randn(m, k, generator=g).to(device, dtype)
    bias = torch.randn(n, generator=g).to(device, dtype) if with_bias else None
    return x, pack_int4(q).to(device), scales.to(device), group, bias


def int8_group_case(m, k, group, n, dtype, device, with_bias, seed=0):
    """int8 codes over the whole range (-128 included), a scale per group of each row."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    codes[0, :2] = torch.tensor([-128, 127], dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=g) * 0.002 + 0.0005
    x = torch.randn(m, k, generator=g).to(device, dtype)
    bias = torch.randn(n, generator=g).to(device, dtype) if with_bias else None
    return x, codes.to(device), scales.to(device), group, bias


@pytest.mark.parametrize("kernel", ["int4", "fp8", "fp4", "int8", "nf4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, k, group, n, launch", INT4_CASES + [(3, 176, 16, 40, dict(block_k=16)),
                                                                 (1, 176, 16, 40, dict(block_k=32))])
def test_grouped_linear(device, kernel, dtype, m, k, group, n, launch):
    """int4_linear, fp8_group_linear, fp4_linear, nf4_linear and int8_group_linear (one kernel)
    against their torch references;
    groups of 16 (NVFP4's) with a K tile of one group, and of two."""
    if kernel == "int4":
        args, fn, ref = int4_case(m, k, group, n, dtype, device, m != 17)[0], int4_linear, torch_ops.int4_linear
    elif kernel in ("fp4", "nf4"):  # the same codes, through e2m1's or NF4's table
        args = fp4_case(m, k, group, n, dtype, device, m != 17)
        fn, ref = (fp4_linear, torch_ops.fp4_linear) if kernel == "fp4" else (nf4_linear, torch_ops.nf4_linear)
    elif kernel == "int8":
        args = int8_group_case(m, k, group, n, dtype, device, m != 17)
        fn, ref = int8_group_linear, torch_ops.group_linear
    else:
        args = fp8_group_case(m, k, group, n, dtype, device, m != 17)
        fn, ref = fp8_group_linear, torch_ops.group_linear
    out, want = fn(*args, **launch), ref(*args)
    assert out.dtype == dtype and out.shape == (m, n)
    block_k = launch.get("block_k") or default_config(m, n, k, group, dtype, args[0].device)["block_k"]
    if dtype == torch.float32:
        assert_near(out, want, 1e-5)
    elif group % block_k == 0 and kernel != "nf4":  # (NF4's values are rounded to bfloat16 first)
        assert_near(out, want, BF16_ULPS, 1e-5)
    else:
        assert_near(out, want, 2e-2)


def test_dequantize_groups():
    """Each value is its e4m3 value times its group's scale: codes written by hand."""
    codes = torch.tensor([[0x38, 0x40, 0xB8, 0x01], [0x7E, 0x00, 0x08, 0x30]], dtype=torch.uint8)
    scales = torch.tensor([[2.0, 0.5], [1.0, 4.0]])
    got = torch_ops.dequantize_groups(codes.view(torch.float8_e4m3fn), scales, 2)
    assert got.tolist() == [[2.0, 4.0, -0.5, 2.0 ** -10], [448.0, 0.0, 4 * 2.0 ** -6, 4 * 0.5]]


def test_dequantize_fp4():
    """Each value is its e2m1 value times its group's scale: codes written by hand (sign, two
    exponent bits, one mantissa bit), packed eight a word, the first in the low bits."""
    codes = [0x0, 0x1, 0x2, 0x3, 0x4, 0x5, 0x6, 0x7, 0x8, 0x9, 0xA, 0xB, 0xC, 0xD, 0xE, 0xF]
    words = pack_int4(torch.tensor([codes]))
    got = torch_ops.dequantize_fp4(words, torch.tensor([[2.0, 0.25]]), 8)
    assert got.tolist() == [[0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, -0.0, -0.125, -0.25, -0.375, -0.5, -0.75,
                             -1.0, -1.5]]


def test_dequantize_nf4():
    """Each value is bitsandbytes' NormalFloat4 value of its code times its group's scale."""
    codes = list(range(16))
    got = torch_ops.dequantize_table4(pack_int4(torch.tensor([codes])), torch.tensor([[2.0, 0.5]]), 8, torch_ops.NF4)
    assert got[0, :8].tolist() == [2 * v for v in torch_ops.NF4[:8]]
    assert got[0, 8:].tolist() == [0.5 * v for v in torch_ops.NF4[8:]]
    assert torch_ops.NF4[0] == -1.0 and torch_ops.NF4[7] == 0.0 and torch_ops.NF4[15] == 1.0


def test_int4_split_heuristic():
    """Decode rows split K over idle SMs; 17 rows do not."""
    cpu = torch.device("cpu")
    assert default_config(1, 40, 96, 32, torch.bfloat16, cpu)["split_k"] > 1
    assert default_config(17, 40, 96, 32, torch.bfloat16, cpu)["split_k"] == 1
    assert default_config(1, 40, 96, 32, torch.bfloat16, cpu)["block_k"] == 32  # a tile inside a group


def test_int4_no_rows(device):
    args, _ = int4_case(1, 96, 32, 40, torch.bfloat16, device, True)
    out = int4_linear(args[0][:0], *args[1:])
    assert out.shape == (0, 40) and out.dtype == torch.bfloat16


def quantize_rows(dtype, device):
    """Rows for quantize_per_token: random; one whose scale is exactly 1 (max 448 / 127) holding
    ties and fp8's carries into the next binade and subnormals; a zero row; a tiny one; a huge one."""
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(6, 96, generator=g)
    rows[1] *= 1e4
    rows[2] = 0.0
    rows[3] *= 1e-12
    rows[4] *= 3e-3
    ties = {"fp8": [448.0, 17.0, 19.0, 124.0, -124.0, 0.0029296875, 0.0009765625, 31.0, -15.5],
            "int8": [127.0, 2.5, -2.5, 3.5, 0.5, -0.5, 126.5, 1.4999, -0.0]}
    return rows.to(device, dtype), ties


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_quantize_reference_codes(kind):
    """The reference rounds to nearest even onto the code grid, at scale 1."""
    _, ties = quantize_rows(torch.float32, "cpu")
    row = torch.zeros(1, 16)
    row[0, :9] = torch.tensor(ties[kind])
    xq, x_scale = torch_ops.quantize_per_token(row, kind)
    assert x_scale.item() == 1.0 and xq.dtype == KINDS[kind]
    want = {"fp8": [448, 16, 20, 128, -128, 0.00390625, 0, 32, -16],
            "int8": [127, 2, -2, 4, 0, 0, 126, 1, 0]}[kind]
    assert xq[0, :9].float().tolist() == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_quantize_per_token(device, kind, dtype):
    rows, ties = quantize_rows(torch.float32, device)
    rows[5, :9] = torch.tensor(ties[kind])
    rows[5, 9:] = 0.25
    rows = rows.to(dtype)
    wide = torch.zeros(6, 200, dtype=dtype, device=device)
    wide[:, 50:146] = rows
    for x in (rows, wide[:, 50:146]):  # contiguous, and a column slice (row stride 200)
        xq, x_scale = quantize_per_token(x, kind)
        want_q, want_scale = torch_ops.quantize_per_token(x, kind)
        assert xq.dtype == KINDS[kind] and x_scale.shape == (6, 1) and x_scale.dtype == torch.float32
        assert torch.equal(x_scale.cpu(), want_scale.cpu())
        assert torch.equal(xq.view(torch.uint8).cpu(), want_q.view(torch.uint8).cpu())


def weight_case(n, k, kind, device, seed=1):
    """wq [N, K] quantized per output channel from a random weight, w_scale [N]."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    qmax = torch_ops.QUANT_MAX[kind]
    w_scale = w.abs().amax(1) / qmax
    wq = (w / w_scale[:, None]).clamp(-qmax, qmax)
    wq = wq.to(torch.float8_e4m3fn) if kind == "fp8" else wq.round().to(torch.int8)
    return wq.to(device), w_scale.to(device)


# (M, K, N, launch): K tiles masked (96 = 1.5 x 64), several column tiles, 17 rows with N and K
# multiples of 16 (where torch's scaled matmuls take over on a GPU)
SCALED_CASES = [(1, 96, 40, dict(block_k=64, block_n=16)), (5, 160, 40, {}), (17, 160, 48, dict(block_k=64))]


def scaled_tol(kind, dtype, device="cpu") -> tuple[float, float]:
    """(rtol, atol as a fraction of the output's largest value). Hopper's fp8 tensor cores
    (torch._scaled_mm and Triton's fp8 dot) add products with about 14 bits of mantissa, so on
    CUDA fp8 sums are held to 2^-10 of the largest output instead."""
    fp8_cuda_atol = 2 ** -10 if kind == "fp8" and str(device).startswith("cuda") else 0.0
    if dtype == torch.bfloat16:
        return BF16_ULPS, max(1e-5, fp8_cuda_atol)
    return (1e-6, 1e-6) if kind == "int8" else (1e-5, max(1e-5, fp8_cuda_atol))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("m, k, n, launch", SCALED_CASES)
def test_scaled_linear(device, kind, dtype, m, k, n, launch):
    g = torch.Generator().manual_seed(m + k + n)
    x = (torch.randn(m, k, generator=g) * 3).to(device, dtype)
    wq, w_scale = weight_case(n, k, kind, device)
    bias = torch.randn(n, generator=g).to(device, dtype) if m != 5 else None
    want = torch_ops.scaled_linear(x, wq, w_scale, kind, bias)
    gemms = ["triton", "auto"] if device == "cuda" else ["triton"]
    for gemm in gemms:
        out = scaled_linear(x, wq, w_scale, kind, bias, gemm=gemm, **launch)
        assert out.dtype == dtype and out.shape == (m, n)
        assert_near(out, want, *scaled_tol(kind, dtype, device))
    # the reference against the plain formula in float64, the codes shared: a check of the
    # reference's own scaling, not of its rounding
    xq, x_scale = torch_ops.quantize_per_token(x, kind)
    exact = (xq.double() @ wq.double().t()) * x_scale.double() * w_scale.double()
    if bias is not None:
        exact += bias.double()
    assert_near(want, exact, *((1e-5, 1e-5) if dtype == torch.float32 else (BF16_ULPS, 1e-5)))


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_static_activation_scale(device, kind):
    """A checkpoint's static input_scale: x / input_scale clamped to the code range and rounded
    to nearest even (codes checked by hand), every row's x_scale that scale; scaled_linear with
    it is the GEMM on those codes."""
    x = torch.tensor([[1.0, -2.5, 1000.0, -1000.0, 0.0, 0.3]])
    xq, x_scale = torch_ops.quantize_static(x, kind, 0.5)
    want = {"fp8": [2.0, -5.0, 448.0, -448.0, 0.0, 0.625], "int8": [2.0, -5.0, 127.0, -128.0, 0.0, 1.0]}[kind]
    assert xq.float().tolist() == [want] and x_scale.tolist() == [[0.5]]
    got = quantize_per_token(x.to(device), kind, 0.5)  # the Triton kernel's static mode: the same bits
    assert got[0].cpu().view(torch.uint8).equal(xq.view(torch.uint8)) and got[1].cpu().equal(x_scale)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 96, generator=g).to(device)
    wq, w_scale = weight_case(40, 96, kind, device)
    out = scaled_linear(x, wq, w_scale, kind, input_scale=2 / 448)
    xq, x_scale = torch_ops.quantize_static(x, kind, 2 / 448)
    assert_near(out, (xq.float() @ wq.float().t()) * x_scale * w_scale, *scaled_tol(kind, torch.float32, device))
    assert_near(torch_ops.scaled_linear(x.cpu(), wq.cpu(), w_scale.cpu(), kind, input_scale=2 / 448), out.cpu(),
                *scaled_tol(kind, torch.float32, device))
    with pytest.raises(ValueError, match="input_scale must be finite and positive"):
        scaled_linear(x, wq, w_scale, kind, input_scale=0.0)


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_scaled_mm_given_the_codes(device, kind):
    """The GEMM alone, fed the reference's codes: the same products as the reference's float32
    matmul (int8: exactly, the partial sums being integers under 2^24)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(17, 160, generator=g).to(device)
    wq, w_scale = weight_case(48, 160, kind, device)
    xq, x_scale = torch_ops.quantize_per_token(x, kind)
    want = (xq.float() @ wq.float().t()) * x_scale * w_scale
    for gemm in (["triton", "auto"] if device == "cuda" else ["triton"]):
        out = scaled_mm(xq, x_scale, wq, w_scale, torch.float32, gemm=gemm, block_k=64, block_n=16)
        assert_near(out, want, *scaled_tol(kind, torch.float32, device))
        if kind == "int8" and gemm == "triton" and device == "cpu":  # no FMA contraction here
            assert torch.equal(out, want)


def test_int4_refusals(device):
    (x, qweight, scales, zeros, group, bias), _ = int4_case(3, 96, 32, 40, torch.bfloat16, device, True)
    bad = [
        (dict(x=x.int()), "x must be 2-D float"),
        (dict(x=x[:, :64]), "x has 64 columns"),
        (dict(x=x.t().contiguous().t()), "contiguous"),
        (dict(qweight=qweight.to(torch.int64)), "qweight must be 2-D int32"),
        (dict(group=40), "group_size must be a positive multiple of 8 dividing K"),
        (dict(group=12), "group_size must be a positive multiple of 8 dividing K"),
        (dict(scales=scales.half()), "scales must be float32"),
        (dict(zeros=zeros[:, :2]), r"zeros must be uint8 \[40, 3\]"),
        (dict(bias=bias.float()), "bias must be contiguous"),
        (dict(split_k=0), "split_k"),
        (dict(block_k=24), "block_k must be a power of two"),
    ]
    base = dict(x=x, qweight=qweight, scales=scales, zeros=zeros, group=group, bias=bias)
    for change, message in bad:
        a = {**base, **change}
        launch = {key: a.pop(key) for key in ("split_k", "block_k") if key in a}
        with pytest.raises(ValueError, match=message):
            int4_linear(a["x"], a["qweight"], a["scales"], a["zeros"], a["group"], a["bias"], **launch)


def test_fp8_group_refusals(device):
    x, weight, scales, group, bias = fp8_group_case(3, 96, 32, 40, torch.bfloat16, device, True)
    bad = [
        (dict(x=x.int()), {}, "x must be 2-D float"),
        (dict(x=x[:, :64]), {}, "x has 64 columns but weight has 96"),
        (dict(weight=weight.view(torch.uint8)), {}, "weight must be 2-D float8_e4m3fn"),
        (dict(group=40), {}, "group_size must be a positive multiple of 8 dividing K"),
        (dict(scales=scales[:, :2]), {}, r"scales must be float32 \[40, 3\]"),
        (dict(bias=bias.float()), {}, "bias must be contiguous"),
        ({}, dict(block_k=24), "block_k must be a power of two"),
        ({}, dict(tile=3), "unknown launch settings"),
    ]
    base = dict(x=x, weight=weight, scales=scales, group=group, bias=bias)
    for change, launch, message in bad:
        a = {**base, **change}
        with pytest.raises(ValueError, match=message):
            fp8_group_linear(a["x"], a["weight"], a["scales"], a["group"], a["bias"], **launch)


def test_scaled_refusals(device):
    x = torch.randn(3, 96, device=device, dtype=torch.bfloat16)
    wq, w_scale = weight_case(40, 96, "int8", device)
    fq, _ = weight_case(40, 96, "fp8", device)
    bad = [
        ((x, wq, w_scale, "int4"), "kind must be one of"),
        ((x, fq, w_scale, "int8"), "wants wq in torch.int8"),
        ((x[:, :64], wq, w_scale, "int8"), r"wq must be \[N, 64\]"),
        ((x.int(), wq, w_scale, "int8"), "x must be 2-D float"),
        ((x, wq, w_scale[:-1], "int8"), r"w_scale must be contiguous float32 \[40\]"),
        ((x, wq, w_scale.double(), "int8"), "w_scale must be contiguous float32"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            scaled_linear(*args)
    with pytest.raises(ValueError, match="kind must be one of"):
        quantize_per_token(x, "fp4")
    xq, x_scale = quantize_per_token(x, "int8")
    with pytest.raises(ValueError, match="must both be float8_e4m3fn or both int8"):
        scaled_mm(xq, x_scale, fq, w_scale, torch.bfloat16)
    with pytest.raises(ValueError, match="bias must be contiguous"):
        scaled_mm(xq, x_scale, wq, w_scale, torch.bfloat16, torch.zeros(40, device=device))
