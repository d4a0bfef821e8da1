"""nano-vllm's offline workload (`pageserve bench offline --dataset nano`) and the model shapes it
runs on."""

import json
import random
import time

import pytest

from pageserve.loadtest.bench_nano import MAX_TOKEN_ID, nano_workload
from pageserve.loadtest.model_shapes import QWEN2_5_0_5B, build_shape, shape_config, shape_of


@pytest.mark.unit
def test_workload_is_seeded_and_within_bounds():
    prompts, outs = nano_workload(64, 100, 1024, seed=3)
    assert len(prompts) == len(outs) == 64
    assert all(100 <= len(p) <= 1024 for p in prompts) and all(100 <= n <= 1024 for n in outs)
    assert all(0 <= t <= MAX_TOKEN_ID for p in prompts for t in p)
    assert (prompts, outs) == nano_workload(64, 100, 1024, seed=3)
    assert (prompts, outs) != nano_workload(64, 100, 1024, seed=4)
    prompts, outs = nano_workload(50, 7, 7, seed=0)
    assert {len(p) for p in prompts} == set(outs) == {7}
    with pytest.raises(ValueError, match="--min-len"):
        nano_workload(4, 10, 9, seed=0)


@pytest.mark.unit
def test_workload_draws_what_nano_vllms_bench_draws():
    # nano-vllm's bench.py: seed(0), then every prompt (length, then ids), then every max_tokens
    random.seed(0)
    want = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    want_outs = [random.randint(100, 1024) for _ in range(256)]
    assert nano_workload(256, 100, 1024, seed=0) == (want, want_outs)


@pytest.mark.unit
def test_qwen2_5_0_5b_shape():
    assert shape_config("qwen2.5-0.5b") == {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16"}
    assert shape_config("qwen2.5-0.5b", num_hidden_layers=1)["num_hidden_layers"] == 1
    assert QWEN2_5_0_5B["num_hidden_layers"] == 24  # an override copies
    with pytest.raises(ValueError, match="unknown shape"):
        shape_config("qwen9")


@pytest.mark.unit
def test_shape_survives_transformers_config():
    """What transformers writes for the shape (config.json) reads back as the same fields."""
    import transformers

    cfg = shape_config("qwen2.5-0.5b")
    fields = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")}
    written = transformers.Qwen2Config(**fields, dtype="bfloat16", architectures=cfg["architectures"]).to_dict()
    assert shape_of(written) == cfg


@pytest.mark.unit
def test_shape_is_built_once_in_bfloat16(tmp_path):
    from safetensors import safe_open

    path = build_shape("tiny", root=tmp_path)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert build_shape("tiny", root=tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert shape_of(json.loads((path / "config.json").read_text())) == shape_config("tiny")
    with safe_open(path / "model.safetensors", "pt") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"BF16"}
    assert build_shape("tiny", root=tmp_path, num_hidden_layers=1) != path
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no half-built folder left


@pytest.mark.engine
@pytest.mark.parametrize("extra", [[], ["--async-scheduling"]])  # on CPU off by default
def test_smoke_runs_end_to_end(tmp_path, extra):
    from pageserve.app import cli

    path = tmp_path / "nano.json"
    assert cli.main(["bench", "offline", "--dataset", "nano", "--smoke", "--output-json", str(path), *extra]) == 0
    r = json.loads(path.read_text())
    assert r["async_scheduling"] == bool(extra)
    _, outs = nano_workload(r["num_seqs"], r["min_len"], r["max_len"], r["seed"])
    assert (r["num_seqs"], r["min_len"], r["max_len"]) == (8, 8, 32)
    assert r["output_tokens"] == sum(outs) and r["prompt_tokens"] > 0
    assert r["output_tok_s"] == pytest.approx(r["output_tokens"] / r["seconds"])
    assert r["total_tok_s"] == pytest.approx((r["prompt_tokens"] + r["output_tokens"]) / r["seconds"])
    assert r["model_shape"] == shape_config("tiny")
    assert r["device"]["type"] == "cpu" and r["device"]["name"] and r["device"]["torch"]
    assert "triton" in r["device"]
    pub = r["public_figures"]
    assert (pub["vllm_output_tok_s"], pub["nano_vllm_triton_output_tok_s"], pub["target"]["output_tok_s"]) == \
        (17700, 24100, 30000)


class _ClockEvent:
    """torch.cuda.Event's timing calls, on the host clock."""

    def __init__(self, enable_timing: bool):
        assert enable_timing
        self.at = None

    def record(self):
        self.at = time.perf_counter()

    def elapsed_time(self, end) -> float:
        return (end.at - self.at) * 1e3


@pytest.mark.engine
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_step_timeline_brackets_each_forward_with_device_events(tiny_model_dir, async_scheduling):
    from pageserve.loadtest.bench_nano import _summarize_steps, _time_steps, _untime_steps
    from pageserve.runtime import LLM, SamplingParams

    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=0.01, async_scheduling=async_scheduling)
    engine = llm.engine
    timeline = _time_steps(engine, _ClockEvent)
    prompts = [[5 + i, 6, 7, 8] for i in range(3)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    _untime_steps(engine)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert "step" not in vars(engine) and "execute" not in vars(engine.runner)  # the classes' methods again
    ran = [t for t in timeline if t[0]]
    assert ran and all(len(events) == 2 for *_, events in ran)  # one forward a step that ran one
    assert all(not events for requests, *_, events in timeline if not requests)
    for *_, seconds, (start, end) in ran:  # inside the step's wall time
        assert 0 < start.elapsed_time(end) <= seconds * 1e3
    summary = _summarize_steps(timeline)
    assert sum(v["steps"] for v in summary.values()) == len(timeline)
    decode = summary["decode <= 16"]
    assert 0 < decode["device_mean_ms"] <= decode["mean_ms"]
