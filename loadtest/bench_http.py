"""What the HTTP layer costs: N concurrent streaming chat clients against `pageserve serve`,
against the offline engine (`LLM.chat`) on the same conversations, in the same run.

Every request generates exactly --max-tokens tokens (ignore_eos), so both sides produce the
same number of tokens. The offline engine lives in this process; the server is a subprocess
with the same engine flags, and the clients (httpx, one asyncio loop, minimal parsing) stream
from it. The two never run at once (2 cores): rounds alternate, offline then server, because
this machine's speed drifts by up to 30% from minute to minute; the ratio reported is the
median of the per-round ratios. Then time to first token on the idle server: a streamed
completion of a ~20-token prompt, first text chunk, median of several."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

from pageserve.loadtest.common import conversations, save_json, start_server

def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-clients", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each side")
    parser.add_argument("--ttft-samples", type=int, default=20)
    parser.add_argument("--kv-cache-memory", type=float, default=2.0)
    parser.add_argument("--output-json", default=None, metavar="PATH")
    return parser


def engine_flags(args) -> list[str]:
    flags = ["--dtype", args.dtype, "--kv-cache-memory", str(args.kv_cache_memory),
             "--max-num-seqs", str(max(args.num_clients, 1)), "--max-model-len", "2048"]
    return flags + (["--model", args.model] if args.model else [])


class Offline:
    def __init__(self, args):
        from pageserve.runtime import LLM, SamplingParams

        self.llm = LLM(model=args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                       max_num_seqs=args.num_clients, max_model_len=2048)
        self.params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        self.convs = conversations(args.num_clients)

    def run(self) -> float:
        t0 = time.perf_counter()
        outs = self.llm.chat(self.convs, self.params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


async def _stream_chat(client: httpx.AsyncClient, url: str, model: str, messages, max_tokens: int) -> int:
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    usage = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith('data: {') and '"usage":{' in line:
                usage = json.loads(line[6:])["usage"]["completion_tokens"]
    return usage


async def run_clients(args, url: str, model: str) -> float:
    convs = conversations(args.num_clients)
    limits = httpx.Limits(max_connections=args.num_clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(_stream_chat(client, url, model, c, args.max_tokens)
                                        for c in convs))
        elapsed = time.perf_counter() - t0
    assert all(c == args.max_tokens for c in counts), counts
    return sum(counts) / elapsed


async def measure_ttft(args, url: str, model: str) -> list[float]:
    prompt = "Write a short poem about the sea, the wind, and a small boat sailing home at dusk."
    samples = []
    async with httpx.AsyncClient(timeout=60) as client:
        n = len((await client.post(f"{url}/tokenize", json={"prompt": prompt})).json()["tokens"])
        for i in range(args.ttft_samples + 1):
            body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True,
                    "ignore_eos": True}
            t0 = time.perf_counter()
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"text":""' not in line:
                        if i:  # the first is a warm-up
                            samples.append(time.perf_counter() - t0)
                        break
            await asyncio.sleep(0.05)
    print(f"TTFT prompt: {n} tokens")
    return samples


def main(args) -> dict:
    offline = Offline(args)
    proc, url = start_server(engine_flags(args))
    rounds = []
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        offline.run()  # warm both
        asyncio.run(run_clients(args, url, model))
        for i in range(args.rounds):
            off = offline.run()
            srv = asyncio.run(run_clients(args, url, model))
            rounds.append((off, srv))
            print(f"round {i}: offline {off:.1f} tok/s, server {srv:.1f} tok/s, ratio {srv / off:.2f}")
        ttft = asyncio.run(measure_ttft(args, url, model))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    ratio = statistics.median(s / o for o, s in rounds)
    result = {
        "num_clients": args.num_clients, "max_tokens": args.max_tokens,
        "offline_tok_s": [round(o, 1) for o, _ in rounds],
        "server_tok_s": [round(s, 1) for _, s in rounds],
        "ratio_median": round(ratio, 3),
        "ttft_median_ms": round(statistics.median(ttft) * 1000, 1),
        "ttft_p90_ms": round(sorted(ttft)[int(0.9 * (len(ttft) - 1))] * 1000, 1),
    }
    print(f"server with {args.num_clients} streaming clients: median {ratio:.2f}x the offline engine's "
          f"output tok/s (target >= 0.90)")
    print(f"idle-server TTFT: median {result['ttft_median_ms']} ms, p90 {result['ttft_p90_ms']} ms "
          f"(target median < 150 ms)")
    return save_json(result, args.output_json)


if __name__ == "__main__":
    main(add_args(argparse.ArgumentParser(description=__doc__)).parse_args())
