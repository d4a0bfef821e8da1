"""Async scheduling (--async-scheduling): the next step is scheduled while the last one runs, a
decoding request running ahead on a placeholder that the runner fills on the device with the
token the step before drew. The same tokens as without it: greedy, seeded sampling with
penalties, through chunked prefill, both preemption modes, prefix-cache hits, stops, n > 1
and grammars; a GPU's host waits for each step's draws only when it collects that step."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from pageserve.runtime import LLM, SamplingParams, model_runner
from pageserve.runtime import scheduler as scheduler_mod
from pageserve.runtime.engine_args import EngineArgs
from pageserve.runtime.kernels import TorchKernels
from pageserve.sampling.params import StructuredOutputsParams, ThinkingBudget
from tests.conftest import assert_pool_clean
from tests.fake_cuda import FakeCuda

pytestmark = pytest.mark.engine


SEEN = {"ahead": 0, "steps": 0}


@pytest.fixture
def placeholders(monkeypatch):
    """Counts the requests each scheduled step runs ahead (from each `run`'s first step)."""
    seen = SEEN
    seen.update(ahead=0, steps=0)
    schedule = scheduler_mod.Scheduler.schedule

    def counting(self, *args):
        out = schedule(self, *args)
        seen["ahead"] += sum(r.placeholder for r in out.requests)
        seen["steps"] += bool(out.requests)
        return out

    monkeypatch.setattr(scheduler_mod.Scheduler, "schedule", counting)
    return seen


def run(model_dir, prompts, params, **kw) -> tuple[list[list[int]], LLM]:
    args = dict(dtype="float32", max_num_batched_tokens=32, max_model_len=96, debug_checks=True) | kw
    llm = LLM(str(model_dir), **args)
    SEEN.update(ahead=0, steps=0)  # not the warm-up's
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_pool_clean(llm.engine)
    assert not llm.engine.has_unfinished_requests()  # no step left in flight (a stop's run-ahead one)
    return [[c.token_ids for c in o.outputs] for o in outs], llm


def workload(seed: int = 0, n: int = 12):
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 300) for _ in range(rng.randrange(3, 60))]} for _ in range(n)]
    lengths = [rng.randrange(1, 30) for _ in prompts]
    return prompts, lengths


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_same_greedy_tokens_through_preemption(tiny_model_dir, placeholders, mode):
    """A KV pool of six blocks for twelve requests: both preemption modes happen, requests run
    ahead, and every token is the one without async scheduling."""
    prompts, lengths = workload()
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in lengths]
    kw = dict(kv_cache_memory=0.00005, swap_space=0.00002 if mode == "swap" else 0, preemption_mode=mode)
    want, llm = run(tiny_model_dir, prompts, params, **kw)
    assert placeholders["ahead"] == 0 and llm.engine.scheduler.num_preemptions > 0
    got, llm = run(tiny_model_dir, prompts, params, async_scheduling=True, **kw)
    assert got == want
    s = llm.engine.scheduler
    assert s.num_preemptions > 0
    if mode == "swap":
        assert s.num_swapped_out_blocks > 0
    else:
        assert s.num_recomputed == s.num_preemptions
    assert placeholders["ahead"] > 50


def test_seeded_sampling_with_penalties_and_n(tiny_model_dir, placeholders):
    """Seeded draws at temperature 1 with penalties (their counts updated on the device), n = 2
    (the fork's step does not run ahead), stop tokens that end requests while a step runs ahead
    of them (its token is dropped), a grammar's request beside them (never ahead): the same
    tokens as without async scheduling."""
    prompts, lengths = workload(1, 8)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=m, repetition_penalty=1.3,
                             frequency_penalty=0.5, stop_token_ids=[7, 11, 13], n=1 + i % 2)
              for i, m in enumerate(lengths)]
    params[3] = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(
        json={"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["v"], "additionalProperties": False}))
    params[5] = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,  # ahead once its thinking ends
                               thinking_budget=ThinkingBudget(4, (381, 382)))
    want, _ = run(tiny_model_dir, prompts, params, kv_cache_memory=0.001)
    got, llm = run(tiny_model_dir, prompts, params, kv_cache_memory=0.001, async_scheduling=True)
    assert got == want
    assert placeholders["ahead"] > 20
    assert "v" in json.loads(llm.engine.tokenizer.decode(got[3][0]))
    assert got[5][0][4:6] == [381, 382]


def test_prefix_cache_hits(tiny_model_dir, placeholders):
    """A second round of the same prompts (each extended) hits the blocks the first round
    cached, written in part by steps that ran ahead."""
    prompts, lengths = workload(2, 6)
    params = [SamplingParams(temperature=0.0, max_tokens=m + 20, ignore_eos=True) for m in lengths]
    results = {}
    for on in (False, True):
        llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=0.001, max_num_batched_tokens=32,
                  max_model_len=160, debug_checks=True, async_scheduling=on)
        first = llm.generate(prompts, params, use_tqdm=False)
        again = [{"prompt_token_ids": p["prompt_token_ids"] + o.outputs[0].token_ids + [5]}
                 for p, o in zip(prompts, first)]
        second = llm.generate(again, params, use_tqdm=False)
        assert sum(o.metrics.num_cached_tokens for o in second) >= 16 * len(prompts)
        results[on] = [o.outputs[0].token_ids for o in first + second]
        assert_pool_clean(llm.engine)
    assert results[True] == results[False]
    assert placeholders["ahead"] > 100


