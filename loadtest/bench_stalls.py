"""What one heavy but valid request costs everyone else: each case runs against a real server
while a second client asks /health every 10 ms, and prints how long /health waited at most (a
stalled event loop answers nothing), how long the request took, and how much the server's
memory (its processes' RSS) grew at most meanwhile.

    python -m pageserve.loadtest.bench_stalls [--model DIR] [--output-json PATH]

Without --model it builds the tiny random-weight model the tests use. One case times a small
`guided_choice` request while another client's grammar takes long to compile; the last three
(a 30 MB prompt, 64 MB of header lines, 40 uploads that stop) each run on a server of their own."""

from __future__ import annotations

import argparse
import socket
import tempfile
import threading
import time
from pathlib import Path

import httpx

from pageserve.loadtest.common import save_json, start_server

SLOW_REGEX = "[ab]*a[ab]{40}"  # an automaton that grows exponentially: compiles until its time limit


def _rss_mib(pid: int) -> float:
    """The resident memory of `pid` and its children (the body checker, grammar compilers)."""
    total, pids = 0, [pid]
    while pids:
        p = pids.pop()
        try:
            total += next(int(line.split()[1]) for line in open(f"/proc/{p}/status") if line.startswith("VmRSS"))
            pids += [int(c) for c in open(f"/proc/{p}/task/{p}/children").read().split()]
        except (OSError, StopIteration):
            pass
    return total / 1024


def _health_waits(url: str, pid: int, stop: threading.Event, waits: list[float], rss: list[float]) -> None:
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            t = time.perf_counter()
            client.get(f"{url}/health")
            waits.append(time.perf_counter() - t)
            rss.append(_rss_mib(pid))
            time.sleep(0.01)


