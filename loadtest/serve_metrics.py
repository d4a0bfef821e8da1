"""What `pageserve bench serve` makes of its requests: vLLM's metrics and result keys, the
printed table, and the plot."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

METRICS = ("ttft", "tpot", "itl", "e2el", "client_queue_time", "e2el_including_client_queue")
SLO_METRICS = ("ttft", "tpot", "e2el")
DETAILED = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "queue_times",
            "generated_texts", "errors")  # per-request lists, kept only with --save-detailed


@dataclass
class Outcome:
    """One request, as vLLM's RequestFuncOutput has it (times in seconds)."""
    prompt_len: int  # the server's usage.prompt_tokens when it reports usage, else the dataset's count
    success: bool = False
    error: str = ""
    start: float = 0.0  # sent, since the benchmark began
    queue_time: float = 0.0  # waiting for a --max-concurrency slot
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    generated_text: str = ""

    @property
    def tpot(self) -> float:
        """0 for a single token, as vLLM counts it towards goodput."""
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def percentile(values: list[float], p: float) -> float:
    """numpy's default (linear) percentile; 0 for no values, as vLLM reports them."""
    xs = sorted(values) or [0.0]
    k = (len(xs) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def p_word(p: float) -> str:
    """99 -> "99", 99.9 -> "99.9": vLLM's pNN_ key names."""
    return str(int(p)) if p == int(p) else str(p)


def metric_values(outs: list[Outcome]) -> dict[str, list[float]]:
    """Seconds per metric over the successful requests (TPOT only where there are 2+ tokens)."""
    ok = [o for o in outs if o.success]
    return {"ttft": [o.ttft for o in ok], "tpot": [o.tpot for o in ok if o.output_tokens > 1],
            "itl": [x for o in ok for x in o.itl], "e2el": [o.latency for o in ok],
            "client_queue_time": [o.queue_time for o in ok],
            "e2el_including_client_queue": [o.latency + o.queue_time for o in ok]}


def is_good(o: Outcome, slos: dict[str, float]) -> bool:
    """Meets every SLO (milliseconds)."""
    got = {"ttft": o.ttft, "tpot": o.tpot, "e2el": o.latency}
    return all(got[name] * 1000 <= ms for name, ms in slos.items())


def summarize(outs: list[Outcome], duration: float, slos: dict[str, float],
              metrics: tuple[str, ...], percentiles: tuple[float, ...]) -> dict:
    """vLLM's result keys, in its order; `throughput_timeline` (streamed pieces per second) is
    pageserve's own."""
    ok = [o for o in outs if o.success]
    output_lens = [o.output_tokens if o.success else 0 for o in outs]
    total_in, total_out = sum(o.prompt_len for o in ok), sum(output_lens)
    timeline: dict[int, int] = {}
    events = []
    for o in ok:
        t = o.start + o.ttft
        for gap in [0.0, *o.itl]:
            t += gap
            timeline[int(t)] = timeline.get(int(t), 0) + 1
        events += [(o.start, 1), (o.start + o.latency, -1)]
    peak = running = 0
    for _, step in sorted(events):  # a request ending at an instant leaves before one starting
        running += step
        peak = max(peak, running)
    result = {
        "duration": duration, "completed": len(ok), "failed": len(outs) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": sum(is_good(o, slos) for o in ok) / duration if slos else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "input_lens": [o.prompt_len for o in outs], "output_lens": output_lens,
        "ttfts": [o.ttft for o in outs], "itls": [o.itl for o in outs],
        "latencies": [o.latency for o in outs], "start_times": [o.start for o in outs],
        "queue_times": [o.queue_time for o in outs],
        "generated_texts": [o.generated_text for o in outs], "errors": [o.error for o in outs],
        "max_output_tokens_per_s": float(max(timeline.values(), default=0)),
        "max_concurrent_requests": peak,
    }
    values = metric_values(outs)
    for name in metrics:
        ms = [v * 1000 for v in values[name]] or [0.0]
        result[f"mean_{name}_ms"] = statistics.fmean(ms)
        result[f"median_{name}_ms"] = statistics.median(ms)
        result[f"std_{name}_ms"] = statistics.pstdev(ms)
        for p in percentiles:
            result[f"p{p_word(p)}_{name}_ms"] = percentile(ms, p)
    result["throughput_timeline"] = [timeline.get(s, 0) for s in range(int(duration) + 1)]
    return result


def print_report(r: dict, metrics: tuple[str, ...], percentiles: tuple[float, ...]) -> None:
    rows = [("Successful requests:", r["completed"]), ("Failed requests:", r["failed"])]
    if r["max_concurrency"] is not None:
        rows.append(("Maximum request concurrency:", r["max_concurrency"]))
    if r["request_rate"] != "inf":
        rows.append(("Request rate configured (RPS):", f"{r['request_rate']:.2f}"))
    rows += [("Benchmark duration (s):", f"{r['duration']:.2f}"),
             ("Total input tokens:", r["total_input_tokens"]),
             ("Total generated tokens:", r["total_output_tokens"]),
             ("Request throughput (req/s):", f"{r['request_throughput']:.2f}")]
    if r["request_goodput"] is not None:
        rows.append(("Request goodput (req/s):", f"{r['request_goodput']:.2f}"))
    rows += [("Output token throughput (tok/s):", f"{r['output_throughput']:.2f}"),
             ("Peak output token throughput (tok/s):", f"{r['max_output_tokens_per_s']:.2f}"),
             ("Peak concurrent requests:", r["max_concurrent_requests"]),
             ("Total token throughput (tok/s):", f"{r['total_token_throughput']:.2f}")]
    print(" Serving Benchmark Result ".center(50, "="))
    for label, value in rows:
        print(f"{label:<40} {value:<10}")
    for name in metrics:
        print(f" {name.upper()} ".center(50, "-"))
        for stat in ("mean", "median"):
            print(f"{f'{stat.capitalize()} {name.upper()} (ms):':<40} {r[f'{stat}_{name}_ms']:<10.2f}")
        for p in percentiles:
            print(f"{f'P{p_word(p)} {name.upper()} (ms):':<40} {r[f'p{p_word(p)}_{name}_ms']:<10.2f}")
    print("=" * 50)


def plot(result: dict, values: dict[str, list[float]], path: str) -> None:
    """Latency CDFs beside output over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, tput) = plt.subplots(1, 2, figsize=(9, 3.2), dpi=80)
    for name in ("ttft", "tpot", "itl", "e2el"):
        if values[name]:
            xs = sorted(v * 1000 for v in values[name])
            cdf.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name.upper())
    cdf.set_xscale("log")
    cdf.set_xlabel("latency (ms)")
    cdf.set_ylabel("fraction of requests / gaps")
    cdf.set_title("latency CDFs")
    cdf.legend(fontsize=8)
    tput.plot(range(len(result["throughput_timeline"])), result["throughput_timeline"])
    tput.set_xlabel("seconds since start")
    tput.set_ylabel("streamed pieces / s (about tokens / s)")
    tput.set_title(f"output over time ({result['output_throughput']:.0f} tok/s mean)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
