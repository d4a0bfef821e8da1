"""`pageserve bench serve`: a serving benchmark against any OpenAI-compatible base URL, in the
manner of `vllm bench serve`.

Prompts come from a synthetic dataset (fixed seed, lengths drawn from ranges; a variant where
every prompt starts with one shared prefix) or a JSONL file ({"prompt": ..., "output_len": ...}
per line). Requests arrive as a Poisson process at --request-rate (inf: all at once), at most
--max-concurrency in flight. Every request streams; the report gives completed and failed,
requests/s, output tokens/s, TTFT, TPOT, ITL and end-to-end latency (mean, median, p99), and
goodput against the given SLOs, and is written as JSON and as a PNG (latency CDFs, output
throughput over time)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

from pageserve.loadtest.common import save_json

WORDS = ("time year people way day man thing woman life child world school state family student "
         "group country problem hand part place case week company system program question work "
         "government number night point home water room mother area money story fact month lot "
         "right study book eye job word business issue side kind head house service friend father "
         "power hour game line end member law car city community name president team minute idea").split()


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--dataset", default="synthetic",
                        help="synthetic, shared-prefix, or a JSONL file of {prompt, output_len}")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", default="32:256", help="words per prompt, MIN:MAX")
    parser.add_argument("--output-len", default="32:128", help="tokens per answer, MIN:MAX")
    parser.add_argument("--prefix-len", type=int, default=256, help="shared-prefix words")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson)")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT at most this")
    parser.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT at most this")
    parser.add_argument("--slo-e2e-ms", type=float, default=None, help="goodput: latency at most this")
    parser.add_argument("--output-json", default="bench_serve.json", metavar="PATH")
    parser.add_argument("--output-png", default="bench_serve.png", metavar="PATH")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    lo, hi = int(lo), int(hi or lo)
    if not 0 < lo <= hi:
        raise ValueError(f"a length range is MIN:MAX with 0 < MIN <= MAX, got {text!r}")
    return lo, hi


def build_dataset(args) -> list[tuple[str, int]]:
    """(prompt, output tokens) per request, the same for a given seed."""
    rng = random.Random(args.seed)
    if args.dataset not in ("synthetic", "shared-prefix"):
        items = []
        with open(args.dataset) as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    items.append((row["prompt"], int(row.get("output_len", 128))))
        return items[:args.num_prompts]
    in_lo, in_hi = _range(args.input_len)
    out_lo, out_hi = _range(args.output_len)
    prefix = " ".join(rng.choice(WORDS) for _ in range(args.prefix_len)) + " " \
        if args.dataset == "shared-prefix" else ""
    return [(prefix + " ".join(rng.choice(WORDS) for _ in range(rng.randint(in_lo, in_hi))),
             rng.randint(out_lo, out_hi)) for _ in range(args.num_prompts)]


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # arrival of each streamed piece

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def one_request(client: httpx.AsyncClient, args, model: str, prompt: str, output_len: int) -> Result:
    body = {"model": model, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if args.endpoint == "chat":
        url, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        url, body["prompt"] = "/v1/completions", prompt
    res = Result(start=time.perf_counter())
    last = None
    pieces = 0
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    res.ok = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message"))
                    break
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                for c in chunk.get("choices", []):
                    text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                    if text:
                        now = time.perf_counter()
                        if last is None:
                            res.ttft = now - res.start
                        else:
                            res.itls.append(now - last)
                        res.token_times.append(now)
                        last = now
                        pieces += 1
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    res.e2e = time.perf_counter() - res.start
    res.output_tokens = res.output_tokens or pieces
    if res.ok and last is None:
        res.ok, res.error = False, "no text streamed"
    return res


async def run(args, dataset) -> tuple[list[Result], float]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or len(dataset) or 1)
    timeout = httpx.Timeout(600, connect=30)  # a stuck request fails instead of hanging the run
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=timeout, limits=limits) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        gate = asyncio.Semaphore(args.max_concurrency or len(dataset) or 1)
        rng = random.Random(args.seed + 1)
        bar = None
        if not args.no_progress:
            from tqdm import tqdm

            bar = tqdm(total=len(dataset), desc="requests", unit="req")

        async def limited(prompt, n):
            async with gate:
                res = await one_request(client, args, model, prompt, n)
            if bar is not None:
                bar.update(1)
            return res

        start = time.perf_counter()
        tasks = []
        for i, (prompt, n) in enumerate(dataset):
            tasks.append(asyncio.create_task(limited(prompt, n)))
            if args.request_rate != float("inf") and i + 1 < len(dataset):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = [r if isinstance(r, Result) else Result(error=f"{type(r).__name__}: {r}", start=start)
                   for r in await asyncio.gather(*tasks, return_exceptions=True)]
        duration = time.perf_counter() - start
        if bar is not None:
            bar.close()
    return results, duration


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean_ms": None, "median_ms": None, "p99_ms": None}
    p99 = statistics.quantiles(values, n=100, method="inclusive")[98] if len(values) > 1 else values[0]
    return {"mean_ms": round(statistics.mean(values) * 1000, 2),
            "median_ms": round(statistics.median(values) * 1000, 2),
            "p99_ms": round(p99 * 1000, 2)}


def summarize(args, results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)

    def good(r: Result) -> bool:
        return ((args.slo_ttft_ms is None or r.ttft * 1000 <= args.slo_ttft_ms)
                and (args.slo_tpot_ms is None or (r.tpot or 0) * 1000 <= args.slo_tpot_ms)
                and (args.slo_e2e_ms is None or r.e2e * 1000 <= args.slo_e2e_ms))
    start = min((r.start for r in results), default=0.0)
    timeline: dict[int, int] = {}
    for r in ok:
        for t in r.token_times:
            timeline[int(t - start)] = timeline.get(int(t - start), 0) + 1
    return {
        "base_url": args.base_url, "endpoint": args.endpoint, "dataset": args.dataset,
        "num_prompts": len(results), "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
        "duration_s": round(duration, 3),
        "request_throughput": round(len(ok) / duration, 3),
        "output_throughput": round(out_tokens / duration, 2),
        "total_output_tokens": out_tokens,
        "ttft": _stats([r.ttft for r in ok]), "tpot": _stats([r.tpot for r in ok if r.tpot is not None]),
        "itl": _stats([x for r in ok for x in r.itls]), "e2el": _stats([r.e2e for r in ok]),
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms, "e2e_ms": args.slo_e2e_ms},
        "goodput": round(sum(1 for r in ok if good(r)) / duration, 3),
        "throughput_timeline": [timeline.get(s, 0) for s in range(int(duration) + 1)],
        "_raw": {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
                 "itl": [x for r in ok for x in r.itls], "e2el": [r.e2e for r in ok]},
    }


def plot(summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, tput) = plt.subplots(1, 2, figsize=(9, 3.2), dpi=80)
    for name, values in summary["_raw"].items():
        if values:
            xs = sorted(v * 1000 for v in values)
            cdf.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name.upper())
    cdf.set_xscale("log")
    cdf.set_xlabel("latency (ms)")
    cdf.set_ylabel("fraction of requests / gaps")
    cdf.set_title("latency CDFs")
    cdf.legend(fontsize=8)
    tput.plot(range(len(summary["throughput_timeline"])), summary["throughput_timeline"])
    tput.set_xlabel("seconds since start")
    tput.set_ylabel("streamed pieces / s (about tokens / s)")
    tput.set_title(f"output over time ({summary['output_throughput']:.0f} tok/s mean)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(args) -> dict:
    dataset = build_dataset(args)
    results, duration = asyncio.run(run(args, dataset))
    summary = summarize(args, results, duration)
    if args.output_png:
        plot(summary, args.output_png)
    summary.pop("_raw")
    print(f"completed {summary['completed']}, failed {summary['failed']} in {summary['duration_s']} s: "
          f"{summary['request_throughput']} req/s, {summary['output_throughput']} output tok/s, "
          f"goodput {summary['goodput']} req/s")
    for name in ("ttft", "tpot", "itl", "e2el"):
        s = summary[name]
        print(f"  {name.upper():5s} mean {s['mean_ms']} ms, median {s['median_ms']} ms, p99 {s['p99_ms']} ms")
    return save_json(summary, args.output_json)


if __name__ == "__main__":
    main(add_args(argparse.ArgumentParser(description=__doc__)).parse_args())
