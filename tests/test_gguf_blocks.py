"""GGUF matrices kept in their quantized blocks on the CPU path (runtime/models/weight_formats.py):
the C kernels widen Q8_0, Q4_0 and Q4_1 blocks, Q4_K, Q5_K and Q6_K repacked 32 values a block,
every other quantized type repacked into k3, l4, k6, k5 or x8 (gguf_repack.py), and x8 blocks made from
any of them, to the values gguf's own dequantizer gives, the linear on blocks is the linear on
those values to the bit, and a quantized tiny Llama read from a GGUF file runs on blocks (a layer
whose q/k/v mix formats in x8) with the same tokens, logprobs and prompt logprobs as on the
dequantized float32 copy, and HF's greedy tokens."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pageserve.loadtest.tiny_model import build_tiny_model
from pageserve.runtime import LLM, SamplingParams
from pageserve.runtime.models.gguf_file import GGUFFile
from pageserve.triton_kernels import linear_plan
from pageserve.triton_kernels.cpu_kernels import blocks
from tests.hf_reference import hf_greedy
from tests.test_gguf_gemma import hf_from_gguf, write_gguf

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.unit

QTYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
          "q4_1": gguf.GGMLQuantizationType.Q4_1}


@pytest.fixture(scope="module", params=["native", "x86-64"])
def kernel(request, native_kernels):
    """The kernels built for this machine, and for any x86-64 (no AVX2, no F16C: the scalar
    paths, the software half-float conversion)."""
    if request.param == "native":
        return native_kernels
    return request.getfixturevalue("portable_kernels")


def quantized(fmt: str, rows: int, columns: int, seed: int) -> np.ndarray:
    """Random weights quantized by gguf, plus blocks of random bytes (any scale, any nibbles)."""
    rng = np.random.default_rng(seed)
    q = gguf.quants.quantize(rng.standard_normal((rows, columns)).astype(np.float32) * 0.1, QTYPES[fmt])
    noise = rng.integers(0, 256, q.shape, dtype=np.uint8)
    scales = rng.standard_normal((rows, columns // 32, 2)).astype(np.float16)
    scales[rows // 2, :2] = [[0.0, -0.0], [6e-8, -3e-5]]  # zero, negative zero, half-float subnormals
    scales = scales.view(np.uint8).reshape(rows, -1, 4)
    noise.reshape(rows, columns // 32, -1)[:, :, :4 if fmt == "q4_1" else 2] = scales[:, :, :4 if fmt == "q4_1" else 2]
    return np.concatenate([q[: rows // 2], noise[rows // 2:]])


@pytest.mark.parametrize("fmt", list(QTYPES))
def test_widened_blocks_are_gguf_dequantized_values(kernel, fmt):
    raw = quantized(fmt, 70, 96, seed=len(fmt))
    want = gguf.quants.dequantize(raw, QTYPES[fmt])
    got = kernel.widen(blocks(torch.from_numpy(raw), fmt, 96)).numpy()
    assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist()


@pytest.mark.parametrize("fmt", list(QTYPES))
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 64, 130])
def test_linear_on_blocks_is_linear_on_their_values_bit_for_bit(kernel, fmt, rows):
    # 601 outputs: whole 128-row pieces (what a thread takes at a time at one row of x), then a
    # partial one
    w = blocks(torch.from_numpy(quantized(fmt, 601, 160, seed=rows)), fmt, 160)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(601)
    wide = kernel.widen(w)
    for b in (None, bias):
        assert torch.equal(kernel(x, w, b), kernel(x, wide, b))
    plan = linear_plan.LinearPlan(kernel)  # torch's matmul is given the widened values
    assert torch.equal(plan(x, w, bias), torch.nn.functional.linear(x, wide, bias))


def test_blocks_refuse_a_wrong_size(kernel):
    with pytest.raises(ValueError):
        blocks(torch.zeros(4, 19, dtype=torch.uint8), "q4_1", 32)
    with pytest.raises(ValueError):
        blocks(torch.zeros(4, 20, dtype=torch.uint8), "q5_1", 32)
    with pytest.raises(TypeError):
        kernel(torch.randn(1, 32), torch.zeros(4, 20, dtype=torch.uint8))  # bytes without a format


KQUANTS = {"k4": (gguf.GGMLQuantizationType.Q4_K, 144, 0), "k5": (gguf.GGMLQuantizationType.Q5_K, 176, 0),
           "k6": (gguf.GGMLQuantizationType.Q6_K, 210, 208)}


def k_quantized(fmt: str, rows: int, columns: int, seed: int) -> np.ndarray:
    """Superblocks of random bytes (any scales, any codes) with finite half-float d (and dmin),
    zero and subnormal ones among them."""
    from pageserve.runtime.models.weight_formats import GGUF_KQUANTS

    qtype, size, at = KQUANTS[fmt]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * columns // 256, size), dtype=np.uint8)
    halves = rng.standard_normal((len(raw), 2)).astype(np.float16)
    halves[0], halves[1] = [0.0, -0.0], [6e-8, -3e-5]
    width = 2 if fmt == "k6" else 4  # d (and dmin)
    raw[:, at:at + width] = halves.view(np.uint8)[:, :width]
    assert GGUF_KQUANTS[qtype][0] == fmt
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("build", ["native", "avx2", "x86-64"])
@pytest.mark.parametrize("fmt", list(KQUANTS))
def test_k_quants_repacked_widen_to_gguf_values(request, build, fmt):
    """Q4_K, Q5_K and Q6_K superblocks repacked 32 values a block (k4, k5, k6): widened to gguf's values
    bit for bit in each build, and the linear on them is the linear on those values."""
    from pageserve.runtime.models.weight_formats import GGUF_KQUANTS

    lib = request.getfixturevalue({"native": "native_kernels", "avx2": "avx2_kernels",
                                   "x86-64": "portable_kernels"}[build])
    qtype = KQUANTS[fmt][0]
    raw = k_quantized(fmt, 70, 512, seed=len(fmt))
    w = blocks(torch.from_numpy(GGUF_KQUANTS[qtype][2](raw)), fmt, 512)
    want = gguf.quants.dequantize(raw, qtype)
    got = lib.widen(w).numpy()
    assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist()
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))
    assert torch.equal(lib(x, w), lib(x, torch.from_numpy(want)))


@pytest.mark.parametrize("build", ["native", "avx2", "x86-64"])
def test_x8_holds_every_gguf_format_bit_for_bit(request, build):
    """x8 blocks (a scale and an offset for each 16 values, int8 codes), made from each GGUF
    format kept here (random blocks: any codes, zero, negative zero and subnormal scales),
    widen to the very values of the blocks they came from, in each build, and the linear on
    a matrix of rows of all eight is the linear on their values."""
    from pageserve.runtime.models.weight_formats import GGUF_KQUANTS, as_x8

    lib = request.getfixturevalue({"native": "native_kernels", "avx2": "avx2_kernels",
                                   "x86-64": "portable_kernels"}[build])
    from pageserve.runtime.models.gguf_repack import repack
    from tests.kquants import random_blocks

    parts = {fmt: quantized(fmt, 6, 512, seed=9) for fmt in QTYPES}
    parts.update({fmt: GGUF_KQUANTS[KQUANTS[fmt][0]][2](k_quantized(fmt, 6, 512, seed=9)) for fmt in KQUANTS})
    rng = np.random.default_rng(9)
    parts.update({fmt: repack(random_blocks(qtype, 6, 512, rng), qtype) for fmt, qtype in (("k3", 11), ("l4", 23))})
    values = []
    for fmt, raw in parts.items():
        want = lib.widen(blocks(torch.from_numpy(raw), fmt, 512))
        got = lib.widen(blocks(torch.from_numpy(as_x8(raw, fmt)), "x8", 512))
        assert got.view(torch.int32).tolist() == want.view(torch.int32).tolist(), fmt
        values.append(want)
    fused = blocks(torch.from_numpy(np.concatenate([as_x8(raw, fmt) for fmt, raw in parts.items()])), "x8", 512)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(2))
    assert torch.equal(lib(x, fused), lib(x, torch.cat(values)))


@pytest.mark.parametrize("build", ["native", "avx2", "x86-64"])
def test_every_other_gguf_type_widens_repacked_bit_for_bit(request, build, monkeypatch):
    """Q5_0, Q5_1, Q2_K, Q3_K and the IQ and TQ types (random blocks: any codes and sub-block
    scales, zero, negative zero and subnormal half-float scales) repacked into k3, l4, k6, k5 or
    x8 widen to gguf's own values in each build, and the linear on them (one row of x: widened
    in registers; five: widened rows) is the linear on those values; a misread scale is an
    error, never a wrong weight."""
    from pageserve.runtime.models import gguf_repack
    from tests.kquants import random_blocks

    lib = request.getfixturevalue({"native": "native_kernels", "avx2": "avx2_kernels",
                                   "x86-64": "portable_kernels"}[build])
    monkeypatch.setattr(gguf_repack, "CHUNK", 1024)  # 2 rows a chunk: four, three of them in threads
    rng = np.random.default_rng(3)
    assert set(gguf_repack.REPACKED) == {t.value for t in gguf.GGMLQuantizationType if t.name.startswith(
        ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "IQ", "TQ"))}
    assert gguf_repack.IQ4NL.tolist() == list(gguf.quants.IQ4_NL.kvalues)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(4))
    for qtype, (_, _, fmt, _) in gguf_repack.REPACKED.items():
        name = gguf.GGMLQuantizationType(qtype).name
        raw = random_blocks(qtype, 8, 512, rng)
        want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype))
        assert np.isfinite(want).all() and np.signbit(want[want == 0]).any()
        w = blocks(torch.from_numpy(gguf_repack.repack(raw, qtype)), fmt, 512)
        got = lib.widen(w).numpy()
        assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist(), name
        for rows in (x[:1], x):
            assert torch.equal(lib(rows, w), lib(rows, torch.from_numpy(want))), name
    assert {gguf_repack.REPACKED[t][2] for t in (11, 20, 23, 34, 35)} == {"k3", "l4"}  # the 4-bit forms
    values, size, fmt, parts = gguf_repack.REPACKED[11]
    wrong = lambda b: (parts(b)[0][:, ::-1], None, None)  # noqa: E731 (Q3_K's scales in the wrong order)
    with pytest.MonkeyPatch.context() as m:
        m.setitem(gguf_repack.REPACKED, 11, (values, size, fmt, wrong))
        with pytest.raises(ValueError, match="Q3_K blocks that k3 would not widen"):
            gguf_repack.repack(random_blocks(11, 8, 512, rng), 11)
    damaged = random_blocks(7, 8, 512, rng)  # Q5_1 with an infinite d: gguf's values, but a broken block
    damaged[3, 24:26] = np.array([np.inf], np.float16).view(np.uint8)
    with pytest.raises(ValueError, match="Q5_1 blocks with a scale or offset that is not finite"):
        gguf_repack.repack(damaged, 7)


def half_floats(rows: int, columns: int, seed: int) -> np.ndarray:
    """Random float16 bit patterns, infinities and NaNs left out, with zeros, negative zeros,
    subnormals and the largest values among them, as float16."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 1 << 16, (rows, columns), dtype=np.uint16)
    bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF  # exponent all ones: one less
    bits[0, :6] = [0x0000, 0x8000, 0x0001, 0x83FF, 0x7BFF, 0xFBFF]
    return bits.view(np.float16)


