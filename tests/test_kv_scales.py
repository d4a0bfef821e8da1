"""A checkpoint's float8 KV-cache scales (compressed-tensors' kv_cache_scheme, written here as
llm-compressor writes it by loadtest/kv_scales_copy.py): under --kv-cache-dtype fp8 the cache
keeps K / k_scale and V / v_scale. transformers loads such a checkpoint but does not apply the
scales, so the reference is HF float32 with its attention reading K and V through float8 at the
same scales (tests/hf_reference.py), teacher-forced on our greedy answers."""

from __future__ import annotations

import json
import logging
import random

import pytest
import torch

from pageserve.loadtest.kv_scales_copy import add_kv_scales
from pageserve.loadtest.quantized_copy import quantized_copy
from pageserve.loadtest.tiny_model import build_tiny_model
from pageserve.runtime import LLM, SamplingParams
from pageserve.runtime.models.loader import ModelLoadError
from tests.conftest import assert_pool_clean
from tests.hf_reference import hf_float8_kv, hf_token_logprobs

pytestmark = pytest.mark.engine

# |K| and |V| reach 4-5 in the tiny model: scales this large put most values among float8's
# subnormals, so that reading them at another scale (or none) is far from the reference
SCALES = {"tensor": {0: ([16.0], [12.0]), 1: ([8.0], [24.0])},
          "attn_head": {0: ([16.0, 8.0], [12.0, 24.0]), 1: ([8.0, 16.0], [24.0, 12.0])}}
TOL = 1e-3  # nats: the same arithmetic but for the order of a few float32 products


def _scales(strategy):
    return {i: (torch.tensor(k), torch.tensor(v)) for i, (k, v) in SCALES[strategy].items()}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("kvs") / "src", hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in (5, 33, 70)]


def checkpoint(source, out, strategy, weights=None):
    """A copy of `source` with `strategy`'s scales; weights: also a quantized_copy format, or
    "query": also the query's scales (llm-compressor's attention group, for FP8 attention)."""
    from safetensors.torch import load_file, save_file

    if weights and weights != "query":
        quantized_copy(source, out, weights)
    else:
        out.mkdir()
        for f in source.iterdir():
            (out / f.name).write_bytes(f.read_bytes())
    add_kv_scales(out, _scales(strategy), strategy)
    if weights == "query":
        cfg = json.loads((out / "config.json").read_text())
        fp8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False}
        cfg["quantization_config"]["config_groups"] = {"attention": {"targets": ["LlamaAttention"],
                                                                     "input_activations": fp8}}
        (out / "config.json").write_text(json.dumps(cfg))
        tensors = load_file(out / "model.safetensors")
        for i in SCALES[strategy]:
            tensors[f"model.layers.{i}.self_attn.q_scale"] = torch.full((4, 1, 1) if strategy == "attn_head" else (1,),
                                                                        0.5)
        save_file(tensors, out / "model.safetensors")
    return out


