"""`pageserve bench serve`: a serving benchmark against any OpenAI-compatible base URL, with
`vllm bench serve`'s flags and result keys.

Prompts come from vLLM's datasets (`random`, `sharegpt`, `prefix_repetition`, `custom`; see
serve_datasets.py), counted in the server's own tokens through its /tokenize: the bench loads
no tokenizer, so vLLM's --tokenizer is not taken. Requests arrive as a Poisson process (gamma
with --burstiness) at --request-rate (inf: all at once), at most --max-concurrency in flight,
and every one streams. The report gives completed and failed requests, request / output / total
token throughput, goodput against --goodput's SLOs, and mean, median, std and the
--metric-percentiles of each --percentile-metrics metric, under vLLM's JSON keys (see
serve_metrics.py); --save-result writes it, with a PNG of the latency CDFs beside it.

pageserve's earlier flag names still work: --dataset (synthetic, shared-prefix or a JSONL
file), --input-len / --output-len MIN:MAX, --prefix-len, --slo-ttft-ms / --slo-tpot-ms /
--slo-e2e-ms, --output-json, --no-progress."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import time
from datetime import datetime

import httpx

from pageserve.loadtest.common import save_json
from pageserve.loadtest.serve_datasets import SampleRequest, build_dataset, probe_tokens
from pageserve.loadtest.serve_metrics import DETAILED, Outcome, metric_values, plot, print_report, summarize
from pageserve.loadtest.serve_settings import Settings, add_args, resolve


async def send(client: httpx.AsyncClient, cfg: Settings, model: str, req: SampleRequest,
               began: float) -> Outcome:
    body = {"model": model, "max_tokens": req.output_len, "stream": True,
            "stream_options": {"include_usage": True}, **dict(cfg.sampling)}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.endpoint == "chat":
        content = req.prompt if not req.images else [
            {"type": "text", "text": req.prompt},
            *({"type": "image_url", "image_url": {"url": url}} for url in req.images)]
        url, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": content}]
    else:
        url, body["prompt"] = "/v1/completions", req.prompt
    out = Outcome(prompt_len=req.prompt_len)
    start = time.perf_counter()
    out.start = start - began
    last, pieces = None, 0
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out.success = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = str(chunk["error"].get("message"))
                    break
                if chunk.get("usage"):  # the server's own counts
                    out.output_tokens = chunk["usage"]["completion_tokens"]
                    out.prompt_len = chunk["usage"]["prompt_tokens"]
                for c in chunk.get("choices", []):
                    delta = c.get("delta") or {}
                    text = c.get("text") if "text" in c else delta.get("content")
                    if text or delta.get("reasoning_content") or delta.get("reasoning"):
                        now = time.perf_counter()
                        if last is None:
                            out.ttft = now - start
                        else:
                            out.itl.append(now - last)
                        last = now
                        pieces += 1
                        out.generated_text += text or ""
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"
    out.latency = time.perf_counter() - start
    out.output_tokens = out.output_tokens or pieces
    if out.success and last is None:
        out.success, out.error = False, "no text streamed"
    return out


def arrival_times(cfg: Settings, n: int) -> list[float]:
    """vLLM's schedule: gamma gaps (Poisson at burstiness 1), scaled so the last request is due
    at n / rate."""
    if cfg.request_rate == float("inf") or n == 0:
        return [0.0] * n
    rng = random.Random(cfg.seed)
    times, t = [], 0.0
    for _ in range(n):
        t += rng.gammavariate(cfg.burstiness, 1.0 / (cfg.request_rate * cfg.burstiness))
        times.append(t)
    return [x * (n / cfg.request_rate) / times[-1] for x in times]


async def run(cfg: Settings) -> tuple[str, str | None, list[SampleRequest], list[Outcome], float]:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.max_concurrency or max(cfg.num_prompts, 1))
    timeout = httpx.Timeout(6 * 3600, connect=30)
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, timeout=timeout, limits=limits) as client:
        model = cfg.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        tokens = await probe_tokens(client, model)
        dataset = await build_dataset(cfg, tokens)
        gate = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else contextlib.nullcontext()
        bar = None
        if cfg.progress:
            from tqdm import tqdm

            bar = tqdm(total=len(dataset), desc="requests", unit="req")

        async def limited(req: SampleRequest, due: float) -> Outcome:
            async with gate:
                out = await send(client, cfg, model, req, began)
            out.queue_time = max(0.0, out.start - due)
            if bar is not None:
                bar.update(1)
            return out

        engine_before = await engine_seconds(client)
        began = time.perf_counter()
        tasks = []
        for req, due in zip(dataset, arrival_times(cfg, len(dataset))):
            wait = due - (time.perf_counter() - began)
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(limited(req, time.perf_counter() - began)))
        outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - began
        if bar is not None:
            bar.close()
        engine_after = await engine_seconds(client)
    engine = None
    if engine_before and engine_after:
        engine = {k: engine_after[k] - engine_before[k] for k in engine_after}
    return model, tokens.name, dataset, outcomes, duration, engine


_ENGINE_SECONDS = {"pageserve:engine_step_seconds_total": "step_seconds",
                   "pageserve:mm_encoder_step_seconds_total": "encoder_seconds"}


async def engine_seconds(client: httpx.AsyncClient) -> dict[str, float] | None:
    """pageserve's time in model steps and in the vision encoder, from /metrics (None from
    servers that do not report them)."""
    try:
        r = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    found = {}
    for line in r.text.splitlines() if r.status_code == 200 else ():
        name = line.split("{", 1)[0]
        if name in _ENGINE_SECONDS:
            found[_ENGINE_SECONDS[name]] = float(line.rsplit(" ", 1)[1])
    return found if len(found) == len(_ENGINE_SECONDS) else None


def result_path(cfg: Settings, model: str, date: str) -> str:
    name = cfg.result_filename
    if not name:
        concurrency = f"-concurrency{cfg.max_concurrency}" if cfg.max_concurrency is not None else ""
        name = f"{cfg.label}-{cfg.request_rate}qps{concurrency}-{model.split('/')[-1]}-{date}.json"
    if cfg.result_dir:
        os.makedirs(cfg.result_dir, exist_ok=True)
        name = os.path.join(cfg.result_dir, name)
    return name


def measure_limits(model: str | None, itls: list[float], output_tok_s: float) -> dict | None:
    """This machine's limits for `model` (None: the default model), loaded here once the
    server is idle, printed against the run's ITL p50 and output rate; None, with the reason
    printed, where they could not be measured (the run's own results are kept either way)."""
    from pageserve.loadtest import machine_limits  # torch: only here, the client needs none
    from pageserve.runtime import LLM

    try:
        # the matmuls need no KV cache to speak of
        llm = LLM(model=model, kv_cache_memory=0.05, max_model_len=32)
        try:
            limits = machine_limits.limits(llm)
        finally:
            llm.engine.shutdown()
    except Exception as e:  # noqa: BLE001 - a failed measurement must not lose the run
        print(f"machine limits not measured: {e!r}")
        return None
    itl_p50_ms = statistics.median(itls) * 1e3 if itls else float("nan")
    for line in machine_limits.serve_summary(limits, itl_p50_ms, output_tok_s):
        print(line)
    return limits


def main(ns: argparse.Namespace) -> dict:
    cfg = resolve(ns)
    model, tokenizer_id, _, outs, duration, engine = asyncio.run(run(cfg))
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    result = {"date": date, "endpoint_type": cfg.backend, "backend": cfg.backend, "label": cfg.label,
              "model_id": model, "tokenizer_id": tokenizer_id, "num_prompts": cfg.num_prompts,
              "request_rate": cfg.request_rate if cfg.request_rate < float("inf") else "inf",
              "burstiness": cfg.burstiness, "max_concurrency": cfg.max_concurrency,
              "base_url": cfg.base_url, "endpoint": cfg.endpoint, "dataset_name": cfg.dataset_name,
              "goodput_slos_ms": dict(cfg.goodput) or None,
              **summarize(outs, duration, dict(cfg.goodput), cfg.percentile_metrics, cfg.metric_percentiles)}
    if engine is not None and engine["encoder_seconds"] > 0:
        result["engine_step_seconds"] = engine["step_seconds"]
        result["mm_encoder_seconds"] = engine["encoder_seconds"]
        result["mm_encoder_share_of_steps"] = engine["encoder_seconds"] / max(engine["step_seconds"], 1e-9)
    print_report(result, cfg.percentile_metrics, cfg.metric_percentiles)
    if "mm_encoder_share_of_steps" in result:
        print(f"vision encoder: {result['mm_encoder_seconds']:.2f} s of {result['engine_step_seconds']:.2f} s "
              f"in model steps ({100 * result['mm_encoder_share_of_steps']:.0f}%)")
    for o in [o for o in outs if not o.success][:10]:
        print(f"error: {o.error}")
    if cfg.machine_limits is not None:
        result["limits"] = measure_limits(cfg.machine_limits or None, metric_values(outs)["itl"],
                                          result["output_throughput"])
    path = result_path(cfg, model, date) if cfg.save_result else None
    png = cfg.output_png if cfg.output_png is not None else (
        os.path.splitext(path)[0] + ".png" if path else "")
    if png:
        plot(result, metric_values(outs), png)
    if not cfg.save_detailed:
        for key in DETAILED:
            result.pop(key)
    return save_json(result, path)


if __name__ == "__main__":
    main(add_args(argparse.ArgumentParser(description=__doc__)).parse_args())