@pytest.mark.parametrize("build", ["native", "avx2", "x86-64"])
def test_h16_blocks_are_their_half_floats(request, build):
    """h16 blocks (32 half floats) widen to the float32 of each half, bit for bit, in each build
    (F16C, and the portable build's software conversion), and the linear on them (one row of x:
    read as float16 rows, four at a time) is the linear on those values; infinities widen to
    infinities."""
    from pageserve.triton_kernels.cpu_blocks import half_blocks

    lib = request.getfixturevalue({"native": "native_kernels", "avx2": "avx2_kernels",
                                   "x86-64": "portable_kernels"}[build])
    values = torch.from_numpy(half_floats(37, 352, seed=1).astype(np.float32))  # (a last 32 past whole 64s)
    w = half_blocks(values)
    assert w.block_format == "h16" and w.shape == (37, 704)
    assert torch.equal(lib.widen(w).view(torch.int32), values.view(torch.int32))
    x = torch.randn(5, 352, generator=torch.Generator().manual_seed(5)) * 1e-3
    for rows in (x[:1], x):
        assert torch.equal(lib(rows, w), lib(rows, values))
    inf = torch.full((1, 32), float("-inf"))
    assert torch.equal(lib.widen(half_blocks(inf)), inf)
    assert half_blocks(values + 2 ** -30) is None and half_blocks(values[:, :48]) is None