def test_no_token_past_max_tokens(tiny_model_dir, placeholders):
    """One request of m tokens: the prompt's step draws the first, m - 1 steps run ahead for the
    others, and none computes a token the length limit would drop."""
    got, llm = run(tiny_model_dir, [{"prompt_token_ids": [5, 6, 7]}],
                   SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
                   kv_cache_memory=0.001, async_scheduling=True)
    assert len(got[0][0]) == 9
    assert placeholders == {"ahead": 8, "steps": 9}


def test_generate_leaves_no_step_in_flight_after_a_stop(tiny_model_dir):
    """A stop token ends a request whose next step already ran ahead: generate() returns with
    that step collected (it carries the finished request's id to the runner)."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got, _ = run(tiny_model_dir, [{"prompt_token_ids": [5, 6, 7, 8]}], params, async_scheduling=True)
    stop = got[0][0][4]
    got, _ = run(tiny_model_dir, [{"prompt_token_ids": [5, 6, 7, 8]}],
                 SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop]),
                 async_scheduling=True)
    assert got[0][0][-1] == stop and len(got[0][0]) < 8


def test_abort_while_running_ahead(tiny_model_dir):
    """A request aborted while a step in flight runs it ahead: the others finish as without
    async scheduling, that step's token for it is dropped, and every block comes back."""
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=0.001, max_num_batched_tokens=32,
              debug_checks=True, async_scheduling=True)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i in range(3):
        engine.add_request([5 + i, 6, 7], params, request_id=f"r{i}")
    done = {}
    aborted = False
    for _ in range(60):
        if not aborted and len(engine._in_flight) == 1 and engine.scheduler._in_flight.get("r1") == 1 \
                and engine.requests["r1"].num_output_tokens > 2:
            engine.step()  # submits a step running r1 ahead, collects the one before
            (step, _, _), = engine._in_flight
            assert any(r.request_id == "r1" and r.placeholder for r in step.requests)
            engine.abort_request("r1")
            aborted = True
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    want, _ = run(tiny_model_dir, [{"prompt_token_ids": [5 + i, 6, 7]} for i in (0, 2)], params,
                  kv_cache_memory=0.001)
    assert aborted and [done["r0"], done["r2"]] == [w[0] for w in want] and "r1" not in done
    assert_pool_clean(engine)


