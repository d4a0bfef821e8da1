"""`pageserve bench serve` with `vllm bench serve`'s vocabulary: its flag names and pageserve's
older ones resolve to the same settings, each dataset builds what vLLM's does (lengths counted
by a tokenizer), the metrics and goodput follow vLLM's definitions, and runs against the real
server on the tiny model give vLLM's result keys with values the server's own counts confirm."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys

import numpy as np
import pytest

from pageserve.loadtest import bench_serve
from pageserve.loadtest.serve_datasets import WordTokens, build_dataset
from pageserve.loadtest.serve_metrics import Outcome, summarize
from tests.live_server import ROOT


def settings(*flags: str):
    return bench_serve.resolve(bench_serve.add_args(argparse.ArgumentParser()).parse_args(list(flags)))


class CharTokens:
    """A character for a token, and one BOS that the server would add: lengths in tokens can
    then be told apart from lengths in words."""
    name = "chars"

    async def encode(self, text, special=False):
        return (["<s>"] if special else []) + list(text)

    async def decode(self, ids):
        return "".join(ids)


def build(cfg, tokens=None):
    return asyncio.run(build_dataset(cfg, tokens or CharTokens()))


# ---------------------------------------------------------------- flags


@pytest.mark.unit
@pytest.mark.parametrize("old, new", [
    (["--dataset", "synthetic", "--slo-ttft-ms", "500", "--slo-e2e-ms", "900", "--slo-tpot-ms", "40",
      "--output-json", "r.json", "--no-progress", "--prefix-len", "64"],
     ["--dataset-name", "random", "--goodput", "ttft:500", "e2el:900", "tpot:40", "--save-result",
      "--result-filename", "r.json", "--disable-tqdm", "--prefix-repetition-prefix-len", "64"]),
    (["--dataset", "shared-prefix"], ["--dataset-name", "prefix_repetition"]),
    (["--dataset", "prompts.jsonl"], ["--dataset-name", "custom", "--dataset-path", "prompts.jsonl"]),
    (["--endpoint", "chat"], ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions"]),
    (["--endpoint", "completions"], ["--endpoint", "/v1/completions"]),
    (["--input-len", "300", "--output-len", "40"],
     ["--random-input-len", "300", "--random-output-len", "40", "--sharegpt-output-len", "40",
      "--custom-output-len", "40", "--prefix-repetition-output-len", "40"]),
])
def test_older_flag_names_resolve_to_the_same_settings(old, new):
    assert settings(*old) == settings(*new)


@pytest.mark.unit
def test_defaults_and_values_are_vllms():
    cfg = settings()
    assert (cfg.dataset_name, cfg.num_prompts, cfg.random_input_len, cfg.random_output_len,
            cfg.random_range_ratio, cfg.request_rate, cfg.max_concurrency) == (
        "random", 1000, 1024, 128, 0.0, float("inf"), None)
    assert cfg.percentile_metrics == ("ttft", "tpot", "itl") and cfg.metric_percentiles == (99.0,)
    assert cfg.ignore_eos and not cfg.save_result and cfg.goodput == ()  # random ignores EOS, as vLLM
    assert not settings("--dataset-name", "prefix_repetition").ignore_eos
    cfg = settings("--goodput", "ttft:500", "e2el:1e3", "--metric-percentiles", "50,99.9",
                   "--percentile-metrics", "ttft,e2el", "--base-url", "http://h:1/", "--output-json", "x.json")
    assert cfg.goodput == (("e2el", 1000.0), ("ttft", 500.0)) and cfg.metric_percentiles == (50.0, 99.9)
    assert cfg.percentile_metrics == ("ttft", "e2el") and cfg.base_url == "http://h:1"
    assert cfg.save_result and cfg.result_filename == "x.json" and cfg.endpoint == "completions"
    assert settings("--host", "10.0.0.2", "--port", "9").base_url == "http://10.0.0.2:9"
    assert settings("--temperature", "0", "--top-k", "5").sampling == (("temperature", 0.0), ("top_k", 5))
    ranged = settings("--input-len", "8:24", "--output-len", "4:12", "--dataset", "shared-prefix")
    assert ranged.suffix_range == (8, 24) and ranged.prefix_output_range == (4, 12)


@pytest.mark.unit
@pytest.mark.parametrize("flags, message", [
    (["--goodput", "ttfb:100"], "not one of"),
    (["--goodput", "ttft"], "KEY:VALUE"),
    (["--goodput", "ttft:fast"], "KEY:VALUE"),
    (["--goodput", "e2el:-1"], "non-negative"),
    (["--dataset-name", "sharegpt"], "needs --dataset-path"),
    (["--dataset-name", "random", "--dataset-path", "x.json"], "no --dataset-path"),
    (["--dataset", "synthetic", "--dataset-name", "random"], "give one"),
    (["--backend", "openai-chat", "--endpoint", "completions"], "does not serve"),
    (["--percentile-metrics", "ttft,latency"], "unknown latency"),
    (["--input-len", "9:3"], "MIN:MAX"),
    (["--max-concurrency", "0"], "at least 1"),
    (["--random-range-ratio", "1.0"], r"range-ratio must be in \[0, 1\)"),
])
def test_bad_flags_are_one_clear_error(flags, message):
    with pytest.raises(ValueError, match=message):
        settings(*flags)


# ---------------------------------------------------------------- datasets


@pytest.mark.unit
def test_random_lengths_are_tokens_around_the_length_by_the_range_ratio():
    cfg = settings("--random-input-len", "42", "--random-output-len", "10", "--random-range-ratio", "0.3",
                   "--num-prompts", "300", "--seed", "3")
    data = build(cfg)
    # vLLM: the server's BOS is taken off the length, then [floor(41 * 0.7), ceil(41 * 1.3)]
    lens = [d.prompt_len for d in data]
    assert all(len(d.prompt) == d.prompt_len for d in data)  # one character per token here
    assert min(lens) == 28 and max(lens) == 54
    assert {d.output_len for d in data} == set(range(7, 14))
    assert len({d.prompt for d in data}) == 300  # no two alike: no accidental prefix-cache hits
    assert [d.prompt for d in build(cfg)] == [d.prompt for d in data]
    other_seed = build(settings("--random-input-len", "41", "--num-prompts", "5", "--seed", "4"))
    assert other_seed[0].prompt != data[0].prompt
    fixed = build(settings("--random-input-len", "41", "--random-output-len", "10", "--num-prompts", "20"))
    assert {(d.prompt_len, d.output_len) for d in fixed} == {(40, 10)}


@pytest.mark.unit
def test_random_prefix_and_the_older_word_ranges():
    data = build(settings("--random-input-len", "11", "--random-prefix-len", "7", "--num-prompts", "20"))
    assert len({d.prompt[:7] for d in data}) == 1 and len({d.prompt for d in data}) == 20
    assert all(d.prompt_len == 17 == len(d.prompt) and d.prompt[7] == " " for d in data)
    words = build(settings("--dataset", "synthetic", "--input-len", "8:24", "--output-len", "4:12",
                           "--num-prompts", "200"), WordTokens())
    assert {len(d.prompt.split()) for d in words} == set(range(8, 25))
    assert {d.output_len for d in words} == set(range(4, 13))


@pytest.mark.unit
def test_prefix_repetition_shares_each_prefix_among_its_prompts():
    flags = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "12",
             "--prefix-repetition-suffix-len", "5", "--prefix-repetition-output-len", "7"]
    data = build(settings(*flags, "--num-prompts", "10", "--prefix-repetition-num-prefixes", "3"))
    assert len(data) == 9  # num_prompts // num_prefixes per prefix, as vLLM
    assert sorted(sum(d.prompt.startswith(p) for d in data) for p in {d.prompt[:12] for d in data}) == [3, 3, 3]
    assert {(d.prompt_len, len(d.prompt), d.output_len) for d in data} == {(17, 17, 7)}
    shuffled = [d.prompt[:12] for d in data]
    in_order = build(settings(*flags, "--num-prompts", "10", "--prefix-repetition-num-prefixes", "3",
                              "--disable-shuffle"))
    ordered = [d.prompt[:12] for d in in_order]
    assert ordered == sorted(ordered, key=ordered.index) and shuffled != ordered
    with pytest.raises(ValueError, match="at least"):
        build(settings(*flags, "--num-prompts", "2", "--prefix-repetition-num-prefixes", "3"))


def _conversation(prompt: str, reply: str | None) -> dict:
    turns = [{"from": "human", "value": prompt}] + ([{"from": "gpt", "value": reply}] if reply else [])
    return {"id": prompt[:8], "conversations": turns}


@pytest.mark.unit
def test_sharegpt_takes_first_turns_filters_like_vllm_and_oversamples(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([
        _conversation("alpha beta gamma delta epsilon", "one two three four five six"),
        _conversation("short one", "a reply that is long enough"),  # prompt: 3 tokens with BOS
        _conversation("zeta eta theta iota kappa", "too short"),  # reply: 2 tokens
        _conversation("lambda mu nu xi omicron pi", None),  # one turn
        _conversation("rho sigma tau upsilon phi", "chi psi omega and done"),
        _conversation(" ".join(["long"] * 1030), "fine reply of five"),  # prompt over 1024
    ]))
    cfg = settings("--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "2")
    data = build(cfg, Words())
    assert sorted((d.prompt, d.prompt_len, d.output_len) for d in data) == [
        ("alpha beta gamma delta epsilon", 6, 6), ("rho sigma tau upsilon phi", 6, 5)]
    fixed = build(settings("--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "3",
                           "--sharegpt-output-len", "9"), Words())
    assert {d.prompt.split()[0] for d in fixed} == {"alpha", "zeta", "rho"}  # a short reply is fine then
    assert {d.output_len for d in fixed} == {9}
    topped = build(settings("--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "5"),
                   Words())
    assert len(topped) == 5 and {d.prompt.split()[0] for d in topped} == {"alpha", "rho"}
    assert len(build(settings("--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "5",
                              "--no-oversample"), Words())) == 2


class Words(WordTokens):
    """A word for a token, and a BOS with special tokens (as a Llama tokenizer would add)."""

    async def encode(self, text, special=False):
        return (["<s>"] if special else []) + text.split()


@pytest.mark.unit
def test_custom_reads_prompts_and_their_output_tokens(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "first prompt here", "output_tokens": 5}, {"prompt": "second", "output_len": 7},
            {"prompt": "third one"}, {"prompt": "fourth and last", "output_tokens": 2}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    flags = ["--dataset-name", "custom", "--dataset-path", str(path)]
    data = build(settings(*flags, "--num-prompts", "4", "--disable-shuffle"), Words())
    assert [(d.prompt, d.prompt_len, d.output_len) for d in data] == [
        ("first prompt here", 4, 5), ("second", 2, 7), ("third one", 3, 256), ("fourth and last", 4, 2)]
    assert build(settings(*flags, "--num-prompts", "4", "--custom-output-len", "9",
                          "--disable-shuffle"), Words())[2].output_len == 9
    assert len(build(settings(*flags, "--num-prompts", "0"), Words())) == 4  # 0: every row, as vLLM
    shuffled = [d.prompt for d in build(settings(*flags, "--num-prompts", "4", "--seed", "1"), Words())]
    assert sorted(shuffled) == sorted(r["prompt"] for r in rows)
    assert len(build(settings(*flags, "--num-prompts", "7"), Words())) == 7
    path.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=":2: each line needs a string 'prompt'"):
        build(settings(*flags), Words())


# ---------------------------------------------------------------- metrics


def outcome(start, ttft, latency, tokens, itl=None, ok=True, prompt_len=10):
    return Outcome(prompt_len=prompt_len, success=ok, start=start, ttft=ttft, latency=latency,
                   output_tokens=tokens, itl=itl or [], error="" if ok else "HTTP 500")


@pytest.mark.unit
def test_metrics_and_goodput_follow_vllms_definitions():
    # times in binary fractions, so that per-second buckets hold no rounding surprises
    outs = [outcome(0.0, 0.125, 1.0, 8, [0.125] * 7),  # TPOT 125 ms
            outcome(0.5, 0.25, 2.25, 5, [0.5] * 4),  # TPOT 500 ms
            outcome(1.25, 0.0625, 0.0625, 1),  # one token: TPOT 0 for goodput, left out of TPOT's stats
            outcome(0.25, 0.0, 0.5, 0, ok=False)]
    metrics, percentiles = ("ttft", "tpot", "itl", "e2el"), (50.0, 90.0, 99.9)
    r = summarize(outs, 4.0, {"ttft": 200.0, "tpot": 200.0}, metrics, percentiles)
    assert (r["completed"], r["failed"], r["total_input_tokens"], r["total_output_tokens"]) == (3, 1, 30, 14)
    assert r["output_lens"] == [8, 5, 1, 0] and r["errors"] == ["", "", "", "HTTP 500"]
    assert r["request_throughput"] == 0.75 and r["output_throughput"] == 3.5
    assert r["total_token_throughput"] == (30 + 14) / 4.0
    assert r["request_goodput"] == 2 / 4.0  # the first and the one-token request
    assert summarize(outs, 4.0, {"e2el": 1500.0}, metrics, percentiles)["request_goodput"] == 2 / 4.0
    assert summarize(outs, 4.0, {"tpot": 0.0}, metrics, percentiles)["request_goodput"] == 1 / 4.0
    assert summarize(outs, 4.0, {}, metrics, percentiles)["request_goodput"] is None
    ttfts = [125.0, 250.0, 62.5]
    assert r["mean_ttft_ms"] == pytest.approx(np.mean(ttfts)) and r["std_ttft_ms"] == pytest.approx(np.std(ttfts))
    assert r["median_tpot_ms"] == pytest.approx(312.5)
    itls = [125.0] * 7 + [500.0] * 4
    for p in percentiles:
        key = "99.9" if p == 99.9 else str(int(p))
        assert r[f"p{key}_itl_ms"] == pytest.approx(np.percentile(itls, p))
        assert r[f"p{key}_e2el_ms"] == pytest.approx(np.percentile([1000.0, 2250.0, 62.5], p))
    assert "p99_ttft_ms" not in r and "mean_client_queue_time_ms" not in r
    assert r["max_concurrent_requests"] == 2  # [0, 1) and [0.5, 2.75) overlap; [1.25, 1.3125) joins the second
    assert r["max_output_tokens_per_s"] == 8.0  # second 0: 7 pieces of the first, 1 of the second
    assert r["throughput_timeline"] == [8, 4, 2, 0, 0]
    empty = summarize([outcome(0.0, 0.0, 0.1, 0, ok=False)], 1.0, {"ttft": 1.0}, ("ttft",), (99.0,))
    assert (empty["completed"], empty["request_goodput"], empty["mean_ttft_ms"], empty["p99_ttft_ms"]) == (
        0, 0.0, 0.0, 0.0)


# ---------------------------------------------------------------- against the real server


def run_bench(*flags: str) -> dict:
    return bench_serve.main(bench_serve.add_args(argparse.ArgumentParser()).parse_args(list(flags)))


@pytest.mark.server
def test_random_run_has_vllms_keys_and_the_servers_counts(tiny_server, tiny_model_dir, tmp_path, capsys):
    run_bench("--base-url", tiny_server.url, "--random-input-len", "40", "--random-range-ratio", "0.5",
              "--random-output-len", "6", "--num-prompts", "8", "--max-concurrency", "3",
              "--request-rate", "50", "--goodput", "ttft:600000", "tpot:600000", "e2el:600000",
              "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99.9",
              "--save-result", "--save-detailed", "--result-dir", str(tmp_path / "out"),
              "--result-filename", "r.json", "--disable-tqdm", "--output-png", "", "--temperature", "0")
    r = json.loads((tmp_path / "out" / "r.json").read_text())
    assert (r["completed"], r["failed"], r["num_prompts"], r["max_concurrency"], r["request_rate"]) == (
        8, 0, 8, 3, 50.0)
    assert r["backend"] == "openai" and r["model_id"] == r["tokenizer_id"] == tiny_server.model
    # the server's usage: prompts cut to [20, 60] of its own tokens (the tiny vocabulary splits
    # words into several tokens, so a word count would be far off)
    assert all(20 <= n <= 60 for n in r["input_lens"]) and len(set(r["input_lens"])) > 2
    assert all(3 <= n <= 9 for n in r["output_lens"])  # ignore_eos: each gets its drawn length
    assert r["total_input_tokens"] == sum(r["input_lens"]) and r["total_output_tokens"] == sum(r["output_lens"])
    assert r["request_throughput"] == pytest.approx(8 / r["duration"])
    assert r["output_throughput"] == pytest.approx(sum(r["output_lens"]) / r["duration"])
    assert r["request_goodput"] == r["request_throughput"]  # a generous SLO: everyone meets it
    assert r["errors"] == [""] * 8 and all(isinstance(t, str) and t for t in r["generated_texts"])
    assert all(t > 0 for t in r["ttfts"])
    assert all(1 <= len(i) + 1 <= n for i, n in zip(r["itls"], r["output_lens"]))  # a piece per token or fewer
    assert all(lat >= t for lat, t in zip(r["latencies"], r["ttfts"]))
    assert 1 <= r["max_concurrent_requests"] <= 3 and r["max_output_tokens_per_s"] >= 1
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < r[f"median_{name}_ms"] <= r[f"p99.9_{name}_ms"] and r[f"std_{name}_ms"] >= 0
        assert r[f"p50_{name}_ms"] == pytest.approx(r[f"median_{name}_ms"])
    assert r["mean_e2el_ms"] == pytest.approx(1000 * sum(r["latencies"]) / 8)
    strict = run_bench("--base-url", tiny_server.url, "--random-input-len", "12", "--random-output-len", "3",
                       "--num-prompts", "2", "--goodput", "ttft:0.001", "--disable-tqdm", "--temperature", "0",
                       "--machine-limits", str(tiny_model_dir))
    assert strict["completed"] == 2 and strict["request_goodput"] == 0  # nobody meets it
    limits = strict["limits"]  # measured after the run, on the model the server serves
    assert limits["memory_floor_ms"] > 0 and limits["matmul_64_ms"] > 0
    assert limits["matmul_ceiling_64_tok_s"] == pytest.approx(64e3 / limits["matmul_64_ms"])
    printed = capsys.readouterr().out
    ratio = strict["output_throughput"] / limits["matmul_ceiling_64_tok_s"] * 100
    assert f"= {ratio:.0f}% of the 64-row matmul ceiling" in printed
    assert f"= {strict['median_itl_ms'] / limits['memory_floor_ms']:.2f}x the memory floor" in printed
    assert "input_lens" not in strict and "p99_ttft_ms" in strict and "p99_e2el_ms" not in strict
    tiny_server.wait_idle()


@pytest.mark.server
def test_sharegpt_and_custom_lengths_come_from_the_servers_tokenizer(tiny_server, tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    replies = ["The quick brown fox.", "Paged attention keeps blocks.", "Numbers: 1 2 3 4 5 6 7 8 9"]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([_conversation(f"Tell me about the {topic} please", reply)
                                for topic, reply in zip(("fox", "cache", "numbers"), replies)]))
    r = run_bench("--base-url", tiny_server.url, "--dataset-name", "sharegpt", "--dataset-path", str(path),
                  "--num-prompts", "3", "--ignore-eos", "--save-detailed", "--disable-tqdm", "--temperature", "0")
    assert sorted(r["output_lens"]) == sorted(len(tok.encode(x, add_special_tokens=False)) for x in replies)
    rows = [{"prompt": "The lazy dog", "output_tokens": 4}, {"prompt": "def add(a, b):", "output_tokens": 7}]
    path = tmp_path / "custom.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in rows))
    r = run_bench("--base-url", tiny_server.url, "--dataset-name", "custom", "--dataset-path", str(path),
                  "--num-prompts", "2", "--ignore-eos", "--save-detailed", "--disable-tqdm", "--temperature", "0")
    assert sorted(r["output_lens"]) == [4, 7]
    assert sorted(r["input_lens"]) == sorted(len(tok.encode(x["prompt"])) for x in rows)
    tiny_server.wait_idle()


@pytest.mark.server
@pytest.mark.slow
def test_the_cli_with_pageserves_older_flags_streams_chat_and_plots(tiny_server, tmp_path):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    proc = subprocess.run(
        [sys.executable, "-m", "pageserve.app.cli", "bench", "serve", "--base-url", tiny_server.url,
         "--endpoint", "chat", "--dataset", "shared-prefix", "--prefix-len", "16",
         "--prefix-repetition-num-prefixes", "2", "--input-len", "4:8", "--output-len", "3:3", "--num-prompts", "4",
         "--ignore-eos", "--temperature", "0",
         "--slo-e2e-ms", "600000", "--output-json", str(out_json), "--output-png", str(out_png), "--no-progress"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Serving Benchmark Result" in proc.stdout and "Request goodput (req/s):" in proc.stdout
    r = json.loads(out_json.read_text())
    assert (r["completed"], r["backend"], r["dataset_name"], r["total_output_tokens"]) == (
        4, "openai-chat", "prefix_repetition", 12)
    assert r["total_input_tokens"] > 4 * (16 + 4)  # and the chat template's own tokens
    assert r["request_goodput"] == r["request_throughput"] and "input_lens" not in r
    assert out_png.stat().st_size > 1000 and out_png.read_bytes()[:4] == b"\x89PNG"
    tiny_server.wait_idle()


def test_machine_limits_that_cannot_be_measured_leave_the_run_alone(tmp_path, capsys):
    assert bench_serve.measure_limits(str(tmp_path / "no-such-model"), [0.01], 1.0) is None
    assert "machine limits not measured" in capsys.readouterr().out
