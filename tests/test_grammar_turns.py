"""Whose grammar compiles next: compiles are taken in turn across owners (API keys), and an
owner with none running gets a spare child when every child is held by a slow compile, so one
key's hostile regexes do not hold up another key's structured output. The time limit counts
from a grammar's first request, the wait for a child included."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from pageserve.grammar import compiler as compiler_module
from pageserve.grammar.compiler import CompilerBusy, GrammarCompiler
from pageserve.grammar.json_schema import UnsupportedSchema
from pageserve.grammar.worker import CompiledGrammar, CompileTimeout

pytestmark = pytest.mark.unit
SLOW = ("[ab]*a[ab]{40}", "[ab]*b[ab]{40}", "[ab]*c[ab]{40}")  # automata that grow exponentially


class _GatedWorker:
    """A child whose compile of a regex ends when the test opens that regex's gate."""
    started: list[str] = []
    gates: dict[str, threading.Event] = {}
    limits: dict[str, float] = {}  # regex -> the time limit its compile was given

    def __init__(self, *args):
        pass

    def compile(self, regex: str, timeout: float) -> CompiledGrammar:
        _GatedWorker.started.append(regex)
        _GatedWorker.limits[regex] = timeout
        if not _GatedWorker.gates.setdefault(regex, threading.Event()).wait(min(timeout, 30)):
            raise CompileTimeout(f"the grammar took longer than {timeout:g} s to compile")
        return CompiledGrammar(None, frozenset())

    def close(self) -> None:
        pass


@pytest.fixture
def gated(monkeypatch):
    monkeypatch.setattr(compiler_module, "CompileWorker", _GatedWorker)
    _GatedWorker.started, _GatedWorker.gates, _GatedWorker.limits = [], {}, {}
    made = []

    def make(**kwargs) -> GrammarCompiler:
        c = GrammarCompiler(None, **kwargs)
        c._vocabulary = (0, {})
        made.append(c)
        return c
    yield make
    for gate in _GatedWorker.gates.values():
        gate.set()
    for c in made:
        c.shutdown()


def _until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _open(regex: str) -> None:
    _GatedWorker.gates.setdefault(regex, threading.Event()).set()


def test_owners_take_turns(gated):
    """One child: the owner served last waits behind one that has not been served."""
    c = gated(workers=1, spares=0)
    futures = [c.submit("a1", "A")]
    _until(lambda: _GatedWorker.started == ["a1"])
    futures += [c.submit("a2", "A"), c.submit("a3", "A"), c.submit("b1", "B"), c.submit("b2", "B")]
    for regex in ("a1", "b1", "a2", "b2", "a3"):
        _open(regex)
    for f in futures:
        assert f.result(timeout=10) is not None
    assert _GatedWorker.started == ["a1", "b1", "a2", "b2", "a3"]


def test_an_owner_with_nothing_running_gets_a_spare_after_the_patience(gated):
    c = gated(workers=1, spares=1, patience=0.2)
    a1 = c.submit("a1", "A")
    _until(lambda: _GatedWorker.started == ["a1"])
    c.submit("a2", "A")
    b1 = c.submit("b1", "B")
    _until(lambda: len(_GatedWorker.started) == 2)
    assert _GatedWorker.started == ["a1", "b1"]  # a2 waits: A has a compile running
    _open("b1")
    assert b1.result(timeout=10) is not None and not a1.done()
    c.submit("c1", "C")  # the spare is free again: C gets it
    _until(lambda: len(_GatedWorker.started) == 3)
    assert _GatedWorker.started[2] == "c1"
    c.submit("d1", "D")  # every child is busy, none spare: D waits for one to end
    time.sleep(0.5)
    assert len(_GatedWorker.started) == 3
    _open("a1")
    _until(lambda: len(_GatedWorker.started) == 4)
    assert _GatedWorker.started[3] == "d1"  # D was never served, A just was


def test_one_owner_gets_no_spare(gated):
    """Without API keys every request is one owner's: its compiles wait for the workers."""
    c = gated(workers=1, spares=1, patience=0.1)
    c.submit("x1")
    c.submit("x2")
    time.sleep(0.5)
    assert _GatedWorker.started == ["x1"]


