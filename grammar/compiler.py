"""Compiling grammars: a structured-output request -> regex -> outlines-core Index.

The regex is built on the caller's thread (fast, and where a bad schema must fail: the HTTP
handler turns that into a 400). The Index, the slow part (a DFA over the whole vocabulary;
from milliseconds to seconds), is compiled off the event loop and the engine thread, in child
processes with time and memory limits (grammar/worker.py), two at once in turn across API keys,
within one time limit from the request's arrival (the wait for a child counts), and kept in an
LRU cache, so the same schema is compiled once; one that failed is not tried again. A request
whose grammar is still compiling waits in the scheduler without holding up the others."""

from __future__ import annotations

import itertools
import logging
import re
import threading
import time
from collections import Counter, OrderedDict, deque
from concurrent.futures import Future

from pageserve.grammar.json_schema import UnsupportedSchema, ascii_digits, check_pattern, schema_to_regex
from pageserve.grammar.regexes import choice_regex, json_object_regex
from pageserve.grammar.worker import (CompiledGrammar, CompileError, CompilerLost, CompilerStopped, CompileTimeout,
                                      CompileWorker)
from pageserve.sampling.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

DISPATCHER_IDLE = 30.0  # seconds the dispatcher thread waits with nothing to do before it ends


def regex_for(spec: StructuredOutputsParams) -> str:
    """The regex a structured-output request must match. ValueError naming what is wrong."""
    if spec.json is not None:
        return schema_to_regex(spec.json)
    if spec.regex is not None:
        return _user_regex(spec.regex)
    if spec.choice is not None:
        return choice_regex(spec.choice)
    if spec.json_object:
        return json_object_regex()
    raise UnsupportedSchema("structured_outputs needs one of json, regex, choice or json_object")


class CompilerBusy(RuntimeError):
    """A grammar's time limit ran out while other grammars held the compiler: nothing is known
    against the grammar, and the request may be sent again (a 503)."""

    def __init__(self, waited: float, what: str):
        super().__init__(f"the grammar compiler is busy with other grammars: this one waited {waited:.1f} s "
                         f"{what}; send the request again")


class _LRU(OrderedDict):
    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def get_fresh(self, key):
        value = self.get(key)
        if value is not None:
            self.move_to_end(key)
        return value

    def put(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)