def ours(model_dir, prompts, **kw):
    """(prompt, greedy answer) pairs and each answer token's logprob [n]."""
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=0.02, max_num_batched_tokens=32, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1), use_tqdm=False)
    assert_pool_clean(llm.engine)
    seqs = [(p, list(o.outputs[0].token_ids)) for p, o in zip(prompts, outs)]
    lps = [torch.tensor([d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
           for o in outs]
    llm.engine.shutdown()
    return seqs, lps


def gap(reference, seqs, lps) -> float:
    """The largest difference between our logprobs and the reference's, and between the
    reference's best token and ours (a greedy answer the reference would not give)."""
    worst = 0.0
    for ref, lp in zip(hf_token_logprobs(reference, seqs), lps):
        worst = max(worst, (ref[:, 0] - lp).abs().max().item(), (ref[:, 1] - ref[:, 0]).max().item())
    return worst


@pytest.mark.parametrize("strategy,weights,kw", [("tensor", None, {}), ("attn_head", None, {}),
                                                 ("attn_head", None, {"enforce_eager": True}),
                                                 ("tensor", "ct-fp8", {}), ("attn_head", "query", {})])
def test_float8_cache_reads_the_checkpoints_scales(tmp_path, source, prompts, strategy, weights, kw, caplog):
    """Per tensor and per KV head, the C attention and torch's (--enforce-eager), beside FP8
    weights and beside the query's scales (not used: the query is not quantized): our answers
    and logprobs are the reference's at the checkpoint's scales, and far from it at a scale of 1
    (what a cache that ignored them would hold)."""
    out = checkpoint(source, tmp_path / "kv", strategy, weights)
    with caplog.at_level(logging.INFO, logger="pageserve.runtime.quantization.kv_scales"):
        seqs, lps = ours(out, prompts, kv_cache_dtype="fp8", **kw)
    assert f"float8 KV cache with the checkpoint's scales (by {strategy}) in 2 layers" in caplog.text
    extra = {}
    if weights == "ct-fp8":
        from transformers import CompressedTensorsConfig
        extra["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    near = gap(hf_float8_kv(out, _scales(strategy), **extra), seqs, lps)
    ones = {i: (torch.ones(len(k)), torch.ones(len(v))) for i, (k, v) in _scales(strategy).items()}
    far = gap(hf_float8_kv(out, ones, **extra), seqs, lps)
    assert near < TOL
    assert far > 100 * TOL


def test_scales_unused_without_a_float8_cache(tmp_path, source, prompts, caplog):
    """Under a float32 cache the values are kept unscaled: the answers of the same model without
    scales, and a line saying the scales are not used."""
    out = checkpoint(source, tmp_path / "kv", "tensor")
    with caplog.at_level(logging.INFO, logger="pageserve.runtime.quantization.kv_scales"):
        seqs, lps = ours(out, prompts)
    assert "float8 KV-cache scales (by tensor) are not used: the KV cache holds float32" in caplog.text
    want_seqs, want_lps = ours(source, prompts)
    assert seqs == want_seqs  # (the C or torch matmul each engine times at start-up: not bit for bit)
    assert max((a - b).abs().max().item() for a, b in zip(lps, want_lps)) < 1e-4


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_parallel_ranks_take_their_heads_and_layers_scales(tmp_path, source, prompts, parallel):
    """TP 2: each rank scales its own KV head (one of two); PP 2: each stage its own layer's:
    the tokens and logprobs of one process."""
    out = checkpoint(source, tmp_path / "kv", "attn_head")
    seqs, lps = ours(out, prompts, kv_cache_dtype="fp8", **parallel)
    want_seqs, want_lps = ours(out, prompts, kv_cache_dtype="fp8")
    assert seqs == want_seqs
    assert max((a - b).abs().max().item() for a, b in zip(lps, want_lps)) < 1e-4


@pytest.mark.parametrize("change,message", [
    ({"type": "int"}, "8-bit int static symmetric by tensor is not supported"),
    ({"dynamic": True}, "8-bit float dynamic symmetric by tensor is not supported"),
    ({"symmetric": False}, "asymmetric by tensor is not supported"),
    ({"strategy": "channel"}, "by channel is not supported"),
])
def test_schemes_not_served_are_refused_in_one_line(tmp_path, source, change, message):
    out = checkpoint(source, tmp_path / "kv", "tensor")
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"].update(change)
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=message) as e:
        LLM(str(out), dtype="float32", kv_cache_dtype="fp8")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("layer0,message", [
    (None, "no v_scale for layers.0.self_attn"),
    (([16.0], [12.0, 24.0, 1.0]), "3 values, expected 1 or 2"),
    (([0.0], [12.0]), "each finite and positive"),
    (([float("nan")], [12.0]), "each finite and positive"),
])
def test_bad_scales_are_refused(tmp_path, source, layer0, message):
    from safetensors.torch import load_file, save_file

    out = checkpoint(source, tmp_path / "kv", "tensor")
    tensors = load_file(out / "model.safetensors")
    if layer0 is None:
        del tensors["model.layers.0.self_attn.v_scale"]
    else:
        tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(layer0[0])
        tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(layer0[1])
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(out), dtype="float32", kv_cache_dtype="fp8")


def test_calibrated_scales(source, prompts):
    """kv_scales_copy's calibration: per head, the largest |K| and |V| of each KV head over 448;
    per tensor, the largest of those."""
    from pageserve.loadtest.kv_scales_copy import calibrate

    heads, whole = calibrate(source, prompts, "attn_head"), calibrate(source, prompts, "tensor")
    assert sorted(heads) == sorted(whole) == [0, 1]
    for i in heads:
        for h, w in zip(heads[i], whole[i]):
            assert h.shape == (2,) and w.shape == (1,) and bool((h > 0.001).all())
            assert torch.equal(h.max().reshape(1), w)


def test_a_vision_language_checkpoints_scales(tmp_path, caplog):
    """A vision-language model's quantization_config lives in its whole config, beside the text
    part the language model reads: its language layers' scales are found there and used."""
    from pageserve.loadtest.tiny_vlm import build_llava

    out = build_llava(tmp_path / "llava")
    layers = json.loads((out / "config.json").read_text())["text_config"]["num_hidden_layers"]
    add_kv_scales(out, {i: (torch.tensor([0.5]), torch.tensor([0.25])) for i in range(layers)}, "tensor")
    with caplog.at_level(logging.INFO, logger="pageserve.runtime.quantization.kv_scales"):
        llm = LLM(str(out), dtype="float32", kv_cache_memory=0.01, max_model_len=256, kv_cache_dtype="fp8")
    assert f"float8 KV cache with the checkpoint's scales (by tensor) in {layers} layers" in caplog.text
    found = [m.kv_scales for m in llm.engine.runner.model.modules() if getattr(m, "kv_scales", None) is not None]
    assert len(found) == layers
    assert set(found[0].key.flatten().tolist()) == {0.5} and set(found[0].output.flatten().tolist()) == {0.25}
    llm.engine.shutdown()


def test_a_scheme_that_is_no_object_is_refused(tmp_path, source):
    out = checkpoint(source, tmp_path / "kv", "tensor")
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"] = "fp8"
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="kv_cache_scheme 'fp8' is not a scheme"):
        LLM(str(out), dtype="float32")