@pytest.mark.parametrize("qtype", [11, 23, 1])
def test_bfloat16_arithmetic_on_the_4bit_forms_is_on_their_values(native_kernels, qtype):
    """Q3_K in k3, IQ4_XS in l4 and F16 in h16 through the bfloat16 linear (AVX512-BF16: each
    block widened, rounded to bfloat16, dotted) give what it gives on their float32 values, at
    one row of x and at many."""
    from pageserve.runtime.models import gguf_repack
    from pageserve.triton_kernels import cpu_kernels
    from pageserve.triton_kernels.cpu_blocks import half_blocks
    from tests.kquants import random_blocks

    if not native_kernels.has_bf16_dot:
        pytest.skip("no AVX512-BF16 on this CPU")
    lib = cpu_kernels.CpuKernels(native_kernels.path, bf16_dot=True)
    if qtype == 1:
        values = torch.from_numpy(half_floats(37, 768, seed=2).astype(np.float32))
        w, fmt = half_blocks(values), "h16"
    else:
        raw = random_blocks(qtype, 37, 768, np.random.default_rng(qtype))
        fmt = gguf_repack.REPACKED[qtype][2]
        w = blocks(torch.from_numpy(gguf_repack.repack(raw, qtype)), fmt, 768)
        values = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)))
    x = torch.randn(64, 768, generator=torch.Generator().manual_seed(qtype))
    for rows in (1, 5, 64):
        assert torch.equal(lib(x[:rows], w), lib(x[:rows], values)), (fmt, rows)


