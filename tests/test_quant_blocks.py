"""A quantized checkpoint's codes in the C linear's blocks (triton_kernels/cpu_blocks.py: i8, f8,
i4 with group scales and zero points, f4: FP4 e2m1 codes in groups of 16, and n4: NormalFloat4): the packers lay
the bytes out as documented; the kernels widen every block to the float32 product of its code
and scale (checked against a dequantizer written here, bit for bit); the linear on blocks is the
linear on those values to the bit, in float32 and in bfloat16 arithmetic; and the decoder stack
takes layers in these formats. Each for the build of this CPU, the AVX2 one, and the portable
scalar one."""

from __future__ import annotations

import struct

import pytest
import torch
import torch.nn.functional as F

from pageserve.triton_kernels import cpu_kernels
from pageserve.triton_kernels.cpu_blocks import (fp4_blocks, fp8_blocks, int4_blocks, int8_blocks, nf4_blocks,
                                                 smallest_blocks)
from pageserve.triton_kernels.torch_ops import NF4

pytestmark = pytest.mark.unit

F8_NAN = (0x7F, 0xFF)


@pytest.fixture(scope="module", params=["native", "avx2", "x86-64"])
def kernel(request, native_kernels):
    """The kernels built for this CPU; for AVX2 where it has AVX-512 (the older CPUs' path); and
    for any x86-64 (no AVX2, no F16C: the scalar widening, the software half-float conversion)."""
    if request.param == "native":
        return native_kernels
    if request.param == "avx2":
        return request.getfixturevalue("avx2_kernels")
    return request.getfixturevalue("portable_kernels")


@pytest.fixture(scope="module")
def bf16_lib(native_kernels):
    if not native_kernels.has_bf16_dot:
        pytest.skip("no AVX512-BF16 on this CPU")
    return cpu_kernels.CpuKernels(native_kernels.path, bf16_dot=True)


def scales_of(gen: torch.Generator, shape: tuple[int, ...], edges: bool) -> torch.Tensor:
    """Positive scales as checkpoints have them; edges: a row of zero, negative zero, negative
    and float32-subnormal scales too."""
    s = torch.rand(shape, generator=gen) * 0.02 + 0.001
    if edges:
        row = torch.tensor([0.0, -0.0, -0.013, 1e-40, -3e-39, 2.5e-3])
        s.view(-1)[: min(s.numel(), row.numel())] = row[: s.numel()]
    return s


