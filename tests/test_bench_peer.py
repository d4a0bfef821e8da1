"""`pageserve bench peer` (the same load against several servers, rounds alternated, one JSON and
one plot) against the real server on the tiny model, and `pageserve bench accuracy` (next-token
agreement and KL divergence against HF) on the tiny model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import psutil
import pytest

from pageserve.loadtest import bench_accuracy, bench_peer


def run(module, *flags: str) -> dict:
    return module.main(module.add_args(argparse.ArgumentParser()).parse_args(list(flags)))


@pytest.mark.server
def test_every_server_every_round_every_concurrency(tiny_server, tmp_path, capsys):
    out = tmp_path / "peer.json"
    url = tiny_server.url
    # 16-20 tokens out: a third of the tiny model's 384 tokens are lone bytes of no whole character,
    # so a stream of 4-6 of them now and then held no text at all (a failed request to the bench)
    r = run(bench_peer, "--server", f"a={url}", "--server", f"b={url}", "--streams", "1,3", "--rounds", "2",
            "--prompt-words", "12", "--output-len", "16:20", "--min-requests", "3", "--requests-per-stream", "1",
            "--output-json", str(out))
    cells = r["cells"]
    assert len(cells) == 2 * 2 * 2 and {(c["round"], c["streams"], c["server"]) for c in cells} == {
        (i, s, n) for i in (0, 1) for s in (1, 3) for n in ("a", "b")}
    # rotated: at one concurrency the two rounds start with different servers
    firsts = [next(c["server"] for c in cells if c["round"] == i and c["streams"] == 1) for i in (0, 1)]
    assert firsts[0] != firsts[1]
    for c in cells:
        assert c["failed"] == 0 and c["completed"] == 3 and c["output_tok_s"] > 0
        assert 0 < c["ttft_p50_ms"] <= c["ttft_p99_ms"] and 0 < c["itl_p50_ms"] <= c["itl_p99_ms"]
    row = r["table"]["3"]
    assert row["a"]["output_tok_s"] == [c["output_tok_s"] for c in cells if c["streams"] == 3 and c["server"] == "a"]
    lo, hi = row["a"]["vs b"]
    assert lo == pytest.approx(min(row["a"]["output_tok_s"]) / max(row["b"]["output_tok_s"]))
    assert lo <= hi
    saved = json.loads(out.read_text())
    assert saved["load"]["prompt_words"] == 12 and saved["provenance"]["cpu_count"] >= 1
    png = out.with_suffix(".png").read_bytes()
    assert png[:4] == b"\x89PNG" and len(png) > 5000
    printed = capsys.readouterr().out
    assert "a / b:" in printed and "tok/s" in printed
    tiny_server.wait_idle()


def test_bad_server_flags_are_one_clear_error():
    with pytest.raises(ValueError, match="NAME=VALUE"):
        run(bench_peer, "--server", "http://127.0.0.1:1")
    with pytest.raises(ValueError, match="at least one"):
        run(bench_peer)


@pytest.mark.slow
def test_a_pageserve_it_starts_is_stopped_after(tiny_model_dir):
    r = run(bench_peer, "--pageserve", f"tiny=--model {tiny_model_dir} --dtype float32 --kv-cache-memory 0.01",
            "--streams", "1", "--rounds", "1", "--prompt-words", "8", "--output-len", "3:3", "--min-requests", "2")
    assert r["cells"][0]["completed"] == 2 and r["pageserve_flags"]["tiny"].startswith("--model")
    # its own server by the model folder (another test worker may be serving meanwhile)
    left = [p for p in psutil.process_iter(["cmdline"]) if str(tiny_model_dir) in (p.info["cmdline"] or [])
            and "serve" in (p.info["cmdline"] or []) and p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left


@pytest.mark.engine
def test_accuracy_scores_every_generated_position(tiny_model_dir, capsys):
    r = run(bench_accuracy, "--model", str(tiny_model_dir), "--dtypes", "float32", "--positions", "40",
            "--max-tokens", "20")
    pairs = r["pairs"]
    assert set(pairs) == {"pageserve float32 vs HF float32", "pageserve float32 vs HF bfloat16",
                          "HF bfloat16 vs HF float32"}
    exact = pairs["pageserve float32 vs HF float32"]
    assert exact["positions"] >= 40 and exact["top1_agreement"] == 1.0 and exact["max_kl"] < 1e-6
    assert pairs["HF bfloat16 vs HF float32"]["mean_kl"] > exact["mean_kl"]
    assert "top-1 agreement" in capsys.readouterr().out


@pytest.mark.unit
def test_servers_get_ports_below_the_ephemeral_range():
    """A port of the kernel's ephemeral range, handed to a child to bind, may meanwhile become an
    outgoing connection's source port (with two test workers a server's bind failed so)."""
    from pageserve.runtime.ports import free_port

    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if not ranges.is_file():
        pytest.skip("no Linux port range to stay below")
    low = int(ranges.read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1 and all(1024 <= p < low for p in ports), ports
