"""--scheduling-policy priority (vLLM's): waiting and swapped-out requests are taken by
(priority, arrival), the lowest first, and a preemption takes the running request of lowest
priority; a request's tokens do not depend on the order. Under the default, fcfs, a request
that names a priority other than 0 is refused, naming the field."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from pageserve.runtime import LLM, SamplingParams
from pageserve.runtime.config import SchedulerConfig
from pageserve.runtime.engine_args import EngineArgs
from pageserve.runtime.input_processor import InvalidRequest
from pageserve.runtime.kv_cache_manager import KVCacheManager
from pageserve.runtime.request import Request, RequestStatus
from pageserve.runtime.scheduler import Scheduler
from pageserve.runtime.swap_space import SwapSpace
from tests.live_server import InProcessServer


def _scheduler(policy: str, num_blocks=64, max_seqs=8, swap_blocks=0) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=64, max_model_len=4096,
                          enable_chunked_prefill=True, policy=policy)
    return Scheduler(cfg, KVCacheManager(num_blocks, 4, enable_prefix_caching=False), SwapSpace(swap_blocks),
                     "swap" if swap_blocks else "recompute")


def _request(rid: str, priority: int, prompt_len=8, max_tokens=8) -> Request:
    req = Request(rid, list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=max_tokens), max_tokens, (0,))
    req.priority = priority
    return req


def _step(sched: Scheduler):
    out = sched.schedule()
    for sr, req in zip(out.requests, sched.update_after_step()):
        if sr.sample:
            req.token_ids.append(7)
            if req.num_output_tokens >= req.max_tokens:
                sched.finish(req, RequestStatus.FINISHED_LENGTH)
    sched.kv.check_integrity()
    return out


@pytest.mark.unit
@pytest.mark.parametrize("policy, order", [("fcfs", ["a", "b", "c", "d", "e"]),
                                           ("priority", ["d", "b", "e", "a", "c"])])
def test_waiting_requests_start_by_priority_then_arrival(policy, order):
    sched = _scheduler(policy, max_seqs=1)
    for rid, priority in (("a", 5), ("b", 0), ("c", 5), ("d", -3), ("e", 0)):
        sched.add_request(_request(rid, priority, max_tokens=1))
        time.sleep(0.001)  # distinct arrival times
    started = []
    while sched.has_unfinished():
        started += [sr.request_id for sr in _step(sched).requests]
    assert started == order


@pytest.mark.unit
@pytest.mark.parametrize("policy, victim", [("fcfs", "r2"), ("priority", "r0")])
def test_a_preemption_takes_the_running_request_of_lowest_priority(policy, victim):
    # 9 blocks of 4 for three prompts of 8 tokens; r0 (the lowest priority) starts first, the
    # others a step later: r0 needs a 4th block first (at its 13th token), and none is free
    sched = _scheduler(policy, num_blocks=9)
    sched.add_request(_request("r0", 9))
    _step(sched)
    for rid in ("r1", "r2"):
        sched.add_request(_request(rid, 0))
    out = next(out for out in (_step(sched) for _ in range(8)) if out.preempted)
    assert out.preempted == [victim]
    assert sorted(sr.request_id for sr in out.requests) == sorted({"r0", "r1", "r2"} - {victim})
    # back in the queue: under priority behind a later request of higher priority
    sched.add_request(_request("r3", 0))
    assert [r.request_id for r in sched.waiting] == ([victim, "r3"] if policy == "fcfs" else ["r3", victim])


@pytest.mark.engine
def test_offline_priorities_order_the_requests_but_not_their_tokens(tiny_model_dir):
    common = dict(dtype="float32", kv_cache_memory=0.01, max_model_len=256, max_num_seqs=1, swap_space=0)
    prompts = [[10 + i, 20 + i, 30 + i, 40 + i] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    fcfs = LLM(str(tiny_model_dir), **common)
    expected = [o.outputs[0].token_ids for o in fcfs.generate(prompts, params, use_tqdm=False)]
    with pytest.raises(ValueError, match="prompt 1: priority 2 was given, but the server schedules first come"):
        fcfs.generate(prompts[:2], params, priority=[0, 2], use_tqdm=False)
    with pytest.raises(InvalidRequest) as refused:
        fcfs.engine.add_request(prompts[0], params, priority=-1)
    assert refused.value.param == "priority"
    assert not fcfs.engine.has_unfinished_requests()

    llm = LLM(str(tiny_model_dir), scheduling_policy="priority", **common)
    outs = llm.generate(prompts, params, priority=[3, 1, 2, 0], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    # one at a time (max_num_seqs=1): each started after the one before it in priority order
    started = [o.metrics.scheduled_time for o in outs]
    assert started[3] < started[1] < started[2] < started[0]
    with pytest.raises(ValueError, match="got 4 prompts but 3 priorities"):
        llm.generate(prompts, params, priority=[0, 1, 2], use_tqdm=False)


@pytest.mark.unit
def test_the_policy_is_checked_before_anything_loads():
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority; got 'lifo'"):
        EngineArgs(model="x", scheduling_policy="lifo")


@pytest.mark.server
def test_the_fcfs_server_refuses_a_priority_and_takes_zero(tiny_server):
    for route, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
                        ("/v1/responses", {"input": "hi", "max_output_tokens": 2})):
        r = httpx.post(tiny_server.url + route, json={**body, "priority": 1}, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "priority"
        assert "--scheduling-policy priority" in r.json()["error"]["message"]
    ok = httpx.post(tiny_server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "priority": 0},
                    timeout=30)
    assert ok.status_code == 200, ok.text


@pytest.mark.server
def test_a_served_request_of_higher_priority_starts_first(tiny_model_dir):
    """One sequence at a time: while a long request runs, one of priority 5 and then one of
    priority -5 arrive; the second starts (and so ends) first."""
    srv = InProcessServer(EngineArgs(model=str(tiny_model_dir), dtype="float32", kv_cache_memory=0.01,
                                     max_model_len=512, max_num_seqs=1, scheduling_policy="priority"))
    try:
        async def scenario() -> list[str]:
            done: list[str] = []
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
                async def complete(name: str, priority: int, max_tokens: int):
                    r = await client.post("/v1/completions", json={
                        "prompt": f"request {name}", "max_tokens": max_tokens, "ignore_eos": True,
                        "temperature": 0, "priority": priority})
                    assert r.status_code == 200, r.text
                    done.append(name)

                async def until(condition):
                    deadline = time.monotonic() + 30
                    while not condition(srv.engine.scheduler):
                        assert time.monotonic() < deadline, "the long request ended before the others queued"
                        await asyncio.sleep(0.005)

                first = asyncio.create_task(complete("long", 0, 480))
                await until(lambda s: s.running)
                low = asyncio.create_task(complete("low", 5, 4))
                await until(lambda s: len(s.waiting) == 1)
                high = asyncio.create_task(complete("high", -5, 4))
                await until(lambda s: len(s.waiting) == 2)
                assert [r.priority for r in srv.engine.scheduler.waiting] == [-5, 5]
                await asyncio.gather(first, low, high)
            return done

        assert asyncio.run(scenario()) == ["long", "high", "low"]
        srv.wait_idle()
    finally:
        srv.stop()