def quantized(fmt: str, rows: int, cols: int, group: int | None, seed: int, edges: bool = False,
              nan: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, their values as this test's own float32 dequantizer computes them): random codes
    over the whole range (f8: every byte, the NaN codes only where `nan`)."""
    gen = torch.Generator().manual_seed(seed)
    if fmt == "i4":
        codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
        zeros = torch.randint(0, 16, (rows, cols // group), generator=gen, dtype=torch.uint8)
        scales = scales_of(gen, (rows, cols // group), edges)
        per_value = (codes.int() - zeros.int().repeat_interleave(group, 1)).float()
        return int4_blocks(codes, scales, zeros, group), per_value * scales.repeat_interleave(group, 1)
    if fmt == "n4":  # bitsandbytes' NormalFloat4 table
        codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
        scales = scales_of(gen, (rows, cols // group), edges)
        return nf4_blocks(codes, scales, group), torch.tensor(NF4)[codes.long()] * scales.repeat_interleave(group, 1)
    if fmt == "f4":  # sign, two exponent bits, one mantissa bit: 0.5 * m below exponent 1, else 2^(e-1) (1 + m / 2)
        codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
        e, m = (codes >> 1 & 3).float(), (codes & 1).float()
        value = torch.where(e == 0, 0.5 * m, 2 ** (e - 1) * (1 + m / 2)) * torch.where(codes >= 8, -1.0, 1.0)
        scales = scales_of(gen, (rows, cols // group), edges)
        return fp4_blocks(codes, scales, group), value * scales.repeat_interleave(group, 1)
    scales = scales_of(gen, (rows,) if group is None else (rows, cols // group), edges)
    if fmt == "i8":  # one scale a row, or a group's (8-bit GPTQ, W8A16)
        codes = torch.randint(-128, 128, (rows, cols), generator=gen, dtype=torch.int8)
        if group is not None:
            return int8_blocks(codes, scales, group), codes.float() * scales.repeat_interleave(group, 1)
        return int8_blocks(codes, scales), codes.float() * scales[:, None]
    raw = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.uint8)
    if not nan:
        raw[(raw == F8_NAN[0]) | (raw == F8_NAN[1])] = 0x3C
    codes = raw.view(torch.float8_e4m3fn)
    if group is not None:  # block-wise: each group of columns its scale
        return fp8_blocks(codes, scales, group), codes.float() * scales.repeat_interleave(group, 1)
    return fp8_blocks(codes, scales), codes.float() * scales[:, None]


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal to the bit, where a NaN matches any NaN (the NaN codes' payload is not kept)."""
    nan = want.isnan()
    return torch.equal(got.isnan(), nan) and torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


SHAPES = [("i8", 96, None), ("i8", 192, None), ("i8", 192, 64), ("f8", 96, None), ("f8", 192, None), ("f8", 192, 64),
          ("f8", 128, 128), ("i4", 96, 32), ("i4", 128, 128), ("i4", 192, 64), ("f4", 96, 16), ("f4", 128, 64),
          ("n4", 128, 64), ("n4", 96, 32)]


@pytest.mark.parametrize("fmt,cols,group", SHAPES)
def test_widened_blocks_are_the_codes_times_their_scales(kernel, fmt, cols, group):
    w, want = quantized(fmt, 70, cols, group, seed=cols, edges=True, nan=True)
    assert w.shape == (70, cols // 32 * cpu_kernels.BLOCK_FORMATS[fmt][1]) and w.block_format == fmt
    if fmt == "f8":
        assert want.isnan().any()
    assert same_bits(kernel.widen(w), want)


@pytest.mark.parametrize("fmt,cols,group", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 64])
def test_linear_on_blocks_is_linear_on_their_values_bit_for_bit(kernel, fmt, cols, group, rows):
    # 301 outputs: a partial last tile and piece
    w, values = quantized(fmt, 301, cols, group, seed=rows + cols)
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, cols, generator=gen), torch.randn(301, generator=gen)
    wide = kernel.widen(w)
    assert torch.equal(wide, values)
    for b in (None, bias):
        got = kernel(x, w, b)
        assert torch.equal(got, kernel(x, wide, b))
        want = F.linear(x.double(), values.double(), None if b is None else b.double())
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * cols ** 0.5 * values.abs().max().item())


@pytest.mark.parametrize("fmt,cols,group", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 64])
def test_bfloat16_arithmetic_on_blocks_is_on_their_values(bf16_lib, fmt, cols, group, rows):
    w, values = quantized(fmt, 301, cols, group, seed=rows * 3 + cols)
    gen = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, cols, generator=gen), torch.randn(301, generator=gen).bfloat16().float()
    for b in (None, bias):
        got = bf16_lib(x, w, b)
        assert torch.equal(got, bf16_lib(x, values, b)) and torch.equal(got, got.bfloat16().float())
        want = F.linear(x.bfloat16().double(), values.bfloat16().double(), None if b is None else b.double())
        assert torch.allclose(got.double(), want, rtol=2 ** -7, atol=1e-5 * cols ** 0.5 * values.abs().max().item())


