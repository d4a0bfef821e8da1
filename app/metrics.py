"""GET /metrics in Prometheus text, named like vLLM's metrics with our prefix, and the
one-line-per-request log.

Gauges and counters are read from the engine when scraped (a custom collector: nothing on
the hot path); the latency histograms are observed once per finished request."""

from __future__ import annotations

import logging
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

from pageserve.runtime.async_engine import AsyncEngine
from pageserve.runtime.outputs import RequestOutput

logger = logging.getLogger("pageserve.requests")

_P = "pageserve:"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
_TOKEN_GAP_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


class _EngineCollector(Collector):
    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def _family(self, kind, name: str, doc: str, value: float):
        family = kind(_P + name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def collect(self):
        s = self.engine.stats()
        sched = s.scheduler
        g, c = GaugeMetricFamily, CounterMetricFamily
        yield self._family(g, "num_requests_running", "Requests in the running batch.", sched.num_running)
        yield self._family(g, "num_requests_waiting", "Requests waiting to be admitted (n > 1: n until it starts).",
                           sched.num_waiting)
        yield self._family(g, "num_requests_swapped", "Requests swapped out to CPU memory.", sched.num_swapped)
        yield self._family(g, "kv_cache_usage_perc", "Fraction of KV blocks in use (0 to 1).", sched.kv_cache_usage)
        yield self._family(c, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                           sched.prefix_cache_queries)
        yield self._family(c, "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                           sched.prefix_cache_hits)
        yield self._family(c, "num_preemptions", "Preemptions (swap or recompute).", sched.num_preemptions)
        yield self._family(c, "num_preemptions_recompute", "Preemptions that freed the blocks, to be "
                           "recomputed (the others were swapped out).", sched.num_recomputed)
        yield self._family(c, "prompt_tokens", "Prompt tokens computed.", s.prompt_tokens)
        yield self._family(c, "generation_tokens", "Tokens generated.", s.generation_tokens)
        yield self._family(c, "engine_step_seconds", "Time in the model runner's steps.", s.step_seconds)
        yield self._family(c, "mm_encoder_step_seconds", "Of which in the vision encoder.", s.encoder_seconds)
        if s.spec is not None:  # as vLLM's spec_decode counters
            yield self._family(c, "spec_decode_num_drafts", "Speculative runs scored.", s.spec.num_drafts)
            yield self._family(c, "spec_decode_num_draft_tokens", "Draft tokens scored.", s.spec.num_draft_tokens)
            yield self._family(c, "spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                               s.spec.num_accepted_tokens)
            per = CounterMetricFamily(_P + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the run.", labels=["model_name", "position"])
            for i, n in enumerate(s.spec.accepted_per_position):
                per.add_metric([self.model_name, str(i)], n)
            yield per
        if sched.max_loras:  # as vLLM: the labels say which adapters run and wait; the value is the time
            info = GaugeMetricFamily(_P + "lora_requests_info", "Running and waiting LoRA adapters.",
                                     labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
            info.add_metric([",".join(sched.running_loras), ",".join(sched.waiting_loras), str(sched.max_loras)],
                            time.time())
            yield info
        success = CounterMetricFamily(_P + "request_success", "Finished sequences by finish reason.",
                                      labels=["model_name", "finished_reason"])
        for reason in ("stop", "length", "abort"):
            success.add_metric([self.model_name, reason], s.finished.get(reason, 0))
        yield success


def log_id(request_id: str) -> str:
    """A request id as the log shows it: a stored response's id is what it takes to read or
    delete it, so only its first 8 hex digits (enough to follow one in the log)."""
    return request_id[:13] + "..." if request_id.startswith("resp_") else request_id


class Metrics:
    def __init__(self, engine: AsyncEngine, model_name: str, log_requests: bool = True,
                 log_prompts: bool = False, detokenize=None):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        labels = ["model_name"]
        self.model_name = model_name

        def histogram(name, doc, buckets):
            return Histogram(_P + name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)
        self.ttft = histogram("time_to_first_token_seconds", "Time to the first token.", _LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Mean gap between output tokens.",
                              _TOKEN_GAP_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS)
        self.encoder = histogram("mm_encoder_seconds", "Vision encoder time of a request with images.",
                                 _LATENCY_BUCKETS)
        self.log_requests = log_requests
        self.log_prompts = log_prompts
        self.detokenize = detokenize
        engine.on_finished.append(self.observe)
        if log_requests:
            engine.on_abort.append(lambda rid: logger.info("aborted request %s", log_id(rid)))

    def observe(self, out: RequestOutput) -> None:
        m = out.metrics
        for hist, value in ((self.ttft, m.time_to_first_token), (self.tpot, m.time_per_output_token),
                            (self.e2e, m.e2e_time), (self.queue, m.queue_time)):
            if value is not None:
                hist.observe(value)
        if m.num_images:
            self.encoder.observe(m.encoder_time)
        if self.log_requests:
            reasons = ",".join(sorted({c.finish_reason or "" for c in out.outputs})) or "pooled"
            ttft = m.time_to_first_token
            logger.info("finished request %s%s: prompt %d tokens%s, output %d tokens, ttft %s, total %.3f s, %s%s",
                        log_id(out.request_id),
                        f" (adapter {out.lora_request.lora_name})" if out.lora_request is not None else "",
                        m.num_prompt_tokens,
                        f" ({m.num_images} images, encoder {m.encoder_time:.3f} s)" if m.num_images else "",
                        m.num_output_tokens, "-" if ttft is None else f"{ttft:.3f} s", m.e2e_time or 0.0, reasons,
                        f", prompt {self._prompt(out)!r}" if self.log_prompts else "")

    def _prompt(self, out: RequestOutput) -> str:
        text = out.prompt
        if text is None and self.detokenize is not None:
            text = self.detokenize(out.prompt_token_ids)
        text = text or ""
        return text if len(text) <= 1000 else text[:1000] + "..."

    async def endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
