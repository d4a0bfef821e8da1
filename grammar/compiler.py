"""Compiling grammars: a structured-output request -> regex -> outlines-core Index.

The regex is built on the caller's thread (fast, and where a bad schema must fail: the HTTP
handler turns that into a 400). The Index, the slow part (a DFA over the whole vocabulary;
from milliseconds to seconds), is compiled off the event loop and the engine thread, in child
processes with time and memory limits (grammar/worker.py), two at once, and kept in an LRU
cache, so the same schema is compiled once; one that failed is not tried again. A request whose
grammar is still compiling waits in the scheduler without holding up the others."""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from pageserve.grammar.json_schema import UnsupportedSchema, ascii_digits, check_pattern, schema_to_regex
from pageserve.grammar.regexes import choice_regex, json_object_regex
from pageserve.grammar.worker import CompiledGrammar, CompileError, CompilerStopped, CompileWorker
from pageserve.sampling.params import StructuredOutputsParams

logger = logging.getLogger(__name__)


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
                 memory_bytes: int = 4 << 30, workers: int = 2):
        """`workers`: compiles that run at once, each in its own child process, so one grammar
        that takes up to `timeout` to compile does not hold up every other request's."""
        self.tokenizer = tokenizer
        self.timeout, self.memory_bytes = timeout, memory_bytes
        self._vocabulary: tuple | None = None  # (eos, tokens), read on the first compile
        self._idle: queue.SimpleQueue[CompileWorker] = queue.SimpleQueue()
        self._workers: list[CompileWorker] = []  # every child started, for shutdown
        self.vocab_len = 0
        self._lock = threading.Lock()
        self._regexes = _LRU(256)  # spec key -> regex
        self._indexes = _LRU(cache_size)  # regex -> CompiledGrammar
        self._failed = _LRU(256)  # regex -> the error it gave (not compiled again)
        self._inflight: dict[str, Future] = {}
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="grammar")
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

    def submit(self, regex: str) -> Future:
        """The compiled grammar for `regex`: done at once when cached (or known to fail), else compiled
        in the worker."""
        with self._lock:
            index = self._indexes.get_fresh(regex)
            failed = self._failed.get_fresh(regex)
            if index is not None or failed is not None:
                done: Future = Future()
                if index is not None:
                    done.set_result(index)
                else:
                    done.set_exception(UnsupportedSchema(failed))
                return done
            future = self._inflight.get(regex)
            if future is None:
                future = self._inflight[regex] = self._pool.submit(self._compile, regex)
            return future

    def _compile(self, regex: str) -> CompiledGrammar:
        try:
            if self._closed:
                raise UnsupportedSchema("the server is shutting down")
            worker = self._take_worker()
            t0 = time.perf_counter()
            try:
                index = worker.compile(regex)
            except CompilerStopped as e:  # shutdown: nothing wrong with the grammar
                logger.info("%s", e)
                raise UnsupportedSchema(str(e)) from None
            except CompileError as e:
                logger.warning("a grammar failed to compile: %s", e)
                with self._lock:
                    self._failed.put(regex, str(e))
                raise UnsupportedSchema(str(e)) from None
            finally:
                self._idle.put(worker)
            seconds = time.perf_counter() - t0
            logger.info("compiled a grammar in %.2f s (%d regex chars)", seconds, len(regex))
            with self._lock:
                self._indexes.put(regex, index)
            return index
        finally:
            with self._lock:
                self._inflight.pop(regex, None)

    def _take_worker(self) -> CompileWorker:
        """An idle child, or a new one (no more are made than the pool has threads)."""
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if self._closed:
                raise UnsupportedSchema("the server is shutting down")
            if self._vocabulary is None:
                from pageserve.grammar.vocabulary import vocabulary_tokens

                eos, tokens, self.vocab_len = vocabulary_tokens(self.tokenizer)
                self._vocabulary = eos, tokens
            worker = CompileWorker(*self._vocabulary, self.timeout, self.memory_bytes)
            self._workers.append(worker)
        return worker

    def shutdown(self) -> None:
        """Stop compiling: queued compiles are dropped, the child process is ended."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            workers = list(self._workers)
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

