"""The server's host work per streamed token: what bounds a server's streamed throughput once
the device is fast. The server (a subprocess: the engine behind the real app, uvicorn with
uvloop and httptools, async scheduling on as on a GPU) streams N concurrent chat completions of
T tokens each (ignore_eos, greedy) to clients in --client-procs processes (httpx, one asyncio
loop each). Its tokens a second and CPU time per 1,000 tokens are set against the same engine
stepping the same prompts offline (streamed outputs, no server) in this process, in alternated
rounds. By default the model is the tiny one with its forward and logits stubbed out (the host
work alone); --model runs a real one (the GPU check's `serve` section).

    python -m pageserve.loadtest.bench_serve_host [--requests 256] [--max-tokens 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import multiprocessing
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from pageserve.loadtest.bench_host import stub_model
from pageserve.loadtest.common import conversations, free_port, wait_healthy
from pageserve.loadtest.tiny_model import build_tiny_model
from pageserve.runtime import SamplingParams
from pageserve.runtime.engine import LLMEngine
from pageserve.runtime.engine_args import EngineArgs
from pageserve.sampling.params import RequestOutputKind

def _engine_args(model_dir: Path, requests: int, dtype: str, kv_cache_memory: float,
                 stream_interval: int) -> EngineArgs:
    return EngineArgs(model=str(model_dir), dtype=dtype, max_num_seqs=requests, max_num_batched_tokens=8192,
                      kv_cache_memory=kv_cache_memory, async_scheduling=True, seed=0, stream_interval=stream_interval)


def _serve(args: EngineArgs, stub: bool, port: int, profile: str | None = None) -> None:
    """The server process: the engine (stubbed: stub_model) behind the app, as `pageserve serve` runs it."""
    import uvicorn

    from pageserve.app.server import build_app
    from pageserve.app.state import ServerSettings, ServerState
    from pageserve.runtime.async_engine import AsyncEngine

    torch.set_num_threads(1)
    engine = AsyncEngine.build(args, log_stats_interval=float("inf"))
    if stub:
        stub_model(engine.engine)
    settings = ServerSettings(("tiny",), args.model, log_requests=False, max_num_queued_reqs=4 * args.max_num_seqs)
    app = build_app(ServerState(engine, engine.tokenizer, settings, engine.max_model_len))
    gc.collect()
    gc.freeze()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools",
                                           log_level="warning", access_log=False))
    signal.signal(signal.SIGTERM, lambda *_: None)  # uvicorn raises it again after its graceful exit
    if profile is None:
        server.run()
        return
    profiler = cProfile.Profile()  # the event loop's thread (the engine's steps run on their own)
    profiler.runcall(server.run)
    profiler.dump_stats(profile)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _client_proc(url: str, first: int, count: int, max_tokens: int) -> tuple[int, int, float]:
    """One client process's streams: (completion tokens, events, its CPU seconds)."""
    cpu = time.process_time()
    tokens, events = asyncio.run(_stream_all(url, range(first, first + count), max_tokens))
    return tokens, events, time.process_time() - cpu


