"""Quantized checkpoints: each format, written in the test by loadtest/quantized_copy.py (packed
by hand from the format's specification), served with greedy tokens identical to HF
transformers in float32, through both storages (the C linear's blocks, and the packed tensors of
the torch/Triton path). compressed-tensors checkpoints are loaded by transformers itself (through
the compressed-tensors library, dequantized), as are vLLM's block-wise `fp8` ones (dequantized by
transformers' own FP8 reader); transformers cannot load AWQ or GPTQ without GPU packages, and
reads per-tensor `fp8` scales (AutoFP8's) not at all, so those are checked against our own
dequantized float32 copy of the same codes (quantized_copy's `reference`), loaded by
transformers as a plain model. bitsandbytes writes its own NF4 copy (through transformers), and
its own dequantization is the reference."""

from __future__ import annotations

import json
import logging
import random

import pytest
import torch

from pageserve.loadtest.quantized_copy import FORMATS, quantized_copy
from pageserve.loadtest.tiny_model import build_tiny_model
from pageserve.runtime import LLM, SamplingParams
from pageserve.runtime.models.loader import ModelLoadError
from tests.conftest import assert_pool_clean
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.engine

GROUP = {"ct-w4a16": 32, "ct-w4a16-asym": 64, "awq": 32, "gptq": 128, "fp8-block": 128, "ct-fp8-block": 64,
         "ct-w8a16": 64, "gptq-int8": 32}
