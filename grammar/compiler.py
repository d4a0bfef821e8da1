"""Compiling grammars: a structured-output request -> regex -> outlines-core Index.

The regex is built on the caller's thread (fast, and where a bad schema must fail: the HTTP
handler turns that into a 400). The Index, the slow part (a DFA over the whole vocabulary;
from milliseconds to seconds), is compiled in a worker thread (outlines-core releases the
GIL) and kept in an LRU cache, so the same schema is compiled once. A request whose grammar
is still compiling waits in the scheduler without holding up the others."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from outlines_core import Index

from grammar.json_schema import UnsupportedSchema, ascii_digits, schema_to_regex
from grammar.regexes import choice_regex, json_object_regex
from sampling.params import StructuredOutputsParams

logger = logging.getLogger(__name__)


def regex_for(spec: StructuredOutputsParams) -> str:
    """The regex a structured-output request must match. ValueError naming what is wrong."""
    if spec.json is not None:
        return schema_to_regex(spec.json)
    if spec.regex is not None:
        _check_regex(spec.regex)
        return ascii_digits(spec.regex)
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
    def __init__(self, tokenizer, cache_size: int = 64):
        self.tokenizer = tokenizer
        self._vocab = None
        self.vocab_len = 0
        self._lock = threading.Lock()
        self._regexes = _LRU(256)  # spec key -> regex
        self._indexes = _LRU(cache_size)  # regex -> Index
        self._inflight: dict[str, Future] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self.compile_seconds: dict[str, float] = {}  # regex -> how long its Index took (last few)

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
        """The Index for `regex`: done at once when cached, else compiled in the worker."""
        with self._lock:
            index = self._indexes.get_fresh(regex)
            if index is not None:
                done: Future = Future()
                done.set_result(index)
                return done
            future = self._inflight.get(regex)
            if future is None:
                future = self._inflight[regex] = self._pool.submit(self._compile, regex)
            return future

    def _compile(self, regex: str) -> Index:
        try:
            if self._vocab is None:
                from grammar.vocabulary import build_vocabulary

                self._vocab, self.vocab_len = build_vocabulary(self.tokenizer)
            t0 = time.perf_counter()
            try:
                # anchored: without the `$`, outlines-core (0.2.x) builds the automaton so that
                # a state where the regex could end loses the transitions that would go on
                # (`ab(xab)?` would never write the x), which breaks optional tails, repeated
                # tool calls and free text alike
                try:
                    index = Index(f"(?:{regex})$", self._vocab)
                except Exception:  # noqa: BLE001 - a regex that matches "" cannot be anchored
                    index = Index(regex, self._vocab)
            except Exception as e:  # noqa: BLE001 - a regex the automaton library refuses
                raise UnsupportedSchema(f"the grammar cannot be compiled: {str(e).splitlines()[0]}") from None
            seconds = time.perf_counter() - t0
            logger.info("compiled a grammar in %.2f s (%d regex chars)", seconds, len(regex))
            with self._lock:
                self._indexes.put(regex, index)
                self.compile_seconds[regex] = seconds
                if len(self.compile_seconds) > 256:
                    self.compile_seconds.pop(next(iter(self.compile_seconds)))
            return index
        finally:
            with self._lock:
                self._inflight.pop(regex, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _check_regex(regex) -> None:
    if not isinstance(regex, str) or not regex:
        raise UnsupportedSchema("regex must be a non-empty string")
    try:
        re.compile(regex)
    except re.error as e:
        raise UnsupportedSchema(f"the regex {regex[:100]!r} is not valid: {e}") from None