async def _stream_all(url: str, indices: range, max_tokens: int) -> tuple[int, int]:
    """Streamed chat completions, all at once; returns the completion tokens (usage) and the
    events that brought them."""
    limits = httpx.Limits(max_connections=len(indices) + 8, max_keepalive_connections=len(indices) + 8)
    convs = conversations(indices.stop)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def one(i: int) -> tuple[int, int]:
            body = {"model": "tiny", "messages": convs[i], "max_tokens": max_tokens, "ignore_eos": True,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            tokens = events = 0
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:  # (an httpx error would not survive the pool's pickling)
                    raise RuntimeError(f"{response.status_code}: {(await response.aread()).decode()[:500]}")
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        events += 1
                        if '"usage"' in line:
                            usage = json.loads(line[5:]).get("usage")
                            tokens = usage["completion_tokens"] if usage else tokens
            return tokens, events

        counts = await asyncio.gather(*(one(i) for i in indices))
        return sum(t for t, _ in counts), sum(e for _, e in counts)


def _offline(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, tokens) of the prompts stepped to the end, outputs streamed."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    for prompt in prompts:
        engine.add_request(prompt, params)
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(out.outputs[0].token_ids) for out in engine.step())
    return time.perf_counter() - wall, time.process_time() - cpu, tokens


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--client-procs", type=int, default=1, help="processes the streams are spread over")
    parser.add_argument("--model", default=None, help="a real model (default: the tiny one, stubbed out)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-memory", type=float, default=2, help="GiB, for each of the two engines")
    parser.add_argument("--stream-interval", type=int, default=1, help="the engines' --stream-interval")
    parser.add_argument("--output-json", default=None, metavar="PATH")
    parser.add_argument("--profile", default=None, metavar="PATH",
                        help="write a cProfile of the server's event loop thread there")
    args = parser.parse_args(argv)
    stub = args.model is None
    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, spawn.Pool(args.client_procs) as clients:
        model_dir = build_tiny_model(Path(tmp) / "tiny") if stub else Path(args.model)
        engine_args = _engine_args(model_dir, args.requests, args.dtype, args.kv_cache_memory, args.stream_interval)
        if stub:
            torch.set_num_threads(1)
        port = free_port()
        server = spawn.Process(target=_serve, args=(engine_args, stub, port, args.profile))
        server.start()
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, 600, lambda: server.exitcode)
            print(f"server up (pid {server.pid})", flush=True)
            engine = LLMEngine.from_engine_args(engine_args)
            if stub:
                stub_model(engine)
            tok = engine.tokenizer
            prompts = [tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
                       for conv in conversations(args.requests)]
            prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]
            share = -(-args.requests // args.client_procs)
            parts = [(url, first, min(share, args.requests - first), args.max_tokens)
                     for first in range(0, args.requests, share)]
            rows = []
            for _ in range(args.rounds):
                off_wall, off_cpu, off_tokens = _offline(engine, prompts, args.max_tokens)
                server_cpu, wall = _cpu_seconds(server.pid), time.perf_counter()
                done = clients.starmap(_client_proc, parts)
                wall = time.perf_counter() - wall
                server_cpu = _cpu_seconds(server.pid) - server_cpu
                tokens, events, client_cpu = (sum(column) for column in zip(*done))
                rows.append({"offline_tok_s": off_tokens / off_wall, "offline_cpu_ms_per_1k": off_cpu / off_tokens * 1e6,
                             "server_tok_s": tokens / wall, "server_cpu_ms_per_1k": server_cpu / tokens * 1e6,
                             "client_cpu_ms_per_1k": client_cpu / tokens * 1e6, "tokens": tokens,
                             "tokens_per_event": tokens / events})
                r = rows[-1]
                print(f"offline {r['offline_tok_s']:8.0f} tok/s, {r['offline_cpu_ms_per_1k']:6.1f} CPU ms / 1k tokens | "
                      f"server {r['server_tok_s']:8.0f} tok/s, {r['server_cpu_ms_per_1k']:6.1f} CPU ms / 1k tokens "
                      f"(clients {r['client_cpu_ms_per_1k']:.1f}), {r['tokens_per_event']:.2f} tokens an event", flush=True)
        finally:
            server.terminate()
            server.join(60)
            if server.is_alive():
                server.kill()
    ratios = {"server_over_offline_cpu": statistics.median(r["server_cpu_ms_per_1k"] / r["offline_cpu_ms_per_1k"]
                                                           for r in rows),
              "server_over_offline_tok_s": statistics.median(r["server_tok_s"] / r["offline_tok_s"] for r in rows)}
    print(f"{args.requests} streams of {args.max_tokens} tokens: the server's CPU per token is "
          f"{ratios['server_over_offline_cpu']:.1f}x the offline engine's, its tokens a second "
          f"{ratios['server_over_offline_tok_s']:.2f}x (medians of {len(rows)} rounds)")
    result = {"requests": args.requests, "max_tokens": args.max_tokens, "model": "stubbed tiny" if stub else args.model,
              "dtype": args.dtype, "stream_interval": args.stream_interval, "rounds": rows, **ratios}
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