class GrammarCompiler:
    def __init__(self, tokenizer, cache_size: int = 64, timeout: float = 60.0,
                 memory_bytes: int = 4 << 30, workers: int = 2, spares: int = 2, patience: float = 2.0):
        """`workers`: compiles that run at once, each in its own child process, so one grammar
        that takes up to `timeout` to compile does not hold up every other request's. `timeout`
        counts from the grammar's first request: one that waits for a child gets what is left
        of it to compile in, and fails with CompilerBusy when that runs out. Waiting
        compiles are taken in turn across owners (API keys), the owner with the fewest running
        first. An owner with none running that finds every child held by compiles older than
        `patience` seconds gets one of `spares` more children: while one is free, one key's slow
        grammars hold up another key's for `patience` at most."""
        self.tokenizer = tokenizer
        self.timeout, self.memory_bytes = timeout, memory_bytes
        self.workers, self.spares, self.patience = workers, spares, patience
        # the wait for a child counts against the limit: a server's requests; not an offline
        # batch's, which waits for all of its grammars anyway (LLM turns it off)
        self.wait_counts = True
        self._vocabulary: tuple | None = None  # (eos, tokens), read on the first compile
        self._vocabulary_lock = threading.Lock()
        self._idle: list[CompileWorker] = []
        self._workers: list[CompileWorker] = []  # every child running, for shutdown
        self.vocab_len = 0
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # the dispatcher's: a compile came or ended
        self._regexes = _LRU(256)  # spec key -> regex
        self._indexes = _LRU(cache_size)  # regex -> CompiledGrammar
        self._failed = _LRU(256)  # regex -> the error it gave (not compiled again)
        self._inflight: dict[str, Future] = {}  # regex waiting or compiling -> its future
        self._waiting: dict[str, deque[str]] = {}  # owner -> its regexes to compile
        self._running: dict[str, float] = {}  # regex compiling -> when it started
        self._queued: dict[str, float] = {}  # regex waiting for a child -> when its first request came
        self._owners_running: Counter[str] = Counter()
        self._served: dict[str, int] = {}  # owner -> its last turn (owners are API keys: a few)
        self._turns = itertools.count()
        self._dispatcher: threading.Thread | None = None
        self._closed = False

    def regex(self, spec: StructuredOutputsParams) -> str:
        key = spec.cache_key()
        with self._lock:
            cached = self._regexes.get_fresh(key)
        if cached is None:
            cached = regex_for(spec)
            with self._lock:
                self._regexes.put(key, cached)
        return cached

    def submit(self, regex: str, owner: str = "") -> Future:
        """The compiled grammar for `regex`: done at once when cached (or known to fail), else
        compiled in a child process in `owner`'s turn."""
        with self._lock:
            index = self._indexes.get_fresh(regex)
            failed = self._failed.get_fresh(regex)
            if self._closed and index is None:
                failed = "the server is shutting down"
            if index is not None or failed is not None:
                done: Future = Future()
                if index is not None:
                    done.set_result(index)
                else:
                    done.set_exception(UnsupportedSchema(failed))
                return done
            future = self._inflight.get(regex)
            if future is None:
                future = self._inflight[regex] = Future()
                self._queued[regex] = time.monotonic()
            if regex not in self._running and regex not in self._waiting.get(owner, ()):
                # waiting in another owner's queue too: it starts in whichever turn comes first
                self._waiting.setdefault(owner, deque()).append(regex)
                if self._dispatcher is None:
                    dispatcher = threading.Thread(target=self._dispatch, name="grammar-dispatch", daemon=True)
                    try:
                        dispatcher.start()
                    except RuntimeError as e:  # no thread could start (the process's limit)
                        self._waiting[owner].pop()
                        if not self._waiting[owner]:
                            del self._waiting[owner]
                        if not any(regex in queue for queue in self._waiting.values()):
                            self._inflight.pop(regex)
                            self._queued.pop(regex)
                        failed: Future = Future()
                        failed.set_exception(UnsupportedSchema(f"the grammar compiler is busy: {e}"))
                        return failed
                    self._dispatcher = dispatcher
                self._wake.notify()
            return future

    def _dispatch(self) -> None:
        """Start each waiting compile, in its own thread, when _next_owner says whose is next;
        end after a while with nothing to do (a compiler no one shuts down is not kept alive)."""
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                expiry = self._expire(now) if self.wait_counts else None
                owner, wait = self._next_owner(now)
                if owner is None:
                    if expiry is not None:
                        wait = expiry if wait is None else min(wait, expiry)
                    if not self._wake.wait(wait if wait is not None else DISPATCHER_IDLE) and wait is None \
                            and not self._waiting and not self._running:
                        self._dispatcher = None
                        return
                    continue
                waiting = self._waiting[owner]
                regex = waiting.popleft()
                if not waiting:
                    del self._waiting[owner]
                if regex in self._running or regex not in self._inflight:  # started in another owner's turn
                    continue
                self._running[regex] = now
                self._owners_running[owner] += 1
                self._served[owner] = next(self._turns)
                queued = self._queued.pop(regex)
                waited = now - queued if self.wait_counts else 0.0
                try:
                    threading.Thread(target=self._run, args=(regex, owner, waited), name="grammar",
                                     daemon=True).start()
                except RuntimeError as e:  # no thread could start (the process's limit): this compile fails
                    self._done(regex, owner)
                    self._inflight.pop(regex).set_exception(UnsupportedSchema(f"the grammar compiler is busy: {e}"))

    def _expire(self, now: float) -> float | None:
        """Fail the waiting compiles whose time limit has run out (all but the slack, too little
        to compile in). Returns the seconds until the next one's does (None: none waits). Called
        under the lock."""
        first = None
        for regex, since in list(self._queued.items()):
            left = since + self.timeout - self._slack() - now
            if left > 0:
                first = left if first is None else min(first, left)
                continue
            del self._queued[regex]
            for owner, queue in list(self._waiting.items()):
                if regex in queue:
                    queue.remove(regex)
                    if not queue:
                        del self._waiting[owner]
            self._inflight.pop(regex).set_exception(CompilerBusy(now - since, f"(the limit is {self.timeout:g} s)"))
        return first

    def _next_owner(self, now: float) -> tuple[str | None, float | None]:
        """(whose compile starts now, None) or (None, seconds until one may: None for when
        a compile comes or ends). Called under the lock."""
        if not self._waiting:
            return None, None
        turn = min(self._waiting, key=lambda o: (self._owners_running[o], self._served.get(o, -1)))
        if len(self._running) < self.workers:
            return turn, None
        if self._owners_running[turn] or len(self._running) >= self.workers + self.spares:
            return None, None
        wait = max(self._running.values()) + self.patience - now  # from the youngest compile's start
        return (turn, None) if wait <= 0 else (None, wait)

    def _run(self, regex: str, owner: str, waited: float) -> None:
        with self._lock:
            future = self._inflight[regex]
        try:
            future.set_result(self._compile(regex, waited))
        except BaseException as e:  # noqa: BLE001 - the future carries it to the requests waiting
            future.set_exception(e)
        finally:
            with self._lock:
                self._done(regex, owner)
                self._inflight.pop(regex, None)
                self._wake.notify()

    def _done(self, regex: str, owner: str) -> None:
        """A compile is no longer running (under the lock)."""
        del self._running[regex]
        self._owners_running[owner] -= 1
        if not self._owners_running[owner]:
            del self._owners_running[owner]

    def _compile(self, regex: str, waited: float = 0.0) -> CompiledGrammar:
        """Compile in a child, in what is left of the time limit after `waited` seconds."""
        if waited < self._slack():  # the whole limit, near enough
            waited = 0.0
        worker = self._take_worker()
        t0 = time.perf_counter()
        try:
            index = worker.compile(regex, self.timeout - waited)
        except CompilerStopped as e:  # shutdown: nothing wrong with the grammar
            logger.info("%s", e)
            raise UnsupportedSchema(str(e)) from None
        except CompileTimeout as e:
            if not waited:
                raise self._failure(regex, e) from None
            logger.warning("a grammar did not compile in the %.1f s left after waiting %.1f s for the "
                           "compiler", self.timeout - waited, waited)
            raise CompilerBusy(waited, f"and did not compile in the {self.timeout - waited:.1f} s left of the "
                                       f"{self.timeout:g} s limit") from None
        except CompileError as e:
            raise self._failure(regex, e) from None
        finally:
            self._give_back(worker)
        seconds = time.perf_counter() - t0
        logger.info("compiled a grammar in %.2f s (%d regex chars)", seconds, len(regex))
        with self._lock:
            self._indexes.put(regex, index)
        return index

    def _slack(self) -> float:
        """Seconds of a grammar's limit that count for nothing: its compile does not start later
        than this before its limit, and a wait this short is not counted against it."""
        return min(1.0, self.timeout / 10)

    def _failure(self, regex: str, e: CompileError) -> UnsupportedSchema:
        logger.warning("a grammar failed to compile: %s", e)
        if not isinstance(e, CompilerLost):  # the grammar's own doing: not compiled again
            with self._lock:
                self._failed.put(regex, str(e))
        return UnsupportedSchema(str(e))

    def _take_worker(self) -> CompileWorker:
        """An idle child, or a new one (no more are made than compiles run at once)."""
        with self._lock:
            if self._closed:
                raise UnsupportedSchema("the server is shutting down")
            if self._idle:
                return self._idle.pop()
        with self._vocabulary_lock:  # read once, without holding up submit()
            if self._vocabulary is None:
                from pageserve.grammar.vocabulary import vocabulary_tokens

                eos, tokens, self.vocab_len = vocabulary_tokens(self.tokenizer)
                self._vocabulary = eos, tokens
        worker = CompileWorker(*self._vocabulary, self.timeout, self.memory_bytes)
        with self._lock:
            self._workers.append(worker)
            if self._closed:  # shutdown() came meanwhile and did not see it
                worker.close()
        return worker

    def _give_back(self, worker: CompileWorker) -> None:
        """Keep `workers` idle children; a spare's is ended."""
        with self._lock:
            spare = len(self._idle) >= self.workers or self._closed
            if spare:
                self._workers.remove(worker)
            else:
                self._idle.append(worker)
        if spare:
            worker.close()

    def shutdown(self) -> None:
        """Stop compiling: waiting compiles fail, the children are ended."""
        with self._lock:
            self._closed = True
            self._wake.notify()
            # a regex may wait in several owners' queues, or be one that runs already
            waiting = {r for queue in self._waiting.values() for r in queue if r not in self._running}
            dropped = [f for f in (self._inflight.pop(r, None) for r in waiting) if f is not None]
            self._waiting.clear()
            self._queued.clear()
            workers = list(self._workers)
        for future in dropped:
            future.set_exception(UnsupportedSchema("the server is shutting down"))
        for worker in workers:
            worker.close()


_ANCHORS = re.compile(r"^(?:\^|\\A)|(?<!\\)(?:\$|\\z)$")


def _user_regex(regex) -> str:
    """A client's regex, checked: it is matched against the whole output anyway, so ^ and $ at
    its ends are dropped; look-around, back-references and word boundaries cannot be enforced;
    one that matches the empty string is refused (its automaton cannot be anchored)."""
    if not isinstance(regex, str) or not regex:
        raise UnsupportedSchema("regex must be a non-empty string")
    regex = _ANCHORS.sub("", regex)
    check_pattern(regex, "the regex")
    if re.fullmatch(regex, ""):
        raise UnsupportedSchema(f"the regex {regex[:100]!r} matches the empty string; make the output "
                                f"at least one character long")
    return ascii_digits(regex)