def test_new_values_are_divided_in_float32_whatever_the_activations():
    """Under bfloat16 or float16 activations K / k_scale is made in float32, so that it is rounded
    once, to float8, as vLLM divides (rounding it to bfloat16 first moves some values)."""
    from pageserve.runtime.quantization.kv_scales import AttentionScales

    k = torch.randn(64, 2, 16, generator=torch.Generator().manual_seed(0)).bfloat16()
    s = AttentionScales.of(torch.tensor([3.0, 0.7]), torch.tensor([5.0, 0.3]), 2, torch.bfloat16)
    assert s.query.dtype == s.output.dtype == torch.bfloat16 and s.key.dtype == s.value.dtype == torch.float32
    once = (k / s.key).to(torch.float8_e4m3fn)
    assert torch.equal(once.float(), (k.float() / torch.tensor([3.0, 0.7])[:, None]).to(torch.float8_e4m3fn).float())
    assert not torch.equal(once.float(), (k / s.key.bfloat16()).to(torch.float8_e4m3fn).float())  # twice


@pytest.mark.parametrize("layout", ["output_scale", "proj_scale", "kv_scale", "kv_scale, no scheme",
                                    "output_scale, no scheme", "modelopt"])
def test_older_layouts_of_autofp8_and_others(tmp_path, source, prompts, layout):
    """AutoFP8's FP8-KV checkpoints (static activations, `"kv_cache_scheme": "static"`, the
    scales as k_proj / v_proj's output_scale), k_proj.k_scale / v_proj.v_scale, and the single
    kv_scale (for K and V alike) of vLLM's and TGI's older tools, which an unquantized
    checkpoint carries without any scheme, and ModelOpt's (k_proj.k_scale / v_proj.v_scale with
    hf_quant_config.json's kv_cache_quant_algo): the reference's logprobs at those scales."""
    from safetensors.torch import load_file, save_file

    out, ref = tmp_path / "q", tmp_path / "ref"
    if layout == "kv_scale, no scheme":
        ref = checkpoint(source, out, "tensor")  # (its scales are replaced below)
        cfg = json.loads((out / "config.json").read_text())
        del cfg["quantization_config"]
        (out / "config.json").write_text(json.dumps(cfg))
    else:
        quantized_copy(source, out, "modelopt-fp8" if layout == "modelopt" else "fp8-static", reference=ref)
    scales = _scales("tensor")
    if layout.startswith("kv_scale"):
        scales = {i: (k, k) for i, (k, _) in scales.items()}
    tensors = {n: t for n, t in load_file(out / "model.safetensors").items() if not n.endswith(("k_scale", "v_scale"))}
    for i, (k, v) in scales.items():
        attn = f"model.layers.{i}.self_attn"
        if layout.startswith("kv_scale"):
            tensors[f"{attn}.kv_scale"] = k
        else:
            proj = layout in ("proj_scale", "modelopt")
            tensors[f"{attn}.k_proj.{'k_scale' if proj else 'output_scale'}"] = k
            tensors[f"{attn}.v_proj.{'v_scale' if proj else 'output_scale'}"] = v
    save_file(tensors, out / "model.safetensors")
    if "no scheme" not in layout and layout != "modelopt":
        cfg = json.loads((out / "config.json").read_text())
        cfg["quantization_config"]["kv_cache_scheme"] = "static"
        (out / "config.json").write_text(json.dumps(cfg))
    seqs, lps = ours(out, prompts, kv_cache_dtype="fp8")  # the C linear: weight-only, as the reference
    assert gap(hf_float8_kv(ref, scales), seqs, lps) < TOL
    assert gap(hf_float8_kv(ref, {i: (torch.ones(1), torch.ones(1)) for i in scales}), seqs, lps) > 20 * TOL
