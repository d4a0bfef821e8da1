"""Schemathesis against the server's own /openapi.json: hundreds of generated requests, valid
by the schema and deliberately invalid, across every route. None may get a 5xx; every error
is the JSON envelope; afterwards the server still serves and its KV pool is whole."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode

from tests.conftest import assert_pool_clean

pytestmark = [pytest.mark.server, pytest.mark.slow]

EXAMPLES = {GenerationMode.POSITIVE: 45, GenerationMode.NEGATIVE: 30}


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir):
    from pageserve.runtime.engine_args import EngineArgs
    from tests.live_server import InProcessServer

    # a short context keeps every generated max_tokens cheap
    # adapters on, and their loading routes: fuzzed with the rest
    srv = InProcessServer(EngineArgs(model=str(tiny_model_dir), dtype="float32", kv_cache_memory=0.002,
                                     swap_space=0.001, max_model_len=192, max_num_seqs=8,
                                     debug_checks=True, enable_lora=True),
                          allow_runtime_lora_updating=True)
    yield srv
    srv.stop()


def test_fuzz_every_route(fuzz_server):
    srv = fuzz_server
    schema = schemathesis.openapi.from_url(f"{srv.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {
        "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/tokenize",
        "/detokenize", "/health", "/version", "/metrics", "/v1/responses", "/v1/responses/{response_id}"}
    # greedy and to its length: the same tokens after the fuzzing, or a fuzzed request left something behind
    probe = {"model": srv.model, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0,
             "ignore_eos": True, "logprobs": 0}
    before = httpx.post(f"{srv.url}/v1/completions", timeout=60, json=probe).json()["choices"][0]
    sent: dict[str, int] = {}
    statuses: dict[int, int] = {}
    by_route: dict[tuple[str, int], int] = {}

    def run(op, mode):
        @given(case=op.as_strategy(generation_mode=mode))
        # derandomize: hypothesis's own choices fixed (the strategies' string hashing is not)
        @settings(max_examples=EXAMPLES[mode], deadline=None, database=None, derandomize=True,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        def fuzz(case):
            response = case.call(base_url=srv.url, timeout=120)
            sent[op.label] = sent.get(op.label, 0) + 1
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            by_route[op.label, response.status_code] = by_route.get((op.label, response.status_code), 0) + 1
            case.validate_response(response, checks=[not_a_server_error])
            if response.status_code >= 400:
                error = response.json()["error"]
                assert isinstance(error["message"], str) and "Traceback" not in error["message"]
        fuzz()

    for op in operations:
        run(op, GenerationMode.POSITIVE)
        if op.method.lower() == "post":  # a route with nothing to send has no invalid form
            run(op, GenerationMode.NEGATIVE)
    total = sum(sent.values())
    print(f"schemathesis: {total} requests, by route and status {dict(sorted(by_route.items()))}")
    assert total >= 500, sent
    # successes vary by process (84-140 of 740 seen: the draws still depend on string hashing);
    # enough that the valid paths are exercised, not only the refusals
    assert statuses.get(200, 0) >= 60 and sum(v for k, v in statuses.items() if 400 <= k < 500) >= 100
    # still serving, nothing left behind
    assert httpx.get(f"{srv.url}/health").status_code == 200
    srv.wait_idle(30)  # alone, as the first sending was
    ok = httpx.post(f"{srv.url}/v1/completions", timeout=60, json=probe)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8
    after = ok.json()["choices"][0]
    # the tiny model's byte tokens each read "\ufffd" in the text; their log-probabilities tell them apart
    assert after["text"] == before["text"] and after["logprobs"]["tokens"] == before["logprobs"]["tokens"]
    assert after["logprobs"]["token_logprobs"] == pytest.approx(before["logprobs"]["token_logprobs"], abs=1e-3)
    srv.wait_idle(30)
    assert_pool_clean(srv.engine)
