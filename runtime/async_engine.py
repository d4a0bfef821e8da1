"""The engine inside an asyncio server: one task runs one engine step per tick.

The model forward runs in a worker thread, so the event loop keeps accepting connections and
writing streams meanwhile. New requests and aborts are handed to the engine only between
steps, on the loop thread, so the engine is never touched by two threads at once. Each HTTP
request's outputs go to its own RequestStream (runtime/request_stream.py), which only its
handler reads."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from pageserve.runtime.engine import LLMEngine, RequestFailedError, StepFailed
from pageserve.runtime.engine_args import EngineArgs
from pageserve.runtime.input_processor import InvalidRequest, ProcessedRequest
from pageserve.runtime.lora.request import LoRARequest
from pageserve.runtime.multimodal import HeldImages, ImagesHeldError  # noqa: F401 - the app maps it to a 503
from pageserve.runtime.outputs import RequestOutput
from pageserve.runtime import startup
from pageserve.runtime.pooling import PoolerConfig
from pageserve.runtime.request_stream import RequestStream
from pageserve.runtime.stats import EngineStats
from pageserve.sampling.params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

_MAX_FAILED_STEPS = 3  # failed steps in a row before the engine counts as dead


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error; no request can be served any more."""


class RequestTimeoutError(RuntimeError):
    """The request ran past --request-timeout and was aborted."""


class ShuttingDownError(RuntimeError):
    """The server is shutting down: no new requests, and those past --shutdown-timeout end."""


class QueueFullError(RuntimeError):
    """More requests are waiting than --max-num-queued-reqs allows."""


