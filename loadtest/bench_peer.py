"""`pageserve bench peer`: the same streaming load against several OpenAI-compatible servers
side by side (pageserve in several settings, llama.cpp's server, vLLM's CPU build), in
alternating rounds, so that every server sees the machine in the same states. Writes one JSON
and one plot per run.

Every server gets the same prompts, as words (the bench loads no tokenizer and does not ask
the servers for theirs): `--prompt-words` common English words, and `--output-len MIN:MAX`
tokens out with `ignore_eos`. Each round runs every concurrency in `--streams` against every
server, the servers' order rotated from round to round. The report gives, per concurrency and
server, output tok/s, TTFT and ITL (p50 and p99) of every round, and each server's best and
worst round against the first server's.

Servers are named `--server NAME=URL` (one already running), or `--pageserve NAME=FLAGS`: a
`pageserve serve` with those flags that the bench starts on a free loopback port and stops at
the end. No peer is installed here; to start llama.cpp's server on the default model's file
(built from the llama-cpp-python sdist's vendored source: `cmake -B build -DGGML_NATIVE=ON
-DLLAMA_CURL=OFF && cmake --build build --target llama-server`):

    llama-server -m $(python -c "from pageserve.runtime.models.loader import default_model_path as p; print(p())") \\
        --host 127.0.0.1 --port 8081 -t 2 -c 16384 -np 64 -cb

and then:

    pageserve bench peer --server llama.cpp=http://127.0.0.1:8081 --pageserve auto= \\
        --pageserve float32="--dtype float32" --streams 1,8,32,64 --rounds 2 --output-json peer.json"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import time

import httpx

from pageserve.loadtest.bench_serve import send
from pageserve.loadtest.common import save_json, start_server
from pageserve.loadtest.serve_datasets import WORDS, SampleRequest
from pageserve.loadtest.serve_metrics import metric_values, percentile
from pageserve.loadtest.serve_settings import Settings, add_args as add_serve_args, resolve


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add = parser.add_argument
    add("--server", action="append", default=[], metavar="NAME=URL", help="a running server (repeatable)")
    add("--pageserve", action="append", default=[], metavar="NAME=FLAGS",
        help="a `pageserve serve FLAGS` the bench starts and stops (repeatable; FLAGS may be empty)")
    add("--streams", default="1,8,32,64", help="comma-separated concurrencies")
    add("--rounds", type=int, default=2)
    add("--prompt-words", type=int, default=60)
    add("--output-len", default="32:128", metavar="MIN:MAX")
    add("--requests-per-stream", type=int, default=2,
        help="requests at each concurrency: this many per stream, at least --min-requests")
    add("--min-requests", type=int, default=8)
    add("--endpoint", choices=("completions", "chat"), default="completions")
    add("--seed", type=int, default=0)
    add("--output-json", default=None, metavar="PATH", help="the result; its plot goes beside it as .png")
    return parser


def _pairs(items: list[str], flag: str) -> list[tuple[str, str]]:
    out = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"{flag} takes NAME=VALUE, got {item!r}")
        out.append((name, value))
    return out


def _settings(url: str, endpoint: str, streams: int) -> Settings:
    """bench serve's settings for one cell: its sending code, not its datasets."""
    argv = ["--base-url", url, "--endpoint", endpoint, "--max-concurrency", str(streams), "--disable-tqdm",
            "--ignore-eos"]
    return resolve(add_serve_args(argparse.ArgumentParser()).parse_args(argv))


def prompts(n: int, words: int, output_len: tuple[int, int], seed: int) -> list[SampleRequest]:
    rng = random.Random(seed)
    return [SampleRequest(" ".join(rng.choice(WORDS) for _ in range(words)), words, rng.randint(*output_len))
            for _ in range(n)]


async def run_cell(url: str, endpoint: str, streams: int, requests: list[SampleRequest]) -> dict:
    """One server at one concurrency: output tok/s over the wall time, TTFT and ITL percentiles."""
    cfg = _settings(url, endpoint, streams)
    limits = httpx.Limits(max_connections=streams)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(3600, connect=30), limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        gate = asyncio.Semaphore(streams)

        async def one(req: SampleRequest):
            async with gate:
                return await send(client, cfg, model, req, began)

        began = time.perf_counter()
        outs = await asyncio.gather(*(one(r) for r in requests))
        duration = time.perf_counter() - began
    values = metric_values(outs)
    failed = [o.error for o in outs if not o.success]
    cell = {"output_tok_s": sum(o.output_tokens for o in outs if o.success) / duration, "duration_s": duration,
            "completed": len(outs) - len(failed), "failed": len(failed), "errors": failed[:3]}
    for name in ("ttft", "itl"):
        ms = [v * 1000 for v in values[name]]
        for p in (50, 99):
            cell[f"{name}_p{p}_ms"] = percentile(ms, p) if ms else None
    return cell


