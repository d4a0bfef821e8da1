"""Soak: minutes of mixed load on one `pageserve serve` process, then what it left behind.

The load, from --concurrency clients at once, each picking its next request at random:
streamed chats, whole completions, streams the client drops after a few tokens, long prompts,
n = 2 with logprobs, JSON-schema chats (structured output), and bad requests that must get a
400. Afterwards: requests served, unexpected errors (target 0), the server's RSS growth from
the end of warm-up to the end (target under 5%), and the KV blocks free once the load stops
(target: all). Not part of the test suite: `pageserve bench soak --duration 300`."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time

import httpx

from pageserve.loadtest.common import save_json, start_server

WORDS = ("paged attention keeps the cache in blocks so that memory is never wasted on padding and "
         "requests of any length share one pool while the scheduler admits them step by step").split()
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                          "tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                                   "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--duration", type=float, default=300, help="seconds of load")
    parser.add_argument("--warmup", type=float, default=60, help="seconds before the RSS baseline")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=float, default=0.1,
                        help="GiB; small, so that the load also preempts")
    parser.add_argument("--swap-space", type=float, default=0.01,
                        help="GiB; smaller than the pool, so that preemptions both swap and recompute")
    parser.add_argument("--no-json-schema", action="store_true", help="leave out structured-output requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None, metavar="PATH")
    return parser


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class Soak:
    def __init__(self, args, url: str, model: str):
        self.args, self.url, self.model = args, url, model
        self.rng = random.Random(args.seed)
        self.served: dict[str, int] = {}
        self.errors: list[str] = []
        kinds = {"chat_stream": 40, "completion": 20, "dropped_stream": 15, "long_prompt": 8,
                 "n2_logprobs": 7, "bad_request": 5, "json_schema": 5}
        if args.no_json_schema:
            del kinds["json_schema"]
        self.kinds, self.weights = list(kinds), list(kinds.values())

    def _text(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def _chat(self, content: str, **extra) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": content}], **extra}

    async def _stream(self, http: httpx.AsyncClient, path: str, body: dict, drop_after: int | None) -> None:
        async with http.stream("POST", path, json={**body, "stream": True}) as r:
            if r.status_code != 200:
                raise AssertionError(f"{r.status_code} {(await r.aread())[:200]!r}")
            n, done = 0, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                if line[6:].startswith('{"error"'):
                    raise AssertionError(f"error event {line[:200]}")
                n += 1
                if drop_after is not None and n >= drop_after:
                    return  # closing the response mid-stream: the server must abort it
            if not done:
                raise AssertionError("the stream ended without [DONE]")

    async def one(self, http: httpx.AsyncClient, kind: str) -> None:
        rng = self.rng
        if kind == "chat_stream":
            await self._stream(http, "/v1/chat/completions",
                               self._chat(self._text(rng.randint(5, 60)), max_tokens=rng.randint(8, 96),
                                          temperature=0.8), None)
        elif kind == "dropped_stream":
            await self._stream(http, "/v1/chat/completions",
                               self._chat(self._text(rng.randint(5, 60)), max_tokens=200, ignore_eos=True),
                               rng.randint(1, 20))
        elif kind == "completion":
            r = await http.post("/v1/completions", json={"model": self.model, "prompt": self._text(30),
                                                         "max_tokens": rng.randint(8, 64)})
            assert r.status_code == 200, r.text[:200]
        elif kind == "long_prompt":
            r = await http.post("/v1/chat/completions", json=self._chat(self._text(900), max_tokens=16))
            assert r.status_code == 200, r.text[:200]
        elif kind == "n2_logprobs":
            r = await http.post("/v1/completions", json={"model": self.model, "prompt": self._text(20),
                                                         "max_tokens": 24, "n": 2, "logprobs": 3,
                                                         "temperature": 1.0})
            assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text[:200]
        elif kind == "json_schema":
            fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
            r = await http.post("/v1/chat/completions", json=self._chat(
                "Describe a person as JSON with name, age and tags.", max_tokens=120, response_format=fmt))
            assert r.status_code == 200, r.text[:200]
            content = r.json()["choices"][0]["message"]["content"]
            if r.json()["choices"][0]["finish_reason"] == "stop":
                assert isinstance(json.loads(content), dict), content
        elif kind == "bad_request":
            r = await http.post("/v1/chat/completions", json={"model": self.model, "messages": [],
                                                              "max_tokens": -1})
            assert r.status_code == 400 and "error" in r.json(), r.text[:200]

    async def client(self, http: httpx.AsyncClient, stop_at: float) -> None:
        while time.monotonic() < stop_at:
            kind = self.rng.choices(self.kinds, self.weights)[0]
            try:
                await self.one(http, kind)
                self.served[kind] = self.served.get(kind, 0) + 1
            except Exception as e:  # noqa: BLE001 - every failure is counted and reported
                self.errors.append(f"{kind}: {type(e).__name__}: {e}"[:300])

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=self.args.concurrency * 2)
        async with httpx.AsyncClient(base_url=self.url, timeout=300, limits=limits) as http:
            stop_at = time.monotonic() + self.args.duration
            await asyncio.gather(*(self.client(http, stop_at) for _ in range(self.args.concurrency)))


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("pageserve:") and "{" in line:
            name, value = line.split("{")[0], line.rsplit(" ", 1)[1]
            if name in ("pageserve:kv_cache_usage_perc", "pageserve:num_requests_running",
                        "pageserve:num_requests_waiting", "pageserve:num_requests_swapped",
                        "pageserve:num_preemptions_total", "pageserve:num_preemptions_recompute_total"):
                out[name] = float(value)
    return out


def main(args) -> dict:
    flags = ["--dtype", args.dtype, "--kv-cache-memory", str(args.kv_cache_memory), "--swap-space",
             str(args.swap_space), "--max-num-seqs", "16", "--max-model-len", "2048", "--disable-log-requests"]
    proc, url = start_server(flags + (["--model", args.model] if args.model else []))
    samples: list[tuple[float, float]] = []
    stop = threading.Event()
    t0 = time.monotonic()

    def sample_rss():
        while not stop.is_set():
            samples.append((time.monotonic() - t0, _rss_mib(proc.pid)))
            stop.wait(2.0)
    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        soak = Soak(args, url, model)
        asyncio.run(soak.run())
        elapsed = time.monotonic() - t0
        deadline = time.monotonic() + 60  # the load is over: let the dropped streams be noticed
        while True:
            m = _metrics(url)
            busy = m["pageserve:num_requests_running"] + m["pageserve:num_requests_waiting"] + \
                m["pageserve:num_requests_swapped"]
            if (busy == 0 and m["pageserve:kv_cache_usage_perc"] == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        stop.set()
        sampler.join()
        healthy = httpx.get(f"{url}/health").status_code == 200
    finally:
        stop.set()
        proc.terminate()
        code = proc.wait(timeout=120)
    rss_base = next((rss for t, rss in samples if t >= args.warmup), samples[0][1])  # first after warm-up
    rss_end = max(rss for _, rss in samples[-3:])
    result = {
        "duration_s": round(elapsed, 1), "concurrency": args.concurrency,
        "served": sum(soak.served.values()), "served_by_kind": soak.served,
        "errors": len(soak.errors), "first_errors": soak.errors[:10],
        "rss_after_warmup_mib": round(rss_base, 1), "rss_end_mib": round(rss_end, 1),
        "rss_max_mib": round(max(r for _, r in samples), 1),
        "rss_growth_pct": round((rss_end - rss_base) / rss_base * 100, 2),
        "kv_usage_at_end": m["pageserve:kv_cache_usage_perc"],
        "requests_left_at_end": busy, "preemptions": m.get("pageserve:num_preemptions_total"),
        "preemptions_recompute": m.get("pageserve:num_preemptions_recompute_total"),
        "healthy_at_end": healthy, "exit_code": code,
        "rss_mib_every_30s": [round(rss, 1) for t, rss in samples if int(t) % 30 < 2][::1],
    }
    print(json.dumps(result, indent=2))
    print(f"soak: {result['served']} requests served in {result['duration_s']} s, {result['errors']} errors "
          f"(target 0); RSS {rss_base:.0f} -> {rss_end:.0f} MiB after warm-up, "
          f"{result['rss_growth_pct']:+.2f}% (target < 5%); KV usage at the end "
          f"{result['kv_usage_at_end']:.0%} (target: 0%, every block free); {result['preemptions']:.0f} "
          f"preemptions, {result['preemptions_recompute']:.0f} of them recomputed; exit code {code}")
    return save_json(result, args.output_json)


def exit_code(result: dict) -> int:
    """1 when a target is missed: errors, RSS growth of 5% or more, blocks or requests left,
    an unhealthy server or a bad exit."""
    missed = (result["errors"] or result["rss_growth_pct"] >= 5 or result["kv_usage_at_end"]
              or result["requests_left_at_end"] or not result["healthy_at_end"] or result["exit_code"])
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(exit_code(main(add_args(argparse.ArgumentParser(description=__doc__)).parse_args())))