@dataclass(slots=True)
class _PendingRequest:
    request_id: str
    request: ProcessedRequest
    arrival_time: float = field(default_factory=time.monotonic)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_num_queued_reqs: int = 1024,
                 executor: ThreadPoolExecutor | None = None, log_stats_interval: float = 5.0,
                 request_timeout: float | None = None):
        self.engine = engine
        self.held_images = HeldImages()  # the processor tensors of the requests in flight
        self.request_timeout = request_timeout
        self._deadlines: dict[str, float] = {}  # request id -> monotonic time it must end by
        # called on the loop thread with each request's finished output, and with aborted ids
        self.on_finished: list[Callable[[RequestOutput], None]] = []
        self.on_abort: list[Callable[[str], None]] = []
        self.on_dead: list[Callable[[], None]] = []  # called once if the engine loop stops on an error
        self._failed_steps = 0  # in a row
        self.log_stats_interval = log_stats_interval
        self._last_log = (time.monotonic(), 0, 0)  # time, prompt tokens, generation tokens
        self.max_num_queued_reqs = max_num_queued_reqs
        self._streams: dict[str, RequestStream] = {}
        self._pending: dict[str, _PendingRequest] = {}
        self._aborts: set[str] = set()
        self._wake: asyncio.Event | None = None
        self._executor = executor or ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._task: asyncio.Task | None = None
        self._closed = False
        self._draining = False
        self._idle: asyncio.Event | None = None  # set whenever no request is in the engine's hands
        self._hurry: asyncio.Event | None = None
        self.error: BaseException | None = None

    @classmethod
    def build(cls, engine_args: EngineArgs, max_num_queued_reqs: int = 1024,
              log_stats_interval: float = 5.0, request_timeout: float | None = None) -> "AsyncEngine":
        """Load the model and run every later step on one and the same thread. On CPU this
        matters: each thread that runs torch ops gets its own OpenMP team, and once the process
        has more OpenMP threads than cores, libgomp stops spin-waiting between parallel regions
        (it halved throughput: docs/performance.md, the engine thread)."""
        executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        startup.reset()
        try:
            engine = startup.result(executor.submit(LLMEngine.from_engine_args, engine_args))
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(engine, max_num_queued_reqs, executor, log_stats_interval, request_timeout)

    # ---- lifecycle ----

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._hurry = asyncio.Event()  # drain() stops waiting for the requests in flight
        self._task = asyncio.create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        if self._closed:  # stopped already (a forced exit stops it beside the lifespan's shutdown)
            return
        if self._draining and self.is_running:  # let the loop free what drain() aborted
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), 5.0)
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self.close()

    def close(self) -> None:
        """Release the engine's thread, grammar compilers and workers: after stop(), or for an
        engine that never started serving (start-up cut short)."""
        self._closed = True
        self._executor.shutdown(wait=True)  # no step runs after this: the workers can be told to stop
        self.engine.grammar.shutdown()
        self.engine.shutdown()

    async def drain(self, timeout: float) -> int:
        """Graceful shutdown: refuse new requests from now on, let those in flight finish for up
        to `timeout` seconds, then end the rest with a ShuttingDownError. Returns how many were
        ended that way."""
        self._draining = True
        if self._idle is None or self.error is not None:
            return 0
        waits = [asyncio.ensure_future(self._idle.wait()), asyncio.ensure_future(self._hurry.wait())]
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        if self._idle.is_set():
            return 0
        streams = dict(self._streams)
        why = "at once (a second interrupt)" if self._hurry.is_set() else f"after {timeout:g} s (--shutdown-timeout)"
        logger.warning("shutdown: %d request(s) still running are stopped %s", len(streams), why)
        error = ShuttingDownError(f"the server is shutting down and stopped this request {why}")
        for rid in streams:
            self.abort(rid)
        for stream in set(streams.values()):
            stream.put(error)
        return len(streams)

    def hurry(self) -> None:
        """A drain under way (or one to come) ends the requests in flight now (on the loop's thread)."""
        if self._hurry is not None:
            self._hurry.set()

    @property
    def is_running(self) -> bool:
        return self.error is None and self._task is not None and not self._task.done()

    # ---- requests in ----

    @property
    def num_queued(self) -> int:
        """Sequences not yet running: handed in but not admitted by the scheduler (n each of a
        request of n > 1 until it forks)."""
        return sum(p.request.num_sequences for p in self._pending.values()) + self.engine.num_waiting_sequences

    # ---- what the server reads ----

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.engine.config.model.vocab_size

    @property
    def generation_config(self) -> dict:
        """The model's generation_config.json, as read ({} without one)."""
        return self.engine.config.model.hf_config.get("_generation", {})

    @property
    def max_model_len(self) -> int:
        return self.engine.config.model.max_model_len

    def tokenize(self, text: str, add_special_tokens: bool = True, param: str | None = None,
                 keep_last: int | None = None) -> list[int]:
        """Thread-safe; with `param`, a text far too long is refused; with `keep_last`, only its
        last tokens are kept (Engine.tokenize_all)."""
        return self.engine.tokenize(text, add_special_tokens, param, keep_last)

    def tokenize_all(self, texts: list[str], param: str | list[str] | None = None,
                     keep_last: int | None = None) -> list[list[int]]:
        """Thread-safe; as tokenize, for many texts."""
        return self.engine.tokenize_all(texts, param=param, keep_last=keep_last)

    @property
    def pooler(self) -> PoolerConfig:
        """How the model's embeddings are pooled (and whether they are Matryoshka ones)."""
        return self.engine.config.model.pooler

    @property
    def hidden_size(self) -> int:
        return self.engine.config.model.hidden_size

    @property
    def image_placeholder(self) -> str | None:
        """The text a prompt holds for each of its images; None: the model takes text only."""
        images = self.engine.images
        return images.placeholder if images is not None else None

    @property
    def max_images(self) -> int:
        images = self.engine.images
        return images.max_images if images is not None else 0

    def process_images(self, text: str, images: list, param: str = "prompt", add_special_tokens: bool = True,
                       bounded: bool = True) -> tuple[list[int], tuple]:
        """Thread-safe (run it off the event loop): the prompt's token ids with each image's
        tokens in place of its placeholder, and the images for add_request. `bounded`: a text
        far longer than the context is refused first (Engine.tokenize_all)."""
        if bounded:
            self.engine.inputs.check_text_length(
                text, lambda part: len(self.engine.tokenize(part, add_special_tokens)), param)
        ids, items = self.engine.images.process(text, images, add_special_tokens, param)
        self.held_images.take(items, param)  # ImagesHeldError (a 503) past what requests may hold
        return ids, items

    def stats(self) -> EngineStats:
        """The engine's figures; requests handed in but not yet in the engine count as waiting."""
        s = self.engine.stats()
        return replace(s, scheduler=replace(s.scheduler, num_waiting=self.num_queued))

    def compile_grammar(self, regex: str) -> Future:
        """Compile a grammar ahead of the first request that needs it (in the grammar worker)."""
        return self.engine.grammar.submit(regex)

    def check_accepting(self, num_requests: int, param: str, n: int = 1) -> None:
        """Whether `num_requests` more, of `n` sequences each, would be taken now (InvalidRequest,
        QueueFullError, ShuttingDownError or EngineDeadError if not). The queue counts sequences,
        as vLLM's does once it has split n > 1 into its requests."""
        if self.error is not None:
            raise EngineDeadError(f"the engine has stopped: {self.error!r}")
        if self._closed or self._draining:
            raise ShuttingDownError("the server is shutting down and takes no new requests")
        wanted = num_requests * n
        if wanted > self.max_num_queued_reqs:  # never fits: a retry cannot help
            asked = f"{num_requests} prompts" if n == 1 else f"{wanted} sequences ({num_requests} prompts x n = {n})"
            raise InvalidRequest(f"the request has {asked} and the server queues at most "
                                 f"{self.max_num_queued_reqs} (--max-num-queued-reqs): send fewer at once",
                                 param if num_requests > self.max_num_queued_reqs else "n")
        if (queued := self.num_queued) + wanted > self.max_num_queued_reqs:
            raise QueueFullError(f"the server has {queued} sequences waiting and its limit "
                                 f"is {self.max_num_queued_reqs} (--max-num-queued-reqs); retry later")

    def new_stream(self, num_requests: int = 1, param: str = "prompt", n: int = 1) -> RequestStream:
        """A stream for `num_requests` engine requests of `n` sequences each, refused when they
        would not fit in the queue (InvalidRequest naming `param`, the prompts, when they never would)."""
        self.check_accepting(num_requests, param, n)
        return RequestStream(self)

    def add_request(self, stream: RequestStream, request_id: str, prompt: str | list[int],
                    params: SamplingParams, cache_salt: str | None = None, param: str = "prompt",
                    images: tuple = (), lora: LoRARequest | None = None, priority: int = 0) -> None:
        """Check the request now, once (check_request), and queue it for the next step; its
        outputs go to `stream`. `lora`: an adapter add_lora has read."""
        self.add_checked(stream, request_id, self.check_request(prompt, params, cache_salt, param, images, priority),
                         lora)

    def check_request(self, prompt: str | list[int], params: SamplingParams, cache_salt: str | None = None,
                      param: str = "prompt", images: tuple = (), priority: int = 0) -> ProcessedRequest:
        """The request checked, once (InvalidRequest naming the field at fault, `param` for the
        prompt). `images`: what process_images made of the prompt's images. Thread-safe, so that
        a request of many token ids is checked off the event loop."""
        return self.engine.inputs.process(prompt, params, cache_salt, param, strict_max_tokens=True,
                                          mm_items=images, priority=priority)

    def check_embedding_request(self, prompt: str | list[int], param: str = "input") -> ProcessedRequest:
        """As check_request, for an embedding's prompt."""
        return self.engine.inputs.process_embedding(prompt, param)

    def add_checked(self, stream: RequestStream, request_id: str, checked: ProcessedRequest,
                    lora: LoRARequest | None = None, owner: str = "") -> None:
        """Queue a request that check_request (or check_embedding_request) passed. `owner`: who
        sent it (an API key's tag), for whose turn its grammar compiles in."""
        deltas = checked.params is not None and checked.params.output_kind == RequestOutputKind.DELTA
        self._enqueue(stream, _PendingRequest(request_id, replace(checked, lora=lora, owner=owner)), deltas=deltas)

    @property
    def lora_enabled(self) -> bool:
        return self.engine.config.lora is not None

    def add_lora(self, lora: LoRARequest) -> Future:
        """Read an adapter into host memory on the engine's thread, between two steps (torch
        ops on another thread would start another OpenMP team; the ranks' pipes take one
        caller). The future raises LoRAError if it cannot be served."""
        return self._executor.submit(self.engine.add_lora, lora)

    def remove_lora(self, lora_int_id: int) -> Future:
        return self._executor.submit(self.engine.remove_lora, lora_int_id)

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        """InvalidRequest when an id is outside the vocabulary."""
        self.engine.inputs.check_token_ids(token_ids, param)

    def _enqueue(self, stream: RequestStream, pending: _PendingRequest, deltas: bool = False) -> None:
        rid = pending.request_id
        if rid in self._streams or rid in self.engine.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        self._streams[rid] = stream
        stream.expect(rid, deltas)
        self._pending[rid] = pending
        self._idle.clear()
        if self.request_timeout is not None:
            self._deadlines[rid] = pending.arrival_time + self.request_timeout
        self._wake.set()

    def abort(self, request_id: str, stream: RequestStream | None = None) -> None:
        """Takes effect before the next step: the request's blocks are free after it. With
        `stream`, only if the id still belongs to that stream."""
        if stream is not None and self._streams.get(request_id) is not stream:
            return  # finished already (or the id is another stream's now)
        self._streams.pop(request_id, None)
        self._deadlines.pop(request_id, None)
        for callback in self.on_abort:
            callback(request_id)
        if self._pending.pop(request_id, None) is None:
            self._aborts.add(request_id)
            self._wake.set()

    # ---- the loop ----

    def _hand_over(self) -> None:
        """Between steps, on the loop thread: apply aborts, then add new requests."""
        engine = self.engine
        if self._deadlines:
            self._expire(time.monotonic())
        for rid in self._aborts:
            engine.abort_request(rid)
        self._aborts.clear()
        pending, self._pending = self._pending, {}
        for rid, p in pending.items():
            try:
                engine.add_processed(p.request, rid, p.arrival_time)
            except ValueError as e:  # an id taken meanwhile: the content was checked on the way in
                stream = self._streams.pop(rid, None)
                if stream is not None:
                    stream.put(e)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._hand_over()
                if not self.engine.has_unfinished_requests():
                    if not self._streams and not self._pending:
                        self._idle.set()
                    self._wake.clear()
                    if not self._pending and not self._aborts:
                        await self._wake.wait()
                    continue
                try:
                    outputs = await loop.run_in_executor(self._executor, self.engine.step)
                except StepFailed as e:
                    self._fail_requests(e)
                    continue
                self._failed_steps = 0
                for rid, error in self.engine.take_failures():
                    stream = self._streams.pop(rid, None)
                    self._deadlines.pop(rid, None)
                    if stream is not None:
                        stream.put(error)
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is None:
                        continue  # aborted while the step ran
                    stream.put(out)
                    if out.finished:
                        del self._streams[out.request_id]
                        self._deadlines.pop(out.request_id, None)
                        for callback in self.on_finished:
                            try:
                                callback(out)
                            except Exception:  # noqa: BLE001 - metrics must never stop the engine
                                logger.exception("an output callback failed")
                self._log_stats()
        except asyncio.CancelledError:
            self._fail_all(EngineDeadError("the server is shutting down"))
            raise
        except BaseException as e:
            logger.exception("the engine loop stopped on an error")
            self.error = e
            self._fail_all(EngineDeadError(f"the engine has stopped: {e!r}"))
            for callback in self.on_dead:
                callback()

    def _expire(self, now: float) -> None:
        """Abort the requests past their deadline; their streams get a timeout error."""
        for rid in [r for r, deadline in self._deadlines.items() if deadline <= now]:
            stream = self._streams.get(rid)
            self.abort(rid)
            if stream is not None:
                stream.put(RequestTimeoutError(
                    f"the request ran longer than the server's limit of {self.request_timeout:g} s "
                    f"(--request-timeout) and was stopped"))

    def _fail_requests(self, failure: StepFailed) -> None:
        """One failed step fails only its own requests; several in a row mean the engine is
        broken, and the loop stops."""
        self._failed_steps += 1
        logger.error("an engine step failed (%r); %d request(s) get an error", failure.cause,
                     len(failure.request_ids))
        for rid in failure.request_ids:
            stream = self._streams.pop(rid, None)
            self._deadlines.pop(rid, None)  # ended: no later timeout for it
            if stream is not None:
                stream.put(RequestFailedError(f"the engine failed while running this request: "
                                              f"{failure.cause!r}"))
        if self._failed_steps >= _MAX_FAILED_STEPS:
            raise failure.cause

    def _log_stats(self) -> None:
        """Every few seconds of activity, one line of engine status, as vLLM prints it."""
        now = time.monotonic()
        last, last_prompt, last_gen = self._last_log
        if now - last < self.log_stats_interval:
            return
        s = self.engine.stats()
        elapsed = now - last
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Swapped: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%", (s.prompt_tokens - last_prompt) / elapsed,
            (s.generation_tokens - last_gen) / elapsed, s.scheduler.num_running, s.scheduler.num_swapped,
            s.scheduler.num_waiting, s.scheduler.kv_cache_usage * 100, s.prefix_cache_hit_rate * 100)
        if s.spec is not None and s.spec.num_drafts:
            logger.info("Speculative decoding: mean acceptance length %.2f, accepted %d of %d draft tokens",
                        s.spec.mean_acceptance_length, s.spec.num_accepted_tokens, s.spec.num_draft_tokens)
        self._last_log = (now, s.prompt_tokens, s.generation_tokens)

    def _fail_all(self, error: BaseException) -> None:
        for stream in set(self._streams.values()):
            stream.put(error)
        self._streams.clear()
        self._pending.clear()
        self._deadlines.clear()