def test_shutdown_fails_the_compiles_that_wait(gated):
    c = gated(workers=1, spares=0)
    c.submit("a1", "A")
    waiting = c.submit("b1", "B")
    shared = c.submit("s", "A")
    assert c.submit("s", "B") is shared  # queued for both owners
    _until(lambda: _GatedWorker.started == ["a1"])
    c.shutdown()
    for future in (waiting, shared):
        with pytest.raises(UnsupportedSchema, match="shutting down"):
            future.result(timeout=10)
    with pytest.raises(UnsupportedSchema, match="shutting down"):
        c.submit("c1", "C").result(timeout=10)


def test_a_key_s_hostile_regexes_hold_up_no_other_key(tiny_model_dir):
    """Over HTTP, two keys: A's two regexes whose automata never finish hold both compile
    children; B's choice still compiles (on a spare child) and B's request is answered while A's
    compiles run on."""
    from pageserve.runtime.engine_args import EngineArgs
    from tests.live_server import InProcessServer

    s = InProcessServer(EngineArgs(model=str(tiny_model_dir), dtype="float32", kv_cache_memory=0.01,
                                   max_model_len=256), api_keys=("key-a", "key-b"))
    threads: list[threading.Thread] = []
    try:
        grammar = s.engine.grammar
        assert (grammar.workers, grammar.spares) == (2, 2)

        def post(key: str, extra: dict, timeout: float) -> httpx.Response:
            return httpx.post(f"{s.url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                              json={"model": s.model, "prompt": "hi", "max_tokens": 3, **extra}, timeout=timeout)

        outcomes = []

        def hostile(regex: str) -> None:
            try:
                outcomes.append(post("key-a", {"guided_regex": regex}, 120).status_code)
            except httpx.HTTPError:  # the server stopped under it
                outcomes.append("no answer")

        threads += [threading.Thread(target=hostile, args=(r,)) for r in SLOW[:2]]
        for t in threads:
            t.start()
        _until(lambda: len(grammar._running) == 2, 10)
        # B's client gives up before A's compiles would end (60 s): B waits on no child of A's
        r = post("key-b", {"guided_choice": ["yes", "no"]}, 45)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no"), r.text
        assert len(grammar._running) == 2 and not outcomes  # A's compiles run on
    finally:
        s.stop()
    for t in threads:
        t.join(30)



def test_over_http_a_grammar_queued_past_its_limit_is_a_503_and_compiles_when_sent_again(tiny_model_dir):
    """One child, a 3 s limit: a regex whose automaton never finishes holds the child; a simple
    one queued behind it is answered 503 (sent again later) when its 3 s run out, not when the
    slow one's do; the slow one gets its 400 at its own limit; sent again, the simple one is
    served."""
    from pageserve.runtime.engine_args import EngineArgs
    from tests.live_server import InProcessServer

    s = InProcessServer(EngineArgs(model=str(tiny_model_dir), dtype="float32", kv_cache_memory=0.01,
                                   max_model_len=256))
    slow: list[httpx.Response] = []
    try:
        grammar = s.engine.grammar
        grammar.timeout, grammar.workers, grammar.spares = 3.0, 1, 0

        def post(regex: str) -> httpx.Response:
            return httpx.post(f"{s.url}/v1/completions", timeout=30, json={
                "model": s.model, "prompt": "hi", "max_tokens": 3, "structured_outputs": {"regex": regex}})

        holder = threading.Thread(target=lambda: slow.append(post(SLOW[0])))
        holder.start()
        _until(lambda: len(grammar._running) == 1, 10)
        t0 = time.monotonic()
        r = post("[ab]+")
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.json()["error"]["code"] == "server_overloaded" and "busy" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 3.0
        holder.join(30)
        assert slow[0].status_code == 400 and "longer than 3 s" in slow[0].text, slow[0].text
        r = post("[ab]+")
        assert r.status_code == 200 and set(r.json()["choices"][0]["text"]) <= {"a", "b"}, r.text
    finally:
        s.stop()


def test_a_compile_whose_thread_cannot_start_fails_alone(gated, monkeypatch):
    c = gated(workers=1, spares=0)
    _open("warm")
    c.submit("warm").result(timeout=10)  # the dispatcher thread is up
    real_start = compiler_module.threading.Thread.start
    calls = []

    def start(thread):
        calls.append(thread.name)
        if len(calls) == 1:
            raise RuntimeError("can't start new thread")
        real_start(thread)
    monkeypatch.setattr(compiler_module.threading.Thread, "start", start)
    with pytest.raises(UnsupportedSchema, match="busy: can't start new thread"):
        c.submit("a1", "A").result(timeout=10)
    _open("a2")
    assert c.submit("a2", "A").result(timeout=10) is not None  # the dispatcher serves on


def test_a_grammar_another_owner_waits_for_too_starts_in_either_turn(gated):
    """B asks for the grammar A has queued behind its own: B's turn is its own, not the end of
    A's queue."""
    c = gated(workers=1, spares=1, patience=0.2)
    c.submit("a1", "A")
    _until(lambda: _GatedWorker.started == ["a1"])
    c.submit("a2", "A")
    a_shared = c.submit("shared", "A")
    b_shared = c.submit("shared", "B")
    assert b_shared is a_shared
    _until(lambda: len(_GatedWorker.started) == 2)
    assert _GatedWorker.started == ["a1", "shared"]  # on the spare, in B's turn
    _open("shared")
    assert b_shared.result(timeout=10) is not None
    for regex in ("a1", "a2"):
        _open(regex)
    assert c.submit("a2", "A").result(timeout=10) is not None
    assert _GatedWorker.started == ["a1", "shared", "a2"]  # A's entry for it was passed over


def test_the_dispatcher_thread_ends_when_idle(gated, monkeypatch):
    monkeypatch.setattr(compiler_module, "DISPATCHER_IDLE", 0.1)
    c = gated(workers=1, spares=0)
    _open("x")
    c.submit("x").result(timeout=10)
    _until(lambda: c._dispatcher is None)
    _open("y")
    assert c.submit("y").result(timeout=10) is not None  # a new one starts


def test_a_compile_waiting_for_a_child_fails_busy_within_the_limit(gated):
    """The limit counts from the request: a grammar queued behind a slow one fails with
    CompilerBusy when it runs out, without waiting for the slow one to end, and nothing is held
    against it: sent again with the compiler free, it compiles."""
    c = gated(workers=1, spares=0, timeout=1.0)
    slow = c.submit("slow", "A")
    _until(lambda: _GatedWorker.started == ["slow"])
    t0 = time.monotonic()
    queued = c.submit("quick", "A")
    with pytest.raises(CompilerBusy, match=r"waited 0.9 s \(the limit is 1 s\)"):
        queued.result(timeout=10)
    assert time.monotonic() - t0 < 1.0 and not slow.done()
    assert _GatedWorker.started == ["slow"] and not c._waiting and not c._queued
    with pytest.raises(UnsupportedSchema, match="longer than 1 s"):  # its own limit: the grammar's fault
        slow.result(timeout=10)
    assert "slow" in c._failed
    _open("quick")
    assert c.submit("quick", "A").result(timeout=10) is not None
    assert _GatedWorker.limits["quick"] > 0.9  # the whole limit: it did not wait


def test_a_compile_that_waited_gets_what_is_left_and_is_not_blamed_for_running_out(gated):
    c = gated(workers=1, spares=0, timeout=3.0)
    c.submit("first", "A")
    _until(lambda: _GatedWorker.started == ["first"])
    second = c.submit("second", "A")
    time.sleep(1.5)
    _open("first")
    left = r"waited 1.[56] s and did not compile in the 1.[45] s left of the 3 s limit"
    with pytest.raises(CompilerBusy, match=left):  # its gate stays shut: it runs out of what was left
        second.result(timeout=10)
    assert 1.0 < _GatedWorker.limits["second"] < 1.6
    assert "second" not in c._failed  # sent again, it compiles anew
    _open("second")
    assert c.submit("second", "A").result(timeout=10) is not None


def test_a_grammar_two_owners_wait_for_expires_from_both_queues(gated):
    c = gated(workers=1, spares=0, timeout=0.5)
    c.submit("held", "A")
    _until(lambda: _GatedWorker.started == ["held"])
    shared = c.submit("shared", "A")
    assert c.submit("shared", "B") is shared
    with pytest.raises(CompilerBusy):
        shared.result(timeout=10)
    assert not c._waiting and not c._queued and "shared" not in c._inflight


def test_an_offline_batch_s_grammars_wait_without_a_limit(gated, tiny_model_dir):
    """LLM's compiler: a grammar queued past the limit still compiles, with the whole limit."""
    c = gated(workers=1, spares=0, timeout=1.0)
    c.wait_counts = False
    c.submit("first", "A")
    _until(lambda: _GatedWorker.started == ["first"])
    queued = c.submit("second", "A")
    time.sleep(1.5)
    assert not queued.done()
    _open("first")
    _open("second")
    assert queued.result(timeout=10) is not None and _GatedWorker.limits["second"] == 1.0

    from pageserve.runtime import LLM

    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=0.01, swap_space=0)
    assert llm.engine.grammar.wait_counts is False