@pytest.mark.parametrize("tie", [True, False])
def test_the_file_streams_transformers_own_weights(tmp_path, own_cache, native_kernels, tie):
    """Read tensor by tensor (gguf_file.py), a quantized GGUF gives the very tensors, under the
    same names, that transformers' own loader dequantizes from it (Llama's q and k rows put
    back in HF's order); and each matrix kept in blocks widens to the same values, in the
    same row order."""
    from pageserve.runtime.models.gguf_file import GGUFFile
    from pageserve.runtime.models.loader import read_config, resolve_model

    model_dir = build_tiny_model(tmp_path / "hf", arch="llama", tie_word_embeddings=tie)
    path = write_gguf(model_dir, tmp_path / "tiny-q.gguf", "llama", qtype_of)
    file = GGUFFile(path, read_config(resolve_model(str(path))))
    expected = {k: v for k, v in hf_from_gguf(path).state_dict().items() if "rotary" not in k}
    if tie:
        expected.pop("lm_head.weight")
    dense = dict(file.stream())
    assert dense.keys() == expected.keys()
    assert all(torch.equal(dense[k], expected[k]) for k in dense)
    assert file.checkpoint_names() == {k: (tuple(t.shape), "F32") for k, t in dense.items()}
    formats = file.block_formats()
    assert {k: f for k, (f, _, _) in formats.items()} == {
        k: qtype_of(g).name.lower() for g, k in file.hf_names.items() if k in dense and qtype_of(g) is not None}
    kept = dict(file.stream({k: f for k, (f, _, _) in formats.items()}))
    for name, (fmt, rows, _) in formats.items():
        columns = expected[name].shape[1]
        assert kept[name].dtype == torch.uint8 and kept[name].shape[0] == rows
        assert torch.equal(native_kernels.widen(blocks(kept[name], fmt, columns)), expected[name]), name
    assert all(torch.equal(kept[k], dense[k]) for k in dense if k not in formats)