def _timed(url: str, pid: int, path: str, body: dict | bytes) -> dict:
    """The request's status and seconds, and /health's waits and the server's RSS meanwhile."""
    stop, waits, rss = threading.Event(), [], []
    before = _rss_mib(pid)
    poller = threading.Thread(target=_health_waits, args=(url, pid, stop, waits, rss))
    poller.start()
    time.sleep(0.05)
    t = time.perf_counter()
    if isinstance(body, bytes):
        r = httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"}, timeout=600)
    else:
        r = httpx.post(f"{url}{path}", json=body, timeout=600)
    seconds = time.perf_counter() - t
    stop.set()
    poller.join()
    waits.sort()
    return {"status": r.status_code, "request_s": round(seconds, 2), "health_max_s": round(waits[-1], 3),
            "health_p50_s": round(waits[len(waits) // 2], 3), "health_samples": len(waits),
            "rss_growth_mib": round(max(rss, default=before) - before)}


def _held(url: str, pid: int, send) -> dict:
    """What the server holds while `send(host, port)` opens connections and sends bytes that
    make no whole request (its sockets are closed after); /health's waits meanwhile."""
    stop, waits, rss = threading.Event(), [], []
    before = _rss_mib(pid)
    poller = threading.Thread(target=_health_waits, args=(url, pid, stop, waits, rss))
    poller.start()
    host, port = url.removeprefix("http://").rsplit(":", 1)
    t = time.perf_counter()
    socks = send(host, int(port))
    seconds = time.perf_counter() - t
    time.sleep(2)  # what it holds, after the server has read what came
    stop.set()
    poller.join()
    for sock in socks:
        sock.close()
    waits.sort()
    return {"status": 0, "request_s": round(seconds, 2), "health_max_s": round(waits[-1], 3),
            "health_p50_s": round(waits[len(waits) // 2], 3), "health_samples": len(waits),
            "rss_growth_mib": round(max(rss, default=before) - before)}


def _header_lines(host: str, port: int, megabytes: int = 64) -> list[socket.socket]:
    sock = socket.create_connection((host, port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: localhost\r\n")
    lines = b"".join(b"x-%06d: %s\r\n" % (i, b"v" * 100) for i in range(9000))  # about 1 MB
    try:
        for _ in range(megabytes):
            sock.sendall(lines)
    except OSError:  # refused part-way
        pass
    return [sock]


def _stalled_uploads(host: str, port: int, count: int = 40, megabytes: int = 30) -> list[socket.socket]:
    socks, chunk = [], b" " * (1 << 20)
    for _ in range(count):
        sock = socket.create_connection((host, port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % ((megabytes + 1) << 20))
        try:
            for _ in range(megabytes):
                sock.sendall(chunk)
        except OSError:  # refused part-way
            pass
        socks.append(sock)
    return socks


def cases(url: str, pid: int, model: str) -> dict[str, dict]:
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 490,
            "ignore_eos": True}
    out = {
        "chat n=128, 20 logprobs, 490 tokens": _timed(url, pid, "/v1/chat/completions", {
            **chat, "n": 128, "logprobs": True, "top_logprobs": 20}),
        "completions n=128, 20 logprobs, 490 tokens": _timed(url, pid, "/v1/completions", {
            "model": model, "prompt": "hi", "max_tokens": 490, "ignore_eos": True, "n": 128, "logprobs": 20}),
        "embeddings, 1,000 short inputs": _timed(url, pid, "/v1/embeddings", {
            "model": model, "input": [f"a short text, number {i}" for i in range(1000)]}),
        # per-request sampling arrays (the tiny model's vocabulary has 384 tokens)
        "completions n=128, logit_bias 383, 256 stop ids, min_tokens, 200 tokens": _timed(url, pid, "/v1/completions", {
            "model": model, "prompt": "hi", "n": 128, "max_tokens": 200, "min_tokens": 200, "temperature": 1.0,
            "logit_bias": {str(i): 0.01 for i in range(383)}, "stop_token_ids": list(range(256))}),
    }
    # a stored response of 20 MB (reasoning items the template does not render), then 1,000
    # references to its one message
    thoughts = [{"type": "reasoning", "summary": [{"type": "summary_text", "text": f"thought {i} " * 10_000}]}
                for i in range(200)]
    stored = httpx.post(f"{url}/v1/responses", timeout=120, json={
        "model": model, "input": [*thoughts, {"role": "user", "content": "x"}], "max_output_tokens": 1}).json()
    message = httpx.get(f"{url}/v1/responses/{stored['id']}/input_items", params={"limit": 1}).json()["data"][0]
    refs = [{"type": "item_reference", "id": message["id"]}] * 1000
    out["responses, 1,000 item references"] = _timed(url, pid, "/v1/responses", {
        "model": model, "input": refs, "max_output_tokens": 1, "store": False})
    # a grammar that compiles until its limit, then a small guided_choice beside it
    slow = threading.Thread(target=lambda: httpx.post(f"{url}/v1/completions", timeout=600, json={
        "model": model, "prompt": "a", "max_tokens": 1, "guided_regex": SLOW_REGEX}))
    slow.start()
    time.sleep(1.0)
    out["guided_choice beside a slow grammar"] = _timed(url, pid, "/v1/completions", {
        "model": model, "prompt": "yes or no?", "max_tokens": 3, "guided_choice": ["yes", "no"]})
    slow.join()
    return out


# cases whose memory is measured on a server of their own: memory that an earlier case's peak
# left to the allocator would hide what they take
OWN_SERVER = {
    # refused as too long (a 400)
    "completions, a prompt of 30 MB of text": lambda url, pid, model: _timed(
        url, pid, "/v1/completions",
        b'{"model": "%s", "max_tokens": 1, "prompt": "%s"}' % (model.encode(), b"hello world " * (30 << 20 >> 4))),
    "64 MB of header lines on one connection (no request)": lambda url, pid, model: _held(url, pid, _header_lines),
    "40 uploads of 31 MB stopped 1 MB short (no request)": lambda url, pid, model: _held(url, pid, _stalled_uploads),
}


def _served(model: str, run) -> dict:
    proc, url = start_server(["--model", model, "--dtype", "float32", "--max-model-len", "1024",
                              "--kv-cache-memory", "0.5", "--served-model-name", "m"])
    try:
        return run(url, proc.pid, "m")
    finally:
        proc.terminate()
        proc.wait(30)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model directory (default: the tiny test model)")
    parser.add_argument("--output-json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        from pageserve.loadtest.tiny_model import build_tiny_model

        model = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="stalls-"))))
    results = _served(model, cases)
    for name, run in OWN_SERVER.items():
        results[name] = _served(model, run)
    print(f"{'case':72s} {'status':>6s} {'request s':>9s} {'/health max s':>13s} {'p50 s':>6s} {'+RSS MiB':>8s}")
    for name, r in results.items():
        print(f"{name:72s} {r['status']:6d} {r['request_s']:9.2f} {r['health_max_s']:13.3f} {r['health_p50_s']:6.3f} "
              f"{r['rss_growth_mib']:8d}")
    return save_json({"cases": results}, args.output_json)


if __name__ == "__main__":
    main()
