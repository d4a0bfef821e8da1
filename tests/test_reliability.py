"""Faults and overload against the real server (tiny model, in process so the engine can be
inspected): a storm of clients that drop, five times the KV capacity at once, a graceful
shutdown, a forced one, and a signal during start-up."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from pathlib import Path

import httpx
import pytest

from pageserve.sampling.params import SamplingParams
from tests.conftest import assert_pool_clean
from tests.live_server import InProcessServer

pytestmark = pytest.mark.server

PROMPT = "The quick brown fox jumps over the lazy dog. " * 3


def _tiny_server(tiny_model_dir, kv_gib: float, **settings) -> InProcessServer:
    from pageserve.runtime.engine_args import EngineArgs

    return InProcessServer(EngineArgs(model=str(tiny_model_dir), dtype="float32", kv_cache_memory=kv_gib,
                                      swap_space=kv_gib / 2, max_num_seqs=16, max_model_len=1024,
                                      debug_checks=True), **settings)


@pytest.fixture(scope="module")
def small_server(tiny_model_dir):
    """A small KV pool (64 blocks of 16 tokens) so that load preempts and swaps."""
    srv = _tiny_server(tiny_model_dir, 0.0005, max_num_queued_reqs=24)
    assert 48 <= srv.engine.kv.pool.num_blocks <= 80, srv.engine.kv.pool.num_blocks
    # one stream first: sse-starlette starts one watcher task per event loop, for good
    with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=60,
                      json={"model": srv.model, "prompt": "hi", "max_tokens": 2, "stream": True}) as r:
        r.read()
    yield srv
    srv.stop()


def _num_tasks(srv: InProcessServer) -> int:
    async def count():
        return len(asyncio.all_tasks())
    return srv.call(count)


def _quiet_tasks(srv: InProcessServer) -> int:
    """The event loop's task count once the last request's tasks have wound down (the same
    count for half a second): the baseline a test compares against."""
    srv.wait_idle(30)
    last, since = _num_tasks(srv), time.monotonic()
    deadline = since + 10
    while time.monotonic() - since < 0.5 and time.monotonic() < deadline:
        time.sleep(0.05)
        now = _num_tasks(srv)
        if now != last:
            last, since = now, time.monotonic()
    return last


def _assert_settled(srv: InProcessServer, tasks_before: int) -> None:
    """No request, stream, pending hand-over or deadline left; every block free; the event
    loop back to the tasks it had before."""
    srv.wait_idle(30)
    engine = srv.state.engine
    assert not engine._streams and not engine._pending and not engine._aborts and not engine._deadlines
    assert_pool_clean(srv.engine)
    deadline = time.monotonic() + 10
    while _num_tasks(srv) > tasks_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _num_tasks(srv) == tasks_before, "asyncio tasks left behind"


def test_disconnect_storm_leaves_nothing_behind(small_server):
    """100 clients, streaming or not, that go away at random points: before the headers, after
    some tokens, or read to the end."""
    srv = small_server
    tasks_before = _quiet_tasks(srv)
    preempted_before = srv.engine.scheduler.num_preemptions
    rng = random.Random(0)
    outcomes = {"cancelled": 0, "dropped": 0, "whole": 0}

    # Drawn up front, so the plan does not depend on the order the tasks run in. The first 12
    # stream 200 tokens each to the end: together they need ~3x the pool, so it fills (and
    # preempts) however fast the machine is.
    plan = []
    for i in range(100):
        if i < 12:
            plan.append((True, 200, None, None))
        else:
            gone_after = rng.uniform(0, 0.5) if rng.random() < 0.3 else None
            plan.append((i % 4 != 0, rng.randint(20, 200), gone_after, rng.randint(0, 60)))

    async def client(http: httpx.AsyncClient, i: int) -> None:
        stream, max_tokens, gone_after, keep = plan[i]
        body = {"model": srv.model, "prompt": PROMPT, "max_tokens": max_tokens,
                "ignore_eos": True, "stream": stream}
        if gone_after is not None:  # gone before (or just as) the answer starts
            try:
                await asyncio.wait_for(http.post("/v1/completions", json=body), gone_after)
                outcomes["whole"] += 1
            except asyncio.TimeoutError:
                outcomes["cancelled"] += 1
            return
        if not stream:
            r = await http.post("/v1/completions", json=body)
            assert r.status_code in (200, 503), r.text
            outcomes["whole"] += 1
            return
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code == 503:  # the queue limit: refused, nothing to drop
                return
            assert r.status_code == 200
            n = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    n += 1
                    if keep is not None and n >= keep:
                        outcomes["dropped"] += 1
                        return  # leaving the block closes the connection mid-stream
        outcomes["whole"] += 1

    async def storm():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=limits) as http:
            await asyncio.gather(*(client(http, i) for i in range(100)))

    srv.state.engine.max_num_queued_reqs = 1000  # all 100 get in
    try:
        asyncio.run(storm())
    finally:
        srv.state.engine.max_num_queued_reqs = 24
    assert outcomes["cancelled"] > 5 and outcomes["dropped"] > 20, outcomes
    _assert_settled(srv, tasks_before)
    assert srv.engine.scheduler.num_preemptions > preempted_before, "the storm never filled the pool"
    # ignore_eos: sampled at temperature 1 after a storm of any timing, EOS can come first
    r = httpx.post(f"{srv.url}/v1/completions", timeout=60,
                   json={"model": srv.model, "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


def test_five_times_the_kv_capacity_at_once(small_server):
    """Every request is served in full or refused with 503 + Retry-After (past the queue
    limit); refused ones that retry after Retry-After are served too; nothing hangs."""
    srv = small_server
    tasks_before = _quiet_tasks(srv)
    capacity = srv.engine.kv.pool.num_blocks * srv.engine.kv.block_size
    prompt_ids = srv.engine.tokenizer.encode(PROMPT)
    max_tokens = 64
    num = 5 * capacity // (len(prompt_ids) + max_tokens) + 1
    refused: list[int] = []

    async def client(http: httpx.AsyncClient, i: int) -> None:
        body = {"model": srv.model, "prompt": prompt_ids, "max_tokens": max_tokens, "ignore_eos": True,
                "stream": i % 2 == 0}
        while True:
            if body["stream"]:
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code == 200:
                        events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
                        assert events[-1] == "[DONE]"
                        chunks = [json.loads(e) for e in events[:-1]]
                        assert not any("error" in c for c in chunks), chunks[-1]
                        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
                        return
                    await r.aread()
            else:
                r = await http.post("/v1/completions", json=body)
                if r.status_code == 200:
                    assert r.json()["usage"]["completion_tokens"] == max_tokens
                    return
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "server_overloaded"
            refused.append(i)
            await asyncio.sleep(float(r.headers["retry-after"]))

    async def flood():
        limits = httpx.Limits(max_connections=num + 10)
        async with httpx.AsyncClient(base_url=srv.url, timeout=120, limits=limits) as http:
            await asyncio.wait_for(asyncio.gather(*(client(http, i) for i in range(num))), 300)

    asyncio.run(flood())
    assert refused, "the queue limit was never reached"
    _assert_settled(srv, tasks_before)


def test_more_prompts_than_the_queue_holds_is_a_400_not_a_retry(small_server):
    """A request that alone is over --max-num-queued-reqs could never be taken: a 400 naming its
    prompts (a 503 told the client to retry forever); the queue's limit itself is taken."""
    srv = small_server
    limit = srv.state.engine.max_num_queued_reqs
    for path, key in (("/v1/completions", "prompt"), ("/v1/embeddings", "input")):
        body = {"model": srv.model, key: ["hi"] * (limit + 1), "max_tokens": 1}
        r = httpx.post(f"{srv.url}{path}", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == key, r.text
        assert "--max-num-queued-reqs" in r.json()["error"]["message"]
        body[key] = body[key][:limit]
        assert httpx.post(f"{srv.url}{path}", json=body, timeout=60).status_code == 200
    # the queue counts sequences: prompts x n over the limit is refused the same way
    body = {"model": srv.model, "prompt": ["hi"] * 3, "max_tokens": 1, "n": limit // 3 + 1}
    r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and f"{3 * body['n']} sequences" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "n"
    r = httpx.post(f"{srv.url}/v1/completions", json={**body, "n": limit // 3}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == limit // 3 * 3


def test_a_waiting_request_of_n_counts_n_sequences(tiny_llm):
    """Until its first sample forks it, a request of n = 4 waits as four sequences (the queue's
    limit counts them); its forks then run, and nothing waits."""
    engine = tiny_llm.engine
    engine.add_request([5, 6, 7], SamplingParams(temperature=1.0, n=4, max_tokens=3), request_id="four")
    engine.add_request([5, 6, 8], SamplingParams(temperature=0, max_tokens=3), request_id="one")
    assert (engine.num_waiting, engine.num_waiting_sequences) == (2, 5)
    engine.step()
    assert (engine.num_waiting, engine.num_waiting_sequences) == (0, 0)
    while engine.has_unfinished_requests():
        engine.step()


def _slow_server(tiny_model_dir, shutdown_timeout: float) -> InProcessServer:
    """A server whose model takes ~20 ms a step, so that requests are still in flight at shutdown."""
    srv = _tiny_server(tiny_model_dir, 0.01, shutdown_timeout=shutdown_timeout)
    fast = srv.engine.runner.execute

    def execute(out):
        time.sleep(0.02)
        return fast(out)
    srv.engine.runner.execute = execute
    return srv


def test_a_second_interrupt_stops_the_requests_in_flight_at_once(tiny_model_dir):
    """Ctrl-C twice (uvicorn's force exit): the requests in flight end now with the shutdown's
    error (an error event then [DONE], a 503), not after --shutdown-timeout nor as a 500, and
    the engine stops."""
    import signal

    srv = _slow_server(tiny_model_dir, shutdown_timeout=60.0)
    body = {"model": srv.model, "prompt": PROMPT, "ignore_eos": True, "max_tokens": 900}
    whole: dict = {}
    poster = threading.Thread(target=lambda: whole.setdefault(
        "r", httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)))
    try:
        with httpx.stream("POST", f"{srv.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            poster.start()
            deadline = time.monotonic() + 30
            while len(srv.engine.requests) < 2 and time.monotonic() < deadline:  # both in the engine
                time.sleep(0.02)
            started = time.monotonic()
            srv.server.handle_exit(signal.SIGINT, None)
            time.sleep(0.3)  # uvicorn is waiting for the connections to close
            srv.server.handle_exit(signal.SIGINT, None)
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert time.monotonic() - started < 30
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "server_shutting_down"
        assert "a second interrupt" in json.loads(events[-2])["error"]["message"]
        poster.join(30)
        assert whole["r"].status_code == 503, whole["r"].text
        srv.thread.join(30)
        assert not srv.thread.is_alive(), "the server did not stop"
        assert not srv.state.engine.is_running
    finally:
        srv.stop()


def test_graceful_shutdown(tiny_model_dir):
    """Once shutdown starts: no new connections; a request that ends within --shutdown-timeout
    ends normally; the rest get an error (an error event then [DONE], or a 503); every block is
    back; the server stops."""
    srv = _slow_server(tiny_model_dir, shutdown_timeout=1.0)
    body = {"model": srv.model, "prompt": PROMPT, "ignore_eos": True}
    whole: dict = {}

    def post_long():
        whole["r"] = httpx.post(f"{srv.url}/v1/completions", json={**body, "max_tokens": 900}, timeout=60)

    try:
        with httpx.Client(base_url=srv.url, timeout=60) as a, httpx.Client(base_url=srv.url, timeout=60) as b:
            with a.stream("POST", "/v1/completions", json={**body, "max_tokens": 15, "stream": True}) as short, \
                    b.stream("POST", "/v1/completions", json={**body, "max_tokens": 900, "stream": True}) as long:
                short_lines, long_lines = short.iter_lines(), long.iter_lines()
                next(l for l in short_lines if l.startswith("data: {"))
                next(l for l in long_lines if l.startswith("data: {"))
                poster = threading.Thread(target=post_long)
                poster.start()
                time.sleep(0.2)
                srv.server.should_exit = True  # what SIGTERM does
                time.sleep(0.3)
                with pytest.raises(httpx.ConnectError):
                    httpx.post(f"{srv.url}/v1/completions", json={**body, "max_tokens": 1}, timeout=5)
                short_events = [l[6:] for l in short_lines if l.startswith("data: ")]
                long_events = [l[6:] for l in long_lines if l.startswith("data: ")]
        assert short_events[-1] == "[DONE]"
        assert json.loads(short_events[-2])["choices"][0]["finish_reason"] == "length"
        assert long_events[-1] == "[DONE]"
        error = json.loads(long_events[-2])["error"]
        assert error["code"] == "server_shutting_down" and "--shutdown-timeout" in error["message"]
        poster.join(30)
        assert whole["r"].status_code == 503
        assert whole["r"].json()["error"]["code"] == "server_shutting_down"
        srv.thread.join(30)
        assert not srv.thread.is_alive(), "the server did not stop"
        assert_pool_clean(srv.engine)
    finally:
        srv.stop()


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_during_start_up_stops_it_and_its_compiler(tiny_model_dir, tmp_path, sig):
    """Ctrl-C or SIGTERM while the C kernels build (a fresh cache): the load runs on the engine's
    thread, which no signal reaches, and start-up went on to its end (73 s with the build),
    or SIGTERM killed the server outright and left the compiler running and a half-built file.
    Now start-up stops within seconds, the compiler with it, and leaves no file behind."""
    import os
    import signal
    import subprocess
    import sys

    from pageserve.runtime.ports import free_port
    from pageserve.runtime.startup import descendants
    from tests.live_server import ROOT

    cache = tmp_path / "cache"
    command = [sys.executable, "-m", "pageserve.app.cli", "serve", str(tiny_model_dir), "--dtype", "float32",
               "--port", str(free_port())]
    log = tmp_path / "server.log"
    # started as from a terminal: an xdist worker ignores SIGINT, and a child inherits that (its
    # Python then installs no handler: the signal did nothing, as for a shell's background job)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with open(log, "wb") as err:
            proc = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PAGESERVE_CACHE": str(cache)},
                                    stdout=subprocess.DEVNULL, stderr=err)
    finally:
        signal.signal(signal.SIGINT, inherited)
    try:
        deadline, compiler = time.monotonic() + 90, []
        while not compiler and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
            under = descendants(proc.pid)  # the kernels' build: not a compile another library may run first
            compiler = [p for p in under if _comm(p) in ("cc", "gcc", "cc1", "clang") and _builds_kernels(p)]
        if not compiler:
            pytest.skip("no C compiler ran (none on this machine?)")
        proc.send_signal(getattr(signal, sig))
        started = time.monotonic()
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            status = [line.strip() for line in open(f"/proc/{proc.pid}/status") if line.startswith("Sig")]
            mine = [line.strip() for line in open("/proc/self/status") if line.startswith("Sig")]
            code = f"still running ({status}; this process: {mine}); its log: {log.read_text()[-3000:]}"
        assert code == 130
        assert time.monotonic() - started < 20
        time.sleep(1)
        assert not [p for p in under if _alive(p)], [(p, _comm(p)) for p in under if _alive(p)]
        assert not list((cache / "kernels").glob("tmp*"))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _builds_kernels(pid: int) -> bool:
    try:
        return b"cpu_linear" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _comm(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        return ""