# the tiny Llama's tensors by GGUF name -> format; attn_v of layer 1 in another format than its
# q and k, so that layer's fused q/k/v stays float32
FORMATS = {"attn_q": "q4_1", "attn_k": "q4_1", "attn_v": "q4_1", "attn_output": "q4_1", "ffn_gate": "q4_0",
           "ffn_up": "q4_0", "ffn_down": "q8_0", "token_embd": "q8_0"}


def qtype_of(gguf_name: str):
    kind = gguf_name.split(".")[-2] if gguf_name.startswith("blk.") else gguf_name.split(".")[0]
    fmt = "q8_0" if gguf_name == "blk.1.attn_v.weight" else FORMATS.get(kind)
    return None if fmt is None else QTYPES[fmt]


@pytest.mark.engine
def test_a_quantized_gguf_runs_on_its_blocks(tmp_path, monkeypatch, native_kernels, own_cache):

    def everywhere(self, weights, reps=3):  # the same path at every size, whichever format is faster
        self.use_kernel = [True] * len(linear_plan.ROW_BUCKETS)
    monkeypatch.setattr(linear_plan.LinearPlan, "measure", everywhere)
    model_dir = build_tiny_model(tmp_path / "hf", arch="llama", tie_word_embeddings=True)
    path = write_gguf(model_dir, tmp_path / "tiny-q.gguf", "llama", qtype_of)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in (7, 40, 90, 150)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1)

    def run():
        llm = LLM(str(path), dtype="float32", kv_cache_memory=0.01, max_num_batched_tokens=256)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return llm.engine.runner.model, [
            (o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs],
             [d and {t: lp.logprob for t, lp in d.items()} for d in o.prompt_logprobs]) for o in outs]

    model, on_blocks = run()
    layers = model.layers
    formats = {name: getattr(w, "block_format", str(w.dtype)) for name, w in (
        ("qkv0", layers[0].self_attn.qkv_proj.weight), ("qkv1", layers[1].self_attn.qkv_proj.weight),
        ("o", layers[1].self_attn.o_proj.weight), ("gate_up", layers[0].mlp.gate_up_proj.weight),
        ("down", layers[1].mlp.down_proj.weight), ("embedding", model.embed_tokens.weight))}
    assert formats == {"qkv0": "q4_1", "qkv1": "x8", "o": "q4_1", "gate_up": "q4_0", "down": "q8_0",
                       "embedding": "q8_0"}
    assert [o[0] for o in on_blocks] == hf_greedy(None, prompts, max_new_tokens=12, hf_model=hf_from_gguf(path))
    monkeypatch.setattr(GGUFFile, "block_formats", lambda self: {})
    model, dense = run()
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    assert dense == on_blocks


