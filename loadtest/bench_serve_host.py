"""The server's host work per streamed token, with the model stubbed out as in bench_host: what
bounds a server's streamed throughput once the device is fast. The server (a subprocess: the
stubbed engine behind the real app, uvicorn with uvloop and httptools, async scheduling on as on
a GPU) streams N concurrent chat completions of T tokens each (ignore_eos, greedy) to clients
in this process (httpx, one asyncio loop). Its CPU time per 1,000 tokens is set against the
same engine stepping the same prompts offline (streamed outputs, no server), in alternated rounds.

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
import socket
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from pageserve.loadtest.bench_host import stub_model
from pageserve.loadtest.tiny_model import build_tiny_model
from pageserve.runtime import SamplingParams
from pageserve.runtime.engine import LLMEngine
from pageserve.runtime.engine_args import EngineArgs
from pageserve.sampling.params import RequestOutputKind

TOPICS = ["the sun", "a cat", "rain", "music", "a river", "bread", "a computer", "winter"]


def _engine_args(model_dir: Path, requests: int) -> EngineArgs:
    return EngineArgs(model=str(model_dir), dtype="float32", max_num_seqs=requests, max_num_batched_tokens=8192,
                      max_model_len=1024, kv_cache_memory=2, async_scheduling=True, seed=0)


def _messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Write a few words about {TOPICS[i % len(TOPICS)]}, number {i}."}]


def _serve(model_dir: Path, port: int, requests: int, profile: str | None = None) -> None:
    """The server process: the stubbed engine behind the app, as `pageserve serve` runs it."""
    import uvicorn

    from pageserve.app.server import build_app
    from pageserve.app.state import ServerSettings, ServerState
    from pageserve.runtime.async_engine import AsyncEngine

    torch.set_num_threads(1)
    engine = AsyncEngine.build(_engine_args(model_dir, requests), log_stats_interval=float("inf"))
    stub_model(engine.engine)
    settings = ServerSettings(("tiny",), str(model_dir), log_requests=False, max_num_queued_reqs=4 * requests)
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


async def _stream_all(url: str, requests: int, max_tokens: int) -> tuple[int, int]:
    """Every client's streamed chat completion; returns the completion tokens (usage) and the
    events that brought them."""
    limits = httpx.Limits(max_connections=requests + 8, max_keepalive_connections=requests + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def one(i: int) -> tuple[int, int]:
            body = {"model": "tiny", "messages": _messages(i), "max_tokens": max_tokens, "ignore_eos": True,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            tokens = events = 0
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        events += 1
                        if '"usage"' in line:
                            usage = json.loads(line[5:]).get("usage")
                            tokens = usage["completion_tokens"] if usage else tokens
            return tokens, events

        counts = await asyncio.gather(*(one(i) for i in range(requests)))
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
    parser.add_argument("--output-json", default=None, metavar="PATH")
    parser.add_argument("--profile", default=None, metavar="PATH",
                        help="write a cProfile of the server's event loop thread there")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = multiprocessing.get_context("spawn").Process(
            target=_serve, args=(model_dir, port, args.requests, args.profile))
        server.start()
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 300
            while True:
                try:
                    if httpx.get(f"{url}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or not server.is_alive():
                    raise RuntimeError("the server did not start")
                time.sleep(0.2)
            engine = LLMEngine.from_engine_args(_engine_args(model_dir, args.requests))
            stub_model(engine)
            tok = engine.tokenizer
            prompts = [tok.apply_chat_template(_messages(i), add_generation_prompt=True, tokenize=True)
                       for i in range(args.requests)]
            prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]
            rows = []
            for _ in range(args.rounds):
                off_wall, off_cpu, off_tokens = _offline(engine, prompts, args.max_tokens)
                server_cpu, client_cpu, wall = _cpu_seconds(server.pid), time.process_time(), time.perf_counter()
                tokens, events = asyncio.run(_stream_all(url, args.requests, args.max_tokens))
                wall = time.perf_counter() - wall
                server_cpu, client_cpu = _cpu_seconds(server.pid) - server_cpu, time.process_time() - client_cpu
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
            server.join(30)
    ratio = statistics.median(r["server_cpu_ms_per_1k"] / r["offline_cpu_ms_per_1k"] for r in rows)
    print(f"{args.requests} streams of {args.max_tokens} tokens: the server's CPU per token is {ratio:.1f}x "
          f"the offline engine's (median of {len(rows)} rounds)")
    result = {"requests": args.requests, "max_tokens": args.max_tokens, "rounds": rows,
              "server_over_offline_cpu": ratio}
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