def test_the_host_waits_for_a_step_only_when_collecting_it(tiny_model_dir, monkeypatch):
    """On a (fake) GPU, decodes replayed as CUDA graphs: inputs go up without waiting for the
    stream, the draws come down into a buffer with an event, and the host waits on step N's
    event only after it has queued step N + 1, whose placeholders the device fills from step
    N's draws."""
    dev = FakeCuda()
    monkeypatch.setattr(model_runner, "device_for", lambda device: dev)
    monkeypatch.setattr(TorchKernels, "graph_safe", True)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 10]}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kw = dict(dtype="float32", max_num_batched_tokens=32, kv_cache_memory=0.001, cuda_graph_sizes=[1, 2])
    want, _ = run(tiny_model_dir, prompts, params, **kw)
    llm = LLM(str(tiny_model_dir), async_scheduling=True, **kw)
    dev.log.clear()
    got = [[o.outputs[0].token_ids] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want and llm.engine.runner.graphs.replays > 0
    log = [e for e in dev.log if e[0] in ("download", "event_sync")]
    downloads = [e[1] for e in log if e[0] == "download"]
    assert len(downloads) >= 6
    for i, name in enumerate(downloads[:-1]):  # step i is waited for after step i + 1 went down
        assert log.index(("download", downloads[i + 1])) < log.index(("event_sync", name))
    assert not any(e[0] == "synchronize" for e in dev.log)
    # a step's inputs go up in one copy
    assert sum(e[0] == "upload_many" for e in dev.log) >= len(downloads)


def test_a_sampled_steps_parameters_go_up_with_one_copy(tiny_model_dir, monkeypatch):
    """On a (fake) GPU, the sampling rows' temperatures, top-k, biases and penalties go up in one
    copy a step (not one each), and give the tokens they give on the CPU."""
    dev = FakeCuda()
    params = SamplingParams(temperature=0.8, top_k=5, seed=3, logit_bias={7: 3.0}, presence_penalty=0.5,
                            min_tokens=2, stop_token_ids=[11], max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 10]}]
    kw = dict(dtype="float32", max_num_batched_tokens=32, kv_cache_memory=0.001)
    want, _ = run(tiny_model_dir, prompts, params, **kw)
    monkeypatch.setattr(model_runner, "device_for", lambda device: dev)
    llm = LLM(str(tiny_model_dir), **kw)
    dev.log.clear()
    got = [[o.outputs[0].token_ids] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert not any(e[0] == "upload" for e in dev.log)
    sizes = [e[1] for e in dev.log if e[0] == "upload_many"]
    # each step: its inputs (nine lists), then its sampling rows (six, bias three, banned
    # tokens two while min_tokens holds, penalties five)
    assert sizes[:2] == [9, 16] and set(sizes[1::2]) == {14, 16} and set(sizes[::2]) == {9}


def test_uploads_packed_in_one_buffer():
    """Lists and arrays of several dtypes and shapes (empty ones too) through one byte buffer
    come out as they went in."""
    from pageserve.runtime.device import pack_uploads

    table = np.arange(12, dtype=np.int32).reshape(3, 4)
    items = [([1, 2, 3], torch.int64), ([], torch.int64), (table, torch.int32), ([0.5, -2.0], torch.float32),
             ([True, False, True], torch.bool), ([7], torch.int32), ([2 ** 40], torch.int64)]
    host, views = pack_uploads(items, pin=False)
    got = views(host.clone())
    for (values, dtype), tensor in zip(items, got):
        assert tensor.dtype == dtype and torch.equal(tensor, torch.as_tensor(np.asarray(values)).to(dtype))


@pytest.mark.parametrize("kw,message", [
    (dict(tensor_parallel_size=2), "one rank"),
    (dict(pipeline_parallel_size=2), "one rank"),
    (dict(speculative_config={"method": "ngram"}), "speculative"),
])
def test_refused_where_not_supported(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(async_scheduling=True, **kw)


@pytest.mark.parametrize("device,kw,on", [
    ("cuda", {}, True), ("cpu", {}, False), ("cuda", dict(async_scheduling=False), False),
    ("cpu", dict(async_scheduling=True), True), ("cuda", dict(tensor_parallel_size=2), False),
    ("cuda", dict(pipeline_parallel_size=2), False), ("cuda", dict(speculative_config={"method": "ngram"}), False),
])
def test_on_by_default_on_one_gpu(device, kw, on):
    """Unset, async scheduling is on where it applies and pays: CUDA, one rank, no drafts."""
    assert EngineArgs(**kw).scheduler_config(512, torch.device(device)).async_scheduling is on


@pytest.mark.server
def test_served_streams_match(tiny_model_dir, placeholders):
    """The real server with --async-scheduling: eight concurrent streamed completions (openai
    client) give the texts the engine gives without it, and the pool comes back whole."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    from tests.live_server import InProcessServer

    prompts = [f"story {i}: once upon a time" for i in range(8)]
    lengths = [5 + 3 * i for i in range(8)]
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=0.01, max_model_len=512)
    want = [o.outputs[0].text for o in llm.generate(
        prompts, [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in lengths], use_tqdm=False)]
    server = InProcessServer(EngineArgs(model=str(tiny_model_dir), dtype="float32", kv_cache_memory=0.01,
                                        max_model_len=512, async_scheduling=True))
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="x")

        def stream(i: int) -> str:
            chunks = client.completions.create(model=server.model, prompt=prompts[i], max_tokens=lengths[i],
                                               temperature=0.0, stream=True, extra_body={"ignore_eos": True})
            return "".join(c.choices[0].text for c in chunks if c.choices)

        placeholders.update(ahead=0, steps=0)
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(stream, range(8)))
        assert got == want and placeholders["ahead"] > 10
        server.wait_idle()
        assert_pool_clean(server.engine)
    finally:
        server.stop()