Q = gguf.GGMLQuantizationType
# a file like llama.cpp's mix of that name: (q, k, o, gate and up; v; down; the embedding) -> their types,
# and the formats they run in: (o, gate_up, down, embedding, the fused q/k/v)
MIXES = {"q4_k_m": ((Q.Q4_K, Q.Q6_K, Q.Q6_K, Q.Q6_K), ["k4", "k4", "k6", "k6", "x8"]),
         "q5_k_m": ((Q.Q5_K, Q.Q6_K, Q.Q6_K, Q.Q6_K), ["k5", "k5", "k6", "k6", "x8"]),
         "q3_k_m": ((Q.Q3_K, Q.Q5_K, Q.Q4_K, Q.Q3_K), ["k3", "k3", "k4", "k3", "x8"]),
         "iq4_xs": ((Q.IQ4_XS, Q.IQ4_XS, Q.IQ4_XS, Q.IQ4_XS), ["l4"] * 5),
         # F16 matrices in h16; a q/k/v of F16 beside Q8_0 stays float32 (x8 holds no half floats)
         "f16": ((Q.F16, Q.Q8_0, Q.Q8_0, Q.F16), ["h16", "h16", "q8_0", "h16", "torch.float32"])}


@pytest.mark.engine
@pytest.mark.parametrize("mix", list(MIXES))
def test_a_k_quant_gguf_runs_on_its_repacked_blocks(tmp_path, monkeypatch, native_kernels, own_cache, mix):
    """A Q4_K_M-, Q5_K_M-, Q3_K_M-, IQ4_XS- or F16-like file (rows of 256 values) runs on its blocks
    (K-quants, Q3_K and IQ4_XS repacked, a fused q/k/v of two types in x8) with HF's greedy
    tokens on the same file, and the same tokens and logprobs as on its dequantized float32 copy.
    Q3_K and IQ4_XS weights are random blocks of the model's spread (gguf cannot quantize them)."""
    from tests.kquants import quantize_q4_k, quantize_q5_k, quantize_q6_k, quantize_random

    writers = {Q.Q4_K: quantize_q4_k, Q.Q5_K: quantize_q5_k, Q.Q6_K: quantize_q6_k,
               Q.Q3_K: lambda data: quantize_random(data, Q.Q3_K),
               Q.IQ4_XS: lambda data: quantize_random(data, Q.IQ4_XS)}
    (base, v, down, embedding), want_formats = MIXES[mix]
    plain = gguf.quants.quantize
    monkeypatch.setattr(gguf.quants, "quantize", lambda data, qtype: writers[qtype](data) if qtype in writers
                        else plain(data, qtype))

    def q4_k_m(name: str):
        if name.endswith("attn_v.weight"):
            return v
        if name.endswith("ffn_down.weight"):
            return down
        if name == "token_embd.weight":
            return embedding
        matrices = ("attn_q.weight", "attn_k.weight", "attn_output.weight", "ffn_gate.weight", "ffn_up.weight")
        return base if name.endswith(matrices) else None

    def everywhere(self, weights, reps=3):
        self.use_kernel = [True] * len(linear_plan.ROW_BUCKETS)
    monkeypatch.setattr(linear_plan.LinearPlan, "measure", everywhere)
    model_dir = build_tiny_model(tmp_path / "hf", arch="llama", tie_word_embeddings=True, hidden_size=256,
                                 intermediate_size=512)
    path = write_gguf(model_dir, tmp_path / f"tiny-{mix}.gguf", "llama", q4_k_m)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in (7, 40, 90)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)

    def run():
        llm = LLM(str(path), dtype="float32", kv_cache_memory=0.01, max_num_batched_tokens=256)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return llm.engine.runner.model, [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()}
                                                                   for d in o.outputs[0].logprobs]) for o in outs]

    model, on_blocks = run()
    layer = model.layers[1]
    formats = [getattr(w, "block_format", str(w.dtype)) for w in (
        layer.self_attn.o_proj.weight, layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight,
        model.embed_tokens.weight, layer.self_attn.qkv_proj.weight)]
    assert formats == want_formats
    assert [o[0] for o in on_blocks] == hf_greedy(None, prompts, max_new_tokens=12, hf_model=hf_from_gguf(path))
    monkeypatch.setattr(GGUFFile, "block_formats", lambda self: {})
    _, dense = run()
    assert dense == on_blocks