# rows of multiples of 32, also per rank; qwen3's and mixtral's stacked w13 past 64 KiB, so that
# the CPU moves them into huge pages (and the experts' views must follow)
STATIC = ("ct-fp8-static", "ct-int8-static", "fp8-static", "modelopt-fp8")  # with an input_scale a layer
MOE_SHAPES = {"qwen3_moe": {"moe_intermediate_size": 128, "head_dim": 32},
              "qwen2_moe": {"moe_intermediate_size": 64, "shared_expert_intermediate_size": 128}, "mixtral": {}}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny Llama with 128-wide rows, so that groups of 32, 64 and 128 all fit."""
    return build_tiny_model(tmp_path_factory.mktemp("quant") / "src", hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in (4, 9, 40, 90)]


def hf_expected(fmt: str, out, ref, prompts, n: int = 16):
    if fmt.endswith("nvfp4"):  # compressed-tensors dequantizes FP4 in bfloat16 (MXFP4's exactly): test_fp4_values
        return hf_greedy(ref, prompts, n)
    if fmt == "fp8-block":  # transformers dequantizes block-wise FP8 itself on a CPU
        return hf_greedy(out, prompts, n)
    if fmt.startswith("ct-"):  # transformers + compressed-tensors read the quantized files themselves
        from transformers import AutoModelForCausalLM, CompressedTensorsConfig

        model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                                     quantization_config=CompressedTensorsConfig(dequantize=True))
        return hf_greedy(None, prompts, n, hf_model=model)
    return hf_greedy(ref, prompts, n)


def ours(model_dir, prompts, n: int = 16, **kw) -> list[list[int]]:
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=0.02, max_num_batched_tokens=32, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    assert_pool_clean(llm.engine)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("fmt", FORMATS)
def test_format_parity(tmp_path, source, prompts, fmt, caplog):
    """The C linear's blocks (CPU, float32): greedy tokens equal HF's on the same quantized
    values, prompts chunked into 32-token steps beside decodes; the start-up log names the
    method and the bytes saved."""
    out, ref = tmp_path / fmt, tmp_path / f"{fmt}-ref"
    quantized_copy(source, out, fmt, group_size=GROUP.get(fmt, 128), reference=ref)
    expected = hf_expected(fmt, out, ref, prompts)
    with caplog.at_level(logging.INFO, logger="pageserve.runtime.quantization.load"):
        got, llm = ours(out, prompts)
    assert got == expected
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("quantized weights"))
    assert "8 layers stored as blocks" in line and "saved" in line, line
    assert ("static activation scales are not used" in caplog.text) == (fmt in STATIC)
    layer = llm.engine.runner.model.layers[0]
    assert layer.mlp.down_proj.weight.dtype == torch.uint8  # kept compact, not dequantized
    # float32 scales (ct-*) keep the checkpoint's own blocks; GPTQ's float16 ones, symmetric, fit Q4_0
    kept = {"ct-int8": {"i8"}, "ct-int8-static": {"i8"}, "awq": {"i4", "q4_1"}, "gptq": {"q4_0"}, "ct-nvfp4": {"f4"},
            "ct-w8a16": {"i8"}, "gptq-int8": {"q8_0"}, "bnb-nf4": {"n4"},
            "bnb-nf4-single": {"n4"}, "bnb-int8": {"i8"},
            "modelopt-nvfp4": {"f4"}, "ct-mxfp4": {"f4"}}
    assert layer.mlp.down_proj.weight.block_format in kept.get(fmt, {"f8" if "fp8" in fmt else "i4"})


@pytest.mark.parametrize("fmt,block", [("ct-w4a16", "q4_0"), ("ct-int8", "q8_0")])
def test_bfloat16_scales_take_gguf_blocks(tmp_path, source, prompts, fmt, block):
    """Scales stored in bfloat16 (as llm-compressor writes them for a bfloat16 model) are float16
    values: the C linear reads GGUF's smaller blocks, the same values (cpu_blocks.smallest_blocks);
    against HF on the dequantized copy (transformers would dequantize in bfloat16, rounding)."""
    out, ref = tmp_path / fmt, tmp_path / f"{fmt}-ref"
    quantized_copy(source, out, fmt, group_size=32, reference=ref, scale_dtype=torch.bfloat16)
    got, llm = ours(out, prompts)
    assert got == hf_greedy(ref, prompts, 16)
    assert llm.engine.runner.model.layers[0].self_attn.qkv_proj.weight.block_format == block


@pytest.mark.parametrize("fmt", ["ct-w4a16-asym", "gptq", "ct-fp8", "ct-int8", "fp8-tensor", "fp8-block",
                                 "ct-fp8-block", "ct-fp8-static", "ct-int8-static", "modelopt-fp8",
                                 "modelopt-fp8-pcpt", "modelopt-fp8-pb-wo", "ct-nvfp4", "modelopt-nvfp4",
                                 "ct-mxfp4", "ct-w8a16", "gptq-int8", "bnb-nf4", "bnb-nf4-single", "bnb-int8"])
def test_packed_storage_parity(tmp_path, source, prompts, fmt, caplog):
    """Without the C kernels (--enforce-eager on CPU): the packed tensors the Triton kernels take,
    dequantized by the torch path; the same tokens as HF."""
    out, ref = tmp_path / fmt, tmp_path / f"{fmt}-ref"
    quantized_copy(source, out, fmt, group_size=GROUP.get(fmt, 128), reference=ref)
    with caplog.at_level(logging.INFO, logger="pageserve.runtime.quantization.load"):
        got, llm = ours(out, prompts, enforce_eager=True)
    assert got == hf_expected(fmt, out, ref, prompts)
    assert ("static activation scales are not used" in caplog.text) == (fmt in STATIC)  # (torch's path)
    weight = llm.engine.runner.model.layers[1].self_attn.qkv_proj.weight
    fp8, fp4 = "fp8" in fmt, fmt.endswith("fp4")
    int8 = fmt.startswith("ct-int8") or fmt in ("ct-w8a16", "gptq-int8", "bnb-int8")
    assert weight.dtype == (torch.float8_e4m3fn if fp8 else torch.int8 if int8 else torch.int32)
    assert weight.quant.kind == ("fp8" if fp8 else "int8" if int8 else "fp4" if fp4 else "nf4" if "nf4" in fmt
                                 else "int4")
    if fmt in STATIC:  # q, k, v's static scales are 1, 2 and 3 / 56: the fused layer takes the largest
        assert weight.quant.input_scale == pytest.approx(3 / 56)
        assert llm.engine.runner.model.layers[1].self_attn.o_proj.weight.quant.input_scale == pytest.approx(1 / 56)
    else:
        assert weight.quant.input_scale is None
    if fmt in ("ct-w8a16", "gptq-int8"):  # int8 codes with a scale for each group
        assert weight.quant.group_size == GROUP[fmt]
        assert weight.quant.scales.shape == (weight.shape[0], 128 // GROUP[fmt])
    if fp4:  # a scale for each 16 (NVFP4) or 32 (MXFP4) columns, and no zero points
        assert weight.quant.group_size == (32 if fmt == "ct-mxfp4" else 16) and weight.quant.zeros is None
    if fmt.endswith("block") or fmt.endswith("pb-wo"):  # each 32 of a row's 128 columns their block's scale
        assert weight.quant.group_size == 32 and weight.quant.scales.shape == (weight.shape[0], 128 // 32)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_online_fp8(tmp_path, source, prompts, arch):
    """--quantization fp8 on an unquantized checkpoint: the decoder layers' matrices (and every
    expert's) in FP8 with a scale per output row (amax / 448), the embedding, lm_head and router
    as they are; against HF on those values, computed here."""
    from safetensors.torch import load_file, save_file

    if arch != "llama":
        source = build_tiny_model(tmp_path / "src", arch, hidden_size=128, intermediate_size=256, **MOE_SHAPES[arch])
    ref = tmp_path / "ref"
    ref.mkdir()
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            (ref / f.name).write_bytes(f.read_bytes())
    tensors = load_file(source / "model.safetensors")
    for name, w in tensors.items():
        if name.endswith("_proj.weight"):
            scale = w.float().abs().amax(dim=1, keepdim=True) / 448
            tensors[name] = (w.float() / scale).to(torch.float8_e4m3fn).float() * scale
    save_file(tensors, ref / "model.safetensors")
    got, llm = ours(source, prompts, quantization="fp8")
    assert got == hf_greedy(ref, prompts, 16)
    model = llm.engine.runner.model
    assert model.layers[0].self_attn.o_proj.weight.block_format == "f8"
    assert model.lm_head.weight.dtype != torch.uint8
    if arch != "llama":
        experts = model.layers[1].mlp.experts
        assert experts.w2.block_format == "f8" and len(experts.parts["w13"]) == experts.w13.shape[0]
        assert model.layers[1].mlp.gate.weight.dtype == torch.float32


@pytest.mark.parametrize("change,message", [
    ({"config_groups": {"g": {"weights": {"num_bits": 2, "type": "int", "strategy": "group", "group_size": 32},
                              "format": "pack-quantized"}}}, "2-bit int weights"),
    ({"kv_cache_scheme": {"num_bits": 8, "type": "int"}}, "KV-cache quantization .* 8-bit int"),
    ({"config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "block",
                                          "block_structure": [128, 48]}}}}, "FP8 weights in blocks of \\[128, 48\\]"),
    ({"config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "tensor_group"}}}},
     "FP8 weights by tensor_group"),
    ({"config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                              "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                    "dynamic": False}}}}, "static symmetric by token"),
    ({"config_groups": {"g": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                              "input_activations": {"num_bits": 8, "type": "int", "strategy": "tensor",
                                                    "symmetric": False, "dynamic": False},
                              "format": "int-quantized"}}}, "static asymmetric"),
    ({"config_groups": {"static": {"weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
                                   "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor"}},
                        "weight-only": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}},
     "8-bit groups with static activation scales beside 8-bit groups without"),
    ({"quant_method": "bitsandbytes"}, "bitsandbytes: a config that loads neither"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "fp4"}, "4-bit fp4 weights"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
      "bnb_4bit_quant_storage": "bfloat16"}, "stored as bfloat16"),
    ({"quant_method": "awq", "version": "gemv"}, "version gemv"),
    ({"quant_method": "gptq", "bits": 3}, "3-bit weights"),
    ({"config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 48},
                              "format": "pack-quantized"}}}, "not whole groups of \\[48\\]"),
    ({"quant_method": "gptq", "bits": 8, "sym": False}, "asymmetric 8-bit weights"),
    ({"config_groups": {"a": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32},
                              "format": "pack-quantized"},
                        "b": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                              "format": "pack-quantized"}}}, "4-bit and 8-bit pack-quantized"),
    ({"config_groups": {"g": {"weights": {"num_bits": 8, "type": "int", "strategy": "group", "group_size": 32},
                              "input_activations": {"num_bits": 8, "type": "int", "strategy": "token"},
                              "format": "pack-quantized"}}}, "packed INT8 weights with quantized activations"),
    ({"quant_method": "gptq", "checkpoint_format": "marlin"}, "Marlin-only"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "static activation scales and block-wise weights"),
    ({"quant_method": "fp8", "weight_block_size": [128, 48]}, "weight_block_size \\[128, 48\\]"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "in e5m2"),
    ({"quant_method": "modelopt", "quant_algo": "MXFP8"}, "modelopt: quant_algo MXFP8"),
    ({"quant_method": "modelopt_fp4", "quant_algo": "MXFP8"}, "modelopt: quant_algo MXFP8"),  # vLLM's name, read
    ({"config_groups": {"g": {"weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                          "group_size": 16, "symmetric": False}, "format": "nvfp4-pack-quantized"}}},
     "asymmetric NVFP4"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "modelopt NVFP4: a quantized layer's weight is none"),
    ({"config_groups": {"g": {"weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 16},
                              "format": "mxfp4-pack-quantized"}}}, "4-bit float weights in format mxfp4"),
    ({"quant_method": "modelopt", "quantization": {"quant_algo": "W4A8_AWQ"}}, "modelopt: quant_algo W4A8_AWQ"),
    ({"quant_method": "modelopt", "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4"}},
     "kv_cache_quant_algo NVFP4"),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_scheme": {"num_bits": 4, "type": "float"}},
     "KV-cache quantization .* 4-bit float"),
])
def test_refused_at_start_up(tmp_path, source, change, message):
    """What is not served is refused before any weight loads, in one line naming it."""
    out = tmp_path / "q"
    quantized_copy(source, out, "ct-w4a16", group_size=32)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"].update(change)
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=message) as e:
        LLM(str(out), dtype="float32")
    assert "\n" not in str(e.value)


def test_fp4_values(tmp_path, source):
    """compressed-tensors' own decompression (in bfloat16) of our ct-nvfp4 and ct-mxfp4 copies
    gives the reference's float32 values rounded to bfloat16 (MXFP4's exactly: powers of two
    times e2m1 values): the codes' order in a byte, the e2m1 table, the global scale's division
    and the E8M0 exponents are the formats'; ModelOpt's NVFP4 copy, converted by
    compressed-tensors' own converter (renames, and 1 / weight_scale_2), decompresses alike, to
    a bfloat16 ulp."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import MXFP4, NVFP4
    from safetensors.torch import load_file

    for fmt in ("ct-nvfp4", "modelopt-nvfp4", "ct-mxfp4"):
        mx = fmt == "ct-mxfp4"
        scheme = QuantizationScheme(targets=["Linear"], **(MXFP4 if mx else NVFP4))
        out, ref = tmp_path / fmt, tmp_path / f"{fmt}-ref"
        quantized_copy(source, out, fmt, reference=ref)
        tensors, want = load_file(out / "model.safetensors"), load_file(ref / "model.safetensors")
        if fmt.startswith("modelopt"):  # (a 0-d global scale would have torch divide in bfloat16: stored as [1])
            tensors = {k: v.reshape(1) if k.endswith("global_scale") else v
                       for k, v in ModelOptNvfp4Converter(targets=["re:.*_proj$"]).process(tensors).items()}
        for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
            local = {k.removeprefix(name + "."): v for k, v in tensors.items() if k.startswith(name + ".")}
            compressor = MXFP4PackedCompressor if mx else NVFP4PackedCompressor
            got, values = compressor.decompress(local, scheme)["weight"], want[name + ".weight"]
            assert got.dtype == torch.bfloat16
            if fmt.startswith("ct"):
                assert torch.equal(got, values.bfloat16()), (fmt, name)
                assert not mx or torch.equal(got.float(), values), name
            else:  # 1 / (1 / weight_scale_2) moves a last float32 bit, which may round to the next bfloat16
                torch.testing.assert_close(got.float(), values, rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("fmt", ["ct-w8a16", "gptq-int8"])
def test_eight_bit_integer_weights_by_channel(tmp_path, source, prompts, fmt):
    """8-bit integer weights with one scale a row (W8A16 by channel, GPTQ's group_size -1): the
    reference's tokens, kept as int8 codes with a scale a row, in both storages."""
    out, ref = tmp_path / fmt, tmp_path / f"{fmt}-ref"
    quantized_copy(source, out, fmt, group_size=-1, reference=ref)
    expected = hf_expected(fmt, out, ref, prompts)
    for eager in (False, True):
        got, llm = ours(out, prompts, enforce_eager=eager)
        assert got == expected, eager
    quant = llm.engine.runner.model.layers[0].mlp.down_proj.weight.quant
    assert quant.kind == "int8" and quant.group_size == 256  # one group of K: weight-only on every backend


def test_modelopt_kv_cache_algo_is_a_scheme():
    """ModelOpt's kv_cache_quant_algo FP8 (hf_quant_config.json's layout) is a float8 scheme per
    tensor, as a kv_cache_scheme: every attention layer must then have its scales."""
    from pageserve.runtime.quantization.methods import kv_cache_scheme

    legacy = {"quant_method": "modelopt", "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "fp8"}}
    assert kv_cache_scheme(legacy) == kv_cache_scheme({"kv_cache_scheme": "static"})
    assert kv_cache_scheme(legacy)["strategy"] == "tensor"
    assert kv_cache_scheme({"quant_method": "modelopt", "quantization": {"quant_algo": "FP8"}}) is None


def test_modelopt_legacy_config_file(tmp_path, source):
    """hf_quant_config.json is read where config.json has no quantization_config, and not
    where it has one."""
    out = tmp_path / "q"
    quantized_copy(source, out, "modelopt-fp8")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    from pageserve.runtime.models.loader import read_config
    assert read_config(out)["quantization_config"]["quantization"]["quant_algo"] == "FP8"
    (out / "hf_quant_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="hf_quant_config.json"):
        read_config(out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "fp8"}}))
    assert read_config(out)["quantization_config"] == {"quant_method": "fp8"}  # the file is not read


