"""The machine limits `pageserve bench offline` prints beside its figures: the bytes one decode
step reads, the floor they set, the matmul time at 1 and 64 rows and the engine's own step."""

import json

import pytest
import torch

from pageserve.loadtest import machine_limits
from pageserve.runtime import LLM
from tests.conftest import assert_pool_clean

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("tied", [False, True])
def test_step_weights_are_the_linears_and_the_head(tmp_path, tied):
    from pageserve.loadtest.tiny_model import build_tiny_model

    llm = LLM(str(build_tiny_model(tmp_path / "m", tie_word_embeddings=tied)), dtype="float32",
              kv_cache_memory=0.01)
    model = llm.engine.runner.model
    mats = machine_limits.step_weights(model)
    cfg = model.cfg
    assert len(mats) == 4 * cfg.num_layers + 1  # qkv, o, gate_up, down per layer; the head
    assert mats[-1].shape == (cfg.vocab_size, cfg.hidden_size)
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size * 4
    biases = sum(p.numel() * 4 for n, p in model.named_parameters() if n.endswith(".bias"))
    want = sum(w.numel() * 4 for w in mats) + norms + biases
    assert machine_limits.step_weight_bytes(model) == want


def test_measure_reports_consistent_figures(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=0.05, max_num_seqs=64)
    r = machine_limits.measure(llm)
    assert r["read_bandwidth_gb_s"] > 0.1
    assert r["memory_floor_ms"] == pytest.approx(r["step_weight_bytes"] / (r["read_bandwidth_gb_s"] * 1e9) * 1e3)
    assert 0 < r["matmul_1_ms"] and 0 < r["matmul_64_ms"]
    assert 0 < r["engine_step_1_ms"] and 0 < r["engine_step_64_ms"]
    assert r["engine_64_tok_s"] == pytest.approx(64e3 / r["engine_step_64_ms"])
    lines = machine_limits.summary(r)
    assert any("memory floor" in line for line in lines) and any("% of the matmul ceiling" in line for line in lines)
    assert_pool_clean(llm.engine)


def test_null_model_engine_bench(tiny_model_dir):
    """The null model leaves the engine's own work: every request still gets all its tokens."""
    from pageserve.loadtest import bench_engine
    import argparse

    args = bench_engine.add_args(argparse.ArgumentParser()).parse_args(
        ["--model", str(tiny_model_dir), "--num-seqs", "8", "--output-len", "12", "--rounds", "1"])
    r = bench_engine.main(args)
    assert r["num_seqs"] == 8 and len(r["rounds"]) == 1
    assert r["rounds"][0]["steps"] >= 12 and r["p50_ms"] > 0


def test_bf16_copy_rounds_every_weight_and_names_no_gguf(tmp_path):
    """The benchmarks' bfloat16 copy: each floating-point tensor rounded to bfloat16, the
    config saying so, and no GGUF source left to make the engine read Q4_1 blocks instead."""
    from safetensors.torch import load_file

    from pageserve.loadtest.bf16_copy import bf16_copy
    from pageserve.loadtest.tiny_model import build_tiny_model
    from pageserve.runtime.models.loader import GGUF_SOURCE

    src = build_tiny_model(tmp_path / "src")
    (src / GGUF_SOURCE).write_text("/nowhere/model.gguf")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "dtype": "float32", "torch_dtype": "float32"}))
    out = bf16_copy(src, tmp_path / "out")
    before, after = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys() and len(after) > 4
    for name, t in after.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, before[name].to(torch.bfloat16)), name
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"
    assert not (out / GGUF_SOURCE).exists() and (out / "tokenizer.json").is_file()