def summarize(rounds: list[dict], names: list[str], streams: list[int]) -> dict:
    """Per concurrency and server: the rounds' values; each server's tok/s against the first's."""
    table = {}
    for c in streams:
        row = {}
        for name in names:
            cells = [r for r in rounds if r["streams"] == c and r["server"] == name]
            row[name] = {key: [cell[key] for cell in cells] for key in
                         ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")}
        first = row[names[0]]["output_tok_s"]
        for name in names[1:]:
            other = row[name]["output_tok_s"]
            row[names[0]][f"vs {name}"] = [min(first) / max(other), max(first) / min(other)] if all(other) else None
        table[str(c)] = row
    return table


def print_table(table: dict, names: list[str]) -> None:
    def span(values, fmt="{:.0f}"):
        values = [v for v in values if v is not None]
        if not values:
            return "-"
        lo, hi = min(values), max(values)
        return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"

    print(f"{'streams':>7}  {'server':<20} {'tok/s':>11} {'TTFT p50 ms':>12} {'ITL p50 ms':>11} {'ITL p99 ms':>11}")
    for c, row in table.items():
        for name in names:
            v = row[name]
            print(f"{c:>7}  {name:<20} {span(v['output_tok_s']):>11} {span(v['ttft_p50_ms']):>12} "
                  f"{span(v['itl_p50_ms'], '{:.1f}'):>11} {span(v['itl_p99_ms'], '{:.1f}'):>11}")
        for name in names[1:]:
            ratio = row[names[0]].get(f"vs {name}")
            if ratio:
                print(f"{'':>7}  {names[0]} / {name}: {ratio[0]:.2f}-{ratio[1]:.2f}x tok/s (worst-best rounds)")


def plot(table: dict, names: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    streams = [int(c) for c in table]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in names:
        for ax, key in ((ax1, "output_tok_s"), (ax2, "itl_p50_ms")):
            vals = [[v for v in table[str(c)][name][key] if v is not None] or [float("nan")] for c in streams]
            mid = [statistics.median(v) for v in vals]
            line, = ax.plot(streams, mid, marker="o", label=name)
            ax.fill_between(streams, [min(v) for v in vals], [max(v) for v in vals], alpha=0.2,
                            color=line.get_color())
    for ax, label in ((ax1, "output tok/s"), (ax2, "ITL p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(streams, [str(c) for c in streams])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax1.legend()
    fig.suptitle("the same load, servers alternated (median of rounds; band: min-max)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(ns: argparse.Namespace) -> dict:
    servers = _pairs(ns.server, "--server")
    started = []
    try:
        for name, flags in _pairs(ns.pageserve, "--pageserve"):
            print(f"starting pageserve serve {flags} ({name})", flush=True)
            proc, url = start_server(shlex.split(flags))
            started.append(proc)
            servers.append((name, url))
        if not servers:
            raise ValueError("give at least one --server NAME=URL or --pageserve NAME=FLAGS")
        names = [name for name, _ in servers]
        if len(set(names)) != len(names):
            raise ValueError(f"server names must differ: {names}")
        lo, _, hi = ns.output_len.partition(":")
        output_len = (int(lo), int(hi or lo))
        streams = [int(c) for c in ns.streams.split(",")]
        for name, url in servers:  # a first request pays for what a server sets up lazily: not measured
            asyncio.run(run_cell(url, ns.endpoint, 2, prompts(2, ns.prompt_words, (16, 16), ns.seed - 1)))
        rounds = []
        for r in range(ns.rounds):
            for c in streams:
                n = max(ns.min_requests, ns.requests_per_stream * c)
                requests = prompts(n, ns.prompt_words, output_len, ns.seed + 1000 * r + c)
                shift = (r + streams.index(c)) % len(servers)  # rotated: no server always goes first
                for name, url in servers[shift:] + servers[:shift]:
                    cell = asyncio.run(run_cell(url, ns.endpoint, c, requests))
                    rounds.append({"round": r, "streams": c, "server": name, **cell})
                    print(f"round {r} streams {c:>3} {name:<20} {cell['output_tok_s']:7.1f} tok/s  "
                          f"ITL p50 {cell['itl_p50_ms'] or 0:.1f} p99 {cell['itl_p99_ms'] or 0:.1f} ms  "
                          f"TTFT p50 {cell['ttft_p50_ms'] or 0:.0f} ms"
                          + (f"  {cell['failed']} failed: {cell['errors'][0]}" if cell["failed"] else ""),
                          flush=True)
        table = summarize(rounds, names, streams)
    finally:
        for proc in started:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except Exception:  # noqa: BLE001 - stop it whatever it was doing
                proc.kill()
    print_table(table, names)
    result = {"load": {"endpoint": ns.endpoint, "prompt_words": ns.prompt_words, "output_len": list(output_len),
                       "ignore_eos": True, "streams": streams, "rounds": ns.rounds,
                       "requests_per_stream": ns.requests_per_stream, "min_requests": ns.min_requests},
              "servers": {name: url for name, url in servers},
              "pageserve_flags": dict(_pairs(ns.pageserve, "--pageserve")),
              "cells": rounds, "table": table}
    if ns.output_json:
        plot(table, names, os.path.splitext(ns.output_json)[0] + ".png")
    return save_json(result, ns.output_json)


if __name__ == "__main__":
    print(json.dumps(main(add_args(argparse.ArgumentParser(description=__doc__)).parse_args())["table"], indent=1))