def test_a_vision_language_models_text_part(tmp_path, prompts):
    """A vision-language checkpoint whose language model is quantized (config.json's
    quantization_config at the top level, beside the text_config): its reference's tokens; a
    quantized vision tower is refused in one line."""
    import re

    from pageserve.loadtest import quantized_copy as qc
    from pageserve.loadtest.tiny_vlm import build_gemma3

    src = build_gemma3(tmp_path / "src")
    out, ref = tmp_path / "q", tmp_path / "ref"
    quantized_copy(src, out, "ct-fp8", reference=ref)
    got, llm = ours(out, prompts)
    assert llm.engine.runner.model.layers[0].mlp.down_proj.weight.block_format == "f8"
    assert got == ours(ref, prompts)[0]
    every_layer = re.compile(r"(.*\.layers\.\d+\..*(?:q|k|v|o|gate|up|down)_proj)\.weight")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(qc, "LINEAR", every_layer)
        quantized_copy(src, tmp_path / "all", "ct-fp8")
    with pytest.raises(ModelLoadError, match="vision_tower.* are not supported") as e:
        LLM(str(tmp_path / "all"), dtype="float32")
    assert "\n" not in str(e.value)


def test_gptq_act_order_refused(tmp_path, source):
    """A GPTQ g_idx that reorders the input channels (desc_act) is refused by name; the plain
    k // G one, with desc_act set, is served."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "q"
    quantized_copy(source, out, "gptq", group_size=32)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["desc_act"] = True
    (out / "config.json").write_text(json.dumps(cfg))
    LLM(str(out), dtype="float32")  # loads
    tensors = load_file(out / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(ModelLoadError, match="act-order"):
        LLM(str(out), dtype="float32")
    tensors[name] = torch.arange(tensors[name].numel(), dtype=torch.int32) // 32  # the plain one again
    zeros = "model.layers.0.mlp.up_proj.qzeros"
    tensors[zeros] = torch.full_like(tensors[zeros], -1)  # every stored nibble 15: zero points of 16
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(ModelLoadError, match="zero points past 15 .* stores each minus one"):
        LLM(str(out), dtype="float32")


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_groups_must_be_the_configs_group_size(tmp_path, source, fmt):
    """Groups are read at the config's group_size: scale rows that make groups of another size
    (AutoGPTQ rounds them up for a K that is not a multiple of it) are refused, not read as
    groups of K / rows."""
    out = tmp_path / "q"
    quantized_copy(source, out, fmt, group_size=32)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 64
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"(128|256) input columns in (4|8) groups, which is not groups of "
                                             "the config's group_size 64"):
        LLM(str(out), dtype="float32")


def test_forced_method_must_match(tmp_path, source):
    out = tmp_path / "q"
    quantized_copy(source, out, "awq", group_size=32)
    with pytest.raises(ModelLoadError, match="--quantization gptq, but the checkpoint is quantized with awq"):
        LLM(str(out), dtype="float32", quantization="gptq")
    with pytest.raises(ModelLoadError, match="Marlin kernels are not part of pageserve"):
        LLM(str(out), dtype="float32", quantization="awq_marlin")


@pytest.mark.parametrize("eager", [False, True])
def test_block_wise_fp8_on_tensor_parallel_ranks(tmp_path, source, prompts, eager):
    """Block-wise FP8 (Qwen's -FP8 layout, 128x128): TP 2 cuts the row-parallel matrices inside a
    block (64 columns of 128 a rank: each 32 columns keep their block's scale) and gives the
    reference's tokens, in the C linear's blocks and in the packed tensors."""
    out, ref = tmp_path / "q", tmp_path / "ref"
    quantized_copy(source, out, "fp8-block", group_size=128, reference=ref)
    got, llm = ours(out, prompts, tensor_parallel_size=2, enforce_eager=eager)
    llm.engine.shutdown()
    assert got == hf_greedy(ref, prompts, 16)


@pytest.mark.parametrize("fmt", ["awq", "ct-fp8", "fp8-block"])
def test_quantized_layers_with_a_bias(tmp_path, prompts, fmt):
    """Qwen2's q/k/v have a bias beside their quantized weights: it loads as a dense tensor (it
    was taken for one of the quantized layer's tensors, and the checkpoint refused)."""
    from safetensors.torch import load_file, save_file

    src = build_tiny_model(tmp_path / "src", "qwen2", hidden_size=128, intermediate_size=256)
    tensors, gen = load_file(src / "model.safetensors"), torch.Generator().manual_seed(1)
    for name in [n for n in tensors if n.endswith("_proj.bias")]:  # (transformers starts them at zero)
        tensors[name] = torch.randn(tensors[name].shape, generator=gen)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    out, ref = tmp_path / "q", tmp_path / "ref"
    quantized_copy(src, out, fmt, group_size=GROUP.get(fmt, 128), reference=ref)
    got, llm = ours(out, prompts)
    assert llm.engine.runner.model.layers[0].self_attn.qkv_proj.bias.abs().sum() > 0
    assert got == hf_expected(fmt, out, ref, prompts)


def test_tensor_parallel_shards_on_group_boundaries(tmp_path, source, prompts):
    """TP 2: each rank holds its rows (q/k/v, gate/up) or its whole groups of columns (o_proj,
    down_proj) of a 4-bit checkpoint (integer, and NVFP4's groups of 16), the same tokens as HF;
    a split inside a group is refused."""
    for fmt in ("ct-w4a16-asym", "modelopt-nvfp4"):
        out, ref = tmp_path / fmt, tmp_path / f"{fmt}-ref"
        quantized_copy(source, out, fmt, group_size=32, reference=ref)
        got, llm = ours(out, prompts, tensor_parallel_size=2)
        llm.engine.shutdown()
        assert got == hf_expected(fmt, out, ref, prompts), fmt
    quantized_copy(source, tmp_path / "g128", "ct-w4a16", group_size=128)
    with pytest.raises(Exception, match="group boundaries"):
        LLM(str(tmp_path / "g128"), dtype="float32", tensor_parallel_size=2)


@pytest.mark.parametrize("arch,fmt,kw", [("qwen3_moe", "ct-w4a16", {}), ("mixtral", "gptq", {}),
                                         ("qwen2_moe", "fp8-block", {}),
                                         ("mixtral", "ct-int8", {"enforce_eager": True}),
                                         ("mixtral", "modelopt-fp8", {"enforce_eager": True}),
                                         ("qwen3_moe", "modelopt-nvfp4", {}),
                                         ("qwen3_moe", "ct-nvfp4", {"enforce_eager": True}),
                                         ("qwen3_moe", "ct-w4a16", {"tensor_parallel_size": 2})])
def test_quantized_experts(tmp_path, prompts, arch, fmt, kw, caplog):
    """Every expert's matrices quantized (Qwen3-30B-A3B-FP8, Mixtral GPTQ...): each expert kept
    compact, in the C linear's blocks or the packed tensors, stacked, and multiplied as a linear
    layer is; the same tokens as HF on the dequantized copy (transformers' own MoE quantized
    readers need a GPU). TP 2 splits each expert as its dense weights."""
    src = build_tiny_model(tmp_path / "src", arch, hidden_size=128, intermediate_size=256, **MOE_SHAPES[arch])
    out, ref = tmp_path / "q", tmp_path / "ref"
    quantized_copy(src, out, fmt, group_size=32, reference=ref)
    with caplog.at_level(logging.INFO, logger="pageserve.runtime.quantization.load"):
        got, llm = ours(out, prompts, **kw)
    if kw.get("tensor_parallel_size"):
        llm.engine.shutdown()
    else:
        experts = llm.engine.runner.model.layers[0].mlp.experts
        packed = kw.get("enforce_eager", False)
        want = {"ct-w4a16": torch.int32, "gptq": torch.int32, "fp8-block": torch.float8_e4m3fn, "ct-int8": torch.int8,
                "modelopt-fp8": torch.float8_e4m3fn, "ct-nvfp4": torch.int32}
        assert experts.w13.dtype == (want[fmt] if packed else torch.uint8) and experts.w13.dim() == 3
        assert len(experts.parts["w13"]) == len(experts.parts["w2"]) == experts.w13.shape[0]
        for e, part in enumerate(experts.parts["w13"]):  # views of the stack where it lies now
            assert part.data_ptr() == experts.w13[e].data_ptr()
        if fmt == "gptq":  # symmetric, float16 scales: every expert in GGUF's Q4_0 blocks, as linear layers
            assert experts.w13.block_format == experts.parts["w2"][1].block_format == "q4_0"
        line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("quantized weights"))
        # a layer's q/k/v, o, the experts' w13 and w2 (and the shared expert's gate/up and down)
        assert f"{2 * (4 + 2 * (arch == 'qwen2_moe'))} layers stored as {'packed' if packed else 'blocks'}" in line
    assert got == hf_greedy(ref, prompts, 16)
