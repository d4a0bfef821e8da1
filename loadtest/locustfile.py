"""Locust load test for a pageserve (or any OpenAI-compatible) server.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless -u 16 -r 4 -t 60s
    make loadtest HOST=http://127.0.0.1:8000 USERS=16 TIME=60s

Users: a streaming chat user, whose time to first token and inter-token latency are reported
as their own entries ("TTFT" and "ITL"), and a completions user. Set PAGESERVE_RAMP=1 for a
ramp (users climb in steps, hold, then fall) instead of fixed -u/-r/-t. A stream that ends
without `data: [DONE]`, or carries an error event, counts as a failure.
(A JSON-schema user comes with structured output.)"""

from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, LoadTestShape, between, events, task

MODEL = os.environ.get("PAGESERVE_MODEL")  # default: the server's first model
API_KEY = os.environ.get("PAGESERVE_API_KEY")
QUESTIONS = ["What is a paged KV cache?", "Write a haiku about the sea.", "Name three prime numbers.",
             "Why is the sky blue?", "Give me a recipe for bread.", "What does a compiler do?",
             "Tell me a fact about owls.", "How do tides work?"]


def _fire(name: str, seconds: float, exception=None) -> None:
    events.request.fire(request_type=name, name=name, response_time=seconds * 1000, response_length=0,
                        exception=exception, context={})


class _OpenAIUser(HttpUser):
    abstract = True
    wait_time = between(0.2, 1.0)
    model: str | None = None

    def on_start(self):
        if API_KEY:
            self.client.headers["Authorization"] = f"Bearer {API_KEY}"
        self.model = MODEL or self.client.get("/v1/models", name="/v1/models").json()["data"][0]["id"]


class StreamingChatUser(_OpenAIUser):
    weight = 3

    @task
    def chat(self):
        body = {"model": self.model, "messages": [{"role": "user", "content": random.choice(QUESTIONS)}],
                "max_tokens": 48, "temperature": 0.7, "stream": True}
        start = time.perf_counter()
        gaps = []  # (TTFT or ITL, seconds), reported once the stream is known to be whole
        with self.client.post("/v1/chat/completions", json=body, stream=True, catch_response=True,
                              name="chat (stream)") as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}")
                return
            done, last = False, None
            try:
                for raw in r.iter_lines():
                    line = raw.decode() if isinstance(raw, bytes) else raw
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        r.failure(chunk["error"].get("message", "error event"))
                        return
                    if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                        now = time.perf_counter()
                        gaps.append(("TTFT" if last is None else "ITL", now - (start if last is None else last)))
                        last = now
            except Exception as e:  # noqa: BLE001 - a broken stream is a failed request
                r.failure(f"{type(e).__name__}: {e}")
                return
            if not done:
                r.failure("the stream ended without [DONE]")
                return
            r.success()
        for name, seconds in gaps:
            _fire(name, seconds)


class CompletionsUser(_OpenAIUser):
    weight = 1

    @task
    def complete(self):
        body = {"model": self.model, "prompt": random.choice(QUESTIONS), "max_tokens": 32, "temperature": 0}
        with self.client.post("/v1/completions", json=body, catch_response=True, name="completions") as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200]}")
            elif r.json()["choices"][0]["finish_reason"] not in ("stop", "length"):
                r.failure(f"unexpected answer: {r.text[:200]}")
            else:
                r.success()


if os.environ.get("PAGESERVE_RAMP"):
    class RampShape(LoadTestShape):
        """Climb to PAGESERVE_RAMP_USERS in four steps of STEP seconds, hold, then fall."""

        peak = int(os.environ.get("PAGESERVE_RAMP_USERS", "32"))
        step = float(os.environ.get("PAGESERVE_RAMP_STEP", "15"))

        def tick(self):
            t = self.get_run_time()
            stage = int(t // self.step)
            if stage < 4:
                return max(1, self.peak * (stage + 1) // 4), self.peak
            if stage < 6:
                return self.peak, self.peak
            if stage < 7:
                return max(1, self.peak // 4), self.peak
            return None
