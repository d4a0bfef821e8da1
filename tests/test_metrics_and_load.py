"""/metrics moves by the right amounts after known traffic; the request log; and the CI smoke:
locust, 8 users, ~15 s, no failed request (`pageserve bench serve`: tests/test_bench_serve.py)."""

from __future__ import annotations

import csv
import json
import logging
import math
import re
import subprocess
import sys

import httpx
import pytest

from tests.live_server import ROOT, InProcessServer

pytestmark = pytest.mark.server


def scrape(url: str) -> dict[str, float]:
    """`name{labels}` -> value, for every pageserve sample."""
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("pageserve:"):
            key, value = line.rsplit(" ", 1)
            out[re.sub(r',?model_name="[^"]*"', "", key).replace("{}", "")] = float(value)
    return out


def test_counters_move_by_the_right_amounts(server, caplog):
    server.wait_idle()
    before = scrape(server.url)
    tok = [httpx.post(f"{server.url}/tokenize", json={"prompt": p}).json()["count"]
           for p in ("Zebras graze at dawn", "Quantum foam bubbles", "Seven violet kites")]
    with caplog.at_level(logging.INFO, logger="pageserve.requests"):
        for p in ("Zebras graze at dawn", "Quantum foam bubbles", "Seven violet kites"):
            r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "model": server.model, "prompt": p, "max_tokens": 5, "ignore_eos": True, "temperature": 0})
            assert r.status_code == 200
        stopped = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": server.model, "prompt": "One, two, three, four,", "max_tokens": 20, "temperature": 0,
            "stop": [","]})
        assert stopped.json()["choices"][0]["finish_reason"] == "stop"
    server.wait_idle()
    after = scrape(server.url)

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)
    assert delta("pageserve:generation_tokens_total") == 15 + stopped.json()["usage"]["completion_tokens"]
    assert delta("pageserve:prompt_tokens_total") <= sum(tok) + stopped.json()["usage"]["prompt_tokens"]
    assert delta("pageserve:prompt_tokens_total") >= sum(tok)
    assert delta('pageserve:request_success_total{finished_reason="length"}') == 3
    assert delta('pageserve:request_success_total{finished_reason="stop"}') == 1
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "time_per_output_token_seconds"):
        assert delta(f"pageserve:{hist}_count") == 4, hist
    assert after["pageserve:num_requests_running"] == 0 and after["pageserve:kv_cache_usage_perc"] == 0
    assert delta("pageserve:prefix_cache_queries_total") >= sum(tok)
    lines = [r.getMessage() for r in caplog.records if r.name == "pageserve.requests"]
    assert len([m for m in lines if "finished request cmpl-" in m]) == 4
    assert any("prompt 5 tokens, output 5 tokens" in m or "output 5 tokens" in m for m in lines)
    assert not any("Zebras" in m for m in lines)  # no prompt text in the log by default


def test_preemptions_are_counted(tiny_model_dir):
    from pageserve.runtime.engine_args import EngineArgs

    srv = InProcessServer(EngineArgs(model=str(tiny_model_dir), dtype="float32", kv_cache_memory=0.0006,
                                     max_model_len=512, swap_space=0.001))
    try:
        blocks = srv.engine.config.cache.num_blocks
        per_request = 100 + 300
        n = math.ceil(blocks * 16 / per_request) + 2
        # one request of n prompts: all of them enter the engine at once
        r = httpx.post(f"{srv.url}/v1/completions", timeout=300, json={
            "model": srv.model, "prompt": [[5 + i] * 100 for i in range(n)], "max_tokens": 300,
            "ignore_eos": True})
        assert r.status_code == 200 and len(r.json()["choices"]) == n
        m = scrape(srv.url)
        assert m["pageserve:num_preemptions_total"] == srv.engine.scheduler.num_preemptions > 0
        assert m["pageserve:num_preemptions_recompute_total"] == srv.engine.scheduler.num_recomputed
        assert m['pageserve:request_success_total{finished_reason="length"}'] == n
        assert m["pageserve:generation_tokens_total"] == 300 * n
    finally:
        srv.stop()


@pytest.mark.timeout(180)
def test_locust_smoke_8_users_no_failures(server, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py", "--host", server.url, "--headless",
         "-u", "8", "-r", "8", "-t", "15s", "--only-summary", "--csv", str(tmp_path / "l")],
        cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(tmp_path / "l_stats.csv") as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    total = rows["Aggregated"]
    assert int(total["Failure Count"]) == 0
    assert int(rows["chat (stream)"]["Request Count"]) >= 5 and int(rows["completions"]["Request Count"]) >= 1
    assert int(rows["TTFT"]["Request Count"]) == int(rows["chat (stream)"]["Request Count"])
    assert int(rows["ITL"]["Request Count"]) > 0
    server.wait_idle()


def test_x_request_id_is_honored_echoed_and_safe_to_reuse(server):
    body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 30, "ignore_eos": True,
            "stream": True}
    headers = {"X-Request-Id": "client-42"}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers) as first, \
                client.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers) as second:
            assert first.status_code == second.status_code == 200  # the same id twice at once
            assert first.headers["x-request-id"] == "client-42"
            ids = set()
            for r in (first, second):
                chunks = [json.loads(l[6:]) for l in r.iter_lines() if l.startswith("data: {")]
                ids |= {c["id"] for c in chunks}
                assert sum(1 for c in chunks if c["choices"][0]["finish_reason"]) == 1
            assert ids == {"cmpl-client-42"}
    whole = httpx.post(f"{server.url}/v1/completions", headers={"X-Request-Id": "bad id with spaces"},
                       json={**body, "stream": False}, timeout=60)
    assert whole.status_code == 200 and whole.json()["id"].startswith("cmpl-") and " " not in whole.json()["id"]
    server.wait_idle()