def test_blocks_are_the_documented_bytes():
    """One block each: the float32 scale little-endian first, then the codes as given; an i4
    block's zero point, then value i in the low nibble of byte i and value i + 16 in its high one."""
    scale = struct.pack("<f", 0.75)
    codes = torch.arange(-16, 16, dtype=torch.int8)[None]
    raw = bytes(int8_blocks(codes, torch.tensor([0.75])).view(-1).tolist())
    assert raw == scale + bytes(codes.view(torch.uint8)[0].tolist())
    f8 = torch.arange(32, dtype=torch.uint8)[None].view(torch.float8_e4m3fn)
    assert bytes(fp8_blocks(f8, torch.tensor([0.75])).view(-1).tolist()) == scale + bytes(range(32))
    q = torch.arange(32, dtype=torch.uint8)[None] // 2  # values i and i + 16 differ
    raw = bytes(int4_blocks(q, torch.tensor([[0.75]]), torch.tensor([[9]]), 32).view(-1).tolist())
    assert raw == scale + bytes([9]) + bytes([i // 2 | (i + 16) // 2 << 4 for i in range(16)])
    raw = bytes(fp4_blocks(q, torch.tensor([[0.75, -2.0]]), 16).view(-1).tolist())  # a scale for each half
    assert raw == scale + struct.pack("<f", -2.0) + bytes([i // 2 | (i + 16) // 2 << 4 for i in range(16)])


def zeros4(shape, value=0):
    return torch.full(shape, value, dtype=torch.uint8)


def f8_zeros(cols):
    return torch.zeros(2, cols).to(torch.float8_e4m3fn)


@pytest.mark.parametrize("bad", [
    lambda: int8_blocks(torch.zeros(2, 40, dtype=torch.int8), torch.ones(2)),  # K not a multiple of 32
    lambda: int8_blocks(torch.zeros(2, 64, dtype=torch.int16), torch.ones(2)),
    lambda: int8_blocks(torch.zeros(2, 64, dtype=torch.int8), torch.ones(3)),
    lambda: fp8_blocks(f8_zeros(48), torch.ones(2)),
    lambda: fp8_blocks(f8_zeros(64), torch.tensor([1.0, 2.0 ** 121])),  # 256 s would overflow
    lambda: fp8_blocks(f8_zeros(64), torch.tensor([1.0, float("nan")])),
    lambda: int4_blocks(zeros4((2, 80)), torch.ones(2, 1), zeros4((2, 1)), 80),  # K not a multiple of 32
    lambda: int4_blocks(zeros4((2, 96)), torch.ones(2, 2), zeros4((2, 2)), 48),  # group not a multiple of 32
    lambda: int4_blocks(zeros4((2, 96)), torch.ones(2, 1), zeros4((2, 1)), 64),  # group not dividing K
    lambda: int4_blocks(zeros4((2, 96)), torch.ones(2, 1), zeros4((2, 1)), 0),
    lambda: int4_blocks(zeros4((2, 96)), torch.ones(2, 3), zeros4((2, 2)), 32),  # scales of another shape
    lambda: int4_blocks(zeros4((2, 64), 16), torch.ones(2, 2), zeros4((2, 2)), 32),  # a code past 15
    lambda: int4_blocks(zeros4((2, 64)), torch.ones(2, 2), torch.full((2, 2), -1), 32),  # a zero point below 0
    lambda: fp4_blocks(zeros4((2, 96)), torch.ones(2, 2), 48),  # a group neither 16 nor a multiple of 32
    lambda: fp4_blocks(zeros4((2, 64), 16), torch.ones(2, 4), 16),  # a code past 15
    lambda: fp4_blocks(zeros4((2, 64)), torch.ones(2, 2), 16),  # scales of another shape
    lambda: nf4_blocks(zeros4((2, 64)), torch.ones(2, 1), 48),  # a group not a multiple of 32
    lambda: nf4_blocks(zeros4((2, 64), 16), torch.ones(2, 1), 64),  # a code past 15
])
def test_packers_refuse_what_they_cannot_pack(bad):
    with pytest.raises(ValueError):
        bad()


def layer_by_layer(lib, layers, final_norm, eps, kv_caches, x, cos_sin, slots, tables, lens, heads, kv_heads, d):
    """The decoder stack's steps through the library's own kernels, one call each."""
    t = x.shape[0]
    cos, sin = cos_sin[:, : d // 2], cos_sin[:, d // 2:]
    y, res = x, None
    for (norm1, w_qkv, b_qkv, w_o, norm2, w_gate_up, w_down), (k_cache, v_cache) in zip(layers, kv_caches):
        h, res = lib.rms_norm(y, norm1, eps, res)
        qkv = lib.linear(h, w_qkv, b_qkv)
        q = qkv[:, : heads * d].view(t, heads, d)
        k = qkv[:, heads * d:(heads + kv_heads) * d].view(t, kv_heads, d)
        v = qkv[:, (heads + kv_heads) * d:].view(t, kv_heads, d)
        lib.rotary_embedding(q, k, cos, sin)
        attn = lib.paged_decode(q, k, v, k_cache, v_cache, slots, tables, lens, d ** -0.5)
        y = lib.linear(attn.view(t, heads * d), w_o)
        h, res = lib.rms_norm(y, norm2, eps, res)
        y = lib.linear(lib.silu_and_mul(lib.linear(h, w_gate_up)), w_down)
    return lib.rms_norm(y, final_norm, eps, res)[0]


@pytest.mark.parametrize("formats", [("i8",) * 4, ("f8",) * 4, ("i4",) * 4, ("f4",) * 4, ("n4",) * 4,
                                     ("i4", "f8", "i8", "bf16")])
@pytest.mark.parametrize("dot", ["float32", "bfloat16"])
def test_decoder_stack_takes_layers_in_these_formats(native_kernels, formats, dot):
    """Two layers whose q/k/v, o, gate/up and down matrices are blocks: the stack's one call
    gives the bits of the layer-by-layer path, three decodes a step at ragged lengths."""
    if not native_kernels.vectorized:
        pytest.skip("built without AVX2: the layer-by-layer path keeps torch's small ops")
    if dot == "bfloat16" and not native_kernels.has_bf16_dot:
        pytest.skip("no AVX512-BF16 on this CPU")
    lib = cpu_kernels.CpuKernels(native_kernels.path, bf16_dot=dot == "bfloat16")
    hidden, heads, kv_heads, d, inter, block_size = 64, 4, 2, 16, 96, 16
    gen = torch.Generator().manual_seed(len(formats[0]) + 7 * (dot == "bfloat16"))

    def matrix(fmt, rows, cols, seed):
        if fmt == "bf16":
            return (torch.randn(rows, cols, generator=gen) * 0.1).bfloat16()
        return quantized(fmt, rows, cols, 32, seed)[0]

    shapes = [((heads + 2 * kv_heads) * d, hidden), (hidden, heads * d), (2 * inter, hidden), (hidden, inter)]
    layers = []
    for layer in range(2):
        w = [matrix(fmt, rows, cols, 10 * layer + i) for i, (fmt, (rows, cols)) in enumerate(zip(formats, shapes))]
        norms = [1 + 0.1 * torch.randn(hidden, generator=gen) for _ in range(2)]
        layers.append((norms[0], w[0], torch.randn(shapes[0][0], generator=gen) * 0.1, w[1], norms[1], w[2], w[3]))
    assert [getattr(layers[0][j], "block_format", "bf16") for j in (1, 3, 5, 6)] == list(formats)
    final_norm = 1 + 0.1 * torch.randn(hidden, generator=gen)
    caches = [tuple(torch.randn(12, kv_heads, block_size, d, generator=gen) for _ in range(2)) for _ in range(2)]
    lens = torch.tensor([5, 17, 40], dtype=torch.int32)
    tables = torch.randperm(12, generator=gen)[:9].view(3, 3).int()
    slots = tables[torch.arange(3), (lens - 1) // block_size].long() * block_size + (lens - 1) % block_size
    x = torch.randn(3, hidden, generator=gen)
    cos_sin = torch.randn(3, d, generator=gen)

    ours = [tuple(c.clone() for c in pair) for pair in caches]
    stack = lib.decode_stack(layers, final_norm, 1e-5, ours)
    got = lib.decode_layers(stack, x, cos_sin, slots, tables, lens, d ** -0.5)
    theirs = [tuple(c.clone() for c in pair) for pair in caches]
    want = layer_by_layer(lib, layers, final_norm, 1e-5, theirs, x, cos_sin, slots, tables, lens, heads, kv_heads, d)
    assert torch.equal(got, want) and got.isfinite().all()
    assert all(torch.equal(a, b) for pa, pb in zip(ours, theirs) for a, b in zip(pa, pb))


@pytest.mark.parametrize("fmt,zero,scale_dtype,want", [
    ("i4", 8, torch.float16, "q4_0"),  # symmetric, float16 scales (GPTQ's)
    ("i4", 7, torch.bfloat16, "q4_1"),  # zero points 0-7, 8-bit scales: z * s a float16 value
    ("i4", 15, torch.float16, "i4"),  # zero points 0-15, 11-bit scales: z * s is not
    ("i4", 8, torch.bfloat16, "q4_0"),  # a bfloat16 checkpoint's scales
    ("i4", 8, torch.float32, "i4"),  # scales no float16 holds: kept
    ("i8", None, torch.bfloat16, "q8_0"),
    ("i8", None, torch.float32, "i8"),
])
def test_smallest_blocks_hold_the_same_values(native_kernels, fmt, zero, scale_dtype, want):
    """i4 / i8 matrices whose scales (and offsets) float16 holds become GGUF's Q4_0 / Q4_1 /
    Q8_0 blocks: fewer bytes, the same widened values to the bit; others stay."""
    gen = torch.Generator().manual_seed(7)
    n, k = 24, 128
    scales = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3)
    scales = scales.to(scale_dtype).to(torch.float32)
    if fmt == "i4":
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        zeros = torch.full((n, k // 32), 8, dtype=torch.uint8) if zero == 8 else \
            torch.randint(0, zero + 1, (n, k // 32), generator=gen, dtype=torch.uint8)
        weight = int4_blocks(codes, scales, zeros, 32)
    else:
        weight = int8_blocks(torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), scales[:, 0])
    small = smallest_blocks(weight)
    assert small.block_format == want
    assert small.numel() <= weight.numel()
    assert same_bits(native_kernels.widen(small), native_kernels.widen(weight))
