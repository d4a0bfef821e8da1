"""The engine step loop: schedule, run the model, append sampled tokens, check stops, free."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time

from tokenizers import Tokenizer

from pageserve.grammar.compiler import GrammarCompiler
from pageserve.grammar.vocabulary import backend_tokenizer
from pageserve.runtime import startup
from pageserve.runtime.config import EngineConfig, SchedulingPolicy
from pageserve.runtime.detokenizer import IncrementalDetokenizer
from pageserve.runtime.encoder_cache import EncoderCacheManager
from pageserve.runtime import engine_setup, pooling
from pageserve.runtime.engine_args import EngineArgs
from pageserve.runtime.executor import ExecutorDeadError, MultiprocExecutor, UniProcExecutor
from pageserve.runtime.input_processor import InputProcessor, ProcessedRequest
from pageserve.runtime.kv_cache_manager import KVCacheManager
from pageserve.runtime.lora import LoRAError, LoRARequest
from pageserve.runtime.lora.pins import AdapterPins
from pageserve.runtime.models import registry
from pageserve.runtime.model_runner import ModelRunner
from pageserve.runtime.multimodal import MultiModalProcessor
from pageserve.runtime.output_processor import OutputProcessor, detokenize_and_check_stop, no_token_error
from pageserve.runtime.outputs import RequestOutput
from pageserve.runtime.request import LAST_UNFINISHED, Request, RequestStatus
from pageserve.runtime.scheduler import Scheduler
from pageserve.runtime.spec_decode import make_proposer
from pageserve.runtime.stats import EngineStats, IterationCounters
from pageserve.runtime.structured_outputs import StructuredOutputs, advance, check_matcher
from pageserve.runtime.swap_space import SwapSpace
from pageserve.runtime.synthetic_steps import GREEDY_PARAMS, WORST_CASE_MIN_P
from pageserve.sampling.params import RequestOutputKind, SamplingParams
from pageserve.sampling.sampler import NO_TOKEN

logger = logging.getLogger(__name__)

_FINAL_ONLY = RequestOutputKind.FINAL_ONLY  # a module global: the enum's attribute costs 7x the test
_POOLING_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)  # unused: nothing is sampled


LORA_OFF = "adapters are off: start the engine with --enable-lora (enable_lora=True)"


class StepFailed(Exception):
    """The model step raised. The requests it was running were aborted (their KV may be half
    written); the engine itself is intact and goes on with the others."""

    def __init__(self, request_ids: list[str], cause: BaseException):
        super().__init__(f"the engine step failed: {cause!r}")
        self.request_ids = request_ids  # the output ids of the failed requests
        self.cause = cause


class RequestFailedError(RuntimeError):
    """The engine failed while running this request (its step, or handling its output); the
    other requests go on."""


def _plain_copy(tokenizer: Tokenizer) -> Tokenizer:
    """A copy of the Rust tokenizer that neither pads nor truncates (a tokenizer.json may turn
    either on, and transformers sets them on the shared one per call): a text's ids, whole."""
    plain = Tokenizer.from_str(tokenizer.to_str())
    plain.no_padding()
    plain.no_truncation()
    return plain


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer, executor: UniProcExecutor | MultiprocExecutor):
        self.config = config
        self.tokenizer = tokenizer
        self._tokenizer = _plain_copy(backend_tokenizer(tokenizer))
        self.executor = executor
        self.kv = KVCacheManager(config.cache.num_blocks, config.cache.block_size,
                                 config.cache.enable_prefix_caching, config.cache.sliding_window)
        self.images = self._image_processor(config)  # prompts with images (None: the model takes text only)
        mm = config.multimodal if self.images is not None else None
        self.scheduler = Scheduler(config.scheduler, self.kv, SwapSpace(config.cache.num_swap_blocks),
                                   config.cache.preemption_mode,
                                   None if mm is None else EncoderCacheManager(mm.encoder_cache_bytes, mm.whole_images,
                                                                               mm.encoder_step_tokens))
        self.requests: dict[str, Request] = {}
        # steps submitted before the oldest is collected: a pipeline's batches, or under async
        # scheduling the step being prepared beside the one running
        self._depth = 2 if config.scheduler.async_scheduling else config.parallel.batches_in_flight
        self._in_flight: collections.deque = collections.deque()  # (step, executor's handle, submitted at)
        self.outputs = OutputProcessor()
        self.counters = IterationCounters()
        self._ids = itertools.count()
        self.grammar = GrammarCompiler(tokenizer)
        self.inputs = InputProcessor(self.tokenize, config.model.vocab_size, config.model.max_model_len,
                                     config.scheduler.max_num_seqs, self.grammar.regex,
                                     config.scheduler.policy == SchedulingPolicy.PRIORITY,
                                     config.model.pooler.unsupported,
                                     max(map(len, self._tokenizer.get_vocab(with_added_tokens=True)), default=0))
        self.structured = StructuredOutputs(self.grammar)  # requests' grammars and thinking budgets
        self._failures: list[tuple[str, Exception]] = []  # output ids ended by an error
        self._lora_pins = AdapterPins()  # the adapters live requests run under, held in host memory
        self.spec = None if config.speculative is None else make_proposer(config.speculative)
        self._max_model_len = config.model.max_model_len  # read at every token
        self._stream_interval = config.scheduler.stream_interval

    @staticmethod
    def _image_processor(config: EngineConfig) -> MultiModalProcessor | None:
        mm, model = config.multimodal, config.model
        if mm is None:
            return None
        try:
            return MultiModalProcessor(model.path, registry.model_class(model.architecture), model.hf_config,
                                       model.hidden_size, model.dtype, mm.max_images, mm.encoder_cache_bytes,
                                       config.scheduler.max_num_batched_tokens if mm.whole_images else None)
        except (OSError, ValueError, TypeError, KeyError) as e:  # a checkpoint without its processor files
            logger.warning("%s: no image processor in %s (%s: %s); serving text only", model.architecture,
                           model.path, type(e).__name__, e)
            return None

    @property
    def runner(self) -> ModelRunner | None:
        """The model runner in this process (--tensor-parallel-size 1); None above (the ranks'
        runners are in their worker processes)."""
        return self.executor.runner

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        config, tokenizer, executor = engine_setup.build(args)
        try:
            engine = cls(config, tokenizer, executor)
            started = time.perf_counter()
            engine.warm_up()
            logger.info("warm-up: %.1f s (every kernel path of the largest step and of a decode)",
                        time.perf_counter() - started)
        except BaseException:
            executor.shutdown()
            raise
        return engine

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do with one rank)."""
        self.executor.shutdown()

    def warm_up(self) -> None:
        """Run the largest step the scheduler can build (a full token budget spread over the
        most sequences, each sampling), so first-use allocations and activation peaks happen
        before serving, then leave no trace in the cache or the counters. First, every kernel
        variant serving can launch is compiled (on backends that compile), and decode steps
        are captured as CUDA graphs (on CUDA, without --enforce-eager)."""
        sched = self.config.scheduler
        startup.check()
        self.executor.warm_up(sched.max_num_seqs)
        startup.check()
        n = min(sched.max_num_seqs, sched.max_num_batched_tokens)
        length = min(max(1, sched.max_num_batched_tokens // n), self.config.model.max_model_len - 1)
        # then two rows, one with every sampling path and one as a chat front end samples, so
        # that a first request finds nothing left to set up (apart: in the large step, every
        # row would take the full-vocabulary sort)
        ids = []
        for batch in ([GREEDY_PARAMS] * n, [WORST_CASE_MIN_P, SamplingParams(temperature=0.7, top_p=0.9)]):
            for params in batch:
                params = dataclasses.replace(params, max_tokens=2, ignore_eos=True,
                                             output_kind=RequestOutputKind.FINAL_ONLY)
                ids.append(self.add_request([0] * length, params, request_id=f"warmup-{len(ids)}"))
            while self.has_unfinished_requests():
                startup.check()
                self.step()
        assert not any(rid in self.requests for rid in ids)
        self.kv.pool.reset_prefix_cache()
        self.reset_stats()

    def reset_stats(self) -> None:
        """Every counter back to zero."""
        self.scheduler.reset_counters()
        self.kv.reset_counters()
        self.counters = IterationCounters()

    def stats(self) -> EngineStats:
        c = self.counters
        return EngineStats(self.scheduler.stats(), c.steps, c.prompt_tokens, c.generation_tokens,
                           c.kv_waste, dict(c.finished), c.step_seconds, c.encoder_seconds,
                           None if self.spec is None else self.spec.stats.copy())

    # ---- requests in ----

    def tokenize(self, text: str, add_special_tokens: bool = True, param: str | None = None,
                 keep_last: int | None = None) -> list[int]:
        """Thread-safe: the Rust tokenizer is only read."""
        return self.tokenize_all([text], add_special_tokens, param, keep_last)[0]

    def tokenize_all(self, texts: list[str], add_special_tokens: bool = True,
                     param: str | list[str] | None = None, keep_last: int | None = None) -> list[list[int]]:
        """encode_batch lets go of the GIL while it works (encode holds it: 20 MB of text in a
        worker thread held the event loop 20 s). With `param` (the request field they came from,
        or each one's), a text far longer than the context is refused from a part of it.
        `keep_last`: each text's last tokens only (InputProcessor.last_tokens), however long it is."""
        def encode(texts: list[str]) -> list:
            return self._tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        if keep_last is not None:
            fields = [param] * len(texts) if isinstance(param, str) or param is None else param
            return [self.inputs.last_tokens(text, keep_last, lambda t: encode([t])[0].ids, field or "prompt")
                    for text, field in zip(texts, fields)]
        if param is not None:
            fields = [param] * len(texts) if isinstance(param, str) else param
            for text, field in zip(texts, fields):
                self.inputs.check_text_length(text, lambda part: len(encode([part])[0]), field)
        return [e.ids for e in encode(texts)]

    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None, cache_salt: str | None = None,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                    priority: int = 0) -> str:
        processed = dataclasses.replace(self.inputs.process(prompt, params, cache_salt, priority=priority),
                                        lora=lora_request)
        if lora_request is not None:
            self.add_lora(lora_request)
        return self.add_processed(processed, request_id, arrival_time)

    def add_lora(self, lora: LoRARequest) -> None:
        """Read the adapter into host memory (every rank's part), if it is not there (LoRAError
        when it cannot be served). Between steps: the server calls it on the engine's thread."""
        if self.config.lora is None:
            raise LoRAError(LORA_OFF)
        self.executor.add_lora(lora)

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget the adapter (the requests running under it keep it until they end)."""
        if self.config.lora is not None:
            self._lora_pins.release_idle(self.executor)  # their last requests may have ended since the last step
            self.executor.remove_lora(lora_int_id)

    def add_embedding_request(self, prompt: str | list[int], request_id: str | None = None,
                              arrival_time: float | None = None) -> str:
        """A prefill-only request whose output is the mean of its tokens' last hidden states,
        L2-normalized."""
        return self.add_processed(self.inputs.process_embedding(prompt), request_id, arrival_time)

    def add_processed(self, processed: ProcessedRequest, request_id: str | None = None,
                      arrival_time: float | None = None) -> str:
        """Add a request that the input processor has checked (it is not checked again)."""
        p = processed
        pooling = p.params is None
        params = _POOLING_PARAMS if pooling else p.params
        if p.lora is not None and self.config.lora is None:  # read by add_lora before, else in its first step
            raise LoRAError(LORA_OFF)
        req = self._new_request(request_id, p.prompt_token_ids, params, p.max_tokens, p.prompt,
                                p.cache_salt, pooling, arrival_time, p.mm_items)
        req.lora = p.lora
        req.priority = p.priority
        if p.lora is not None:
            self._lora_pins.add(req)
        if pooling:
            self.scheduler.add_request(req)
            return req.request_id
        req.detokenizer = self._detokenizer(req)
        if params.n > 1:
            self.outputs.add_group([req])
        self.structured.add(req, p.grammar, p.owner)
        self.scheduler.add_request(req)
        return req.request_id

    def take_failures(self) -> list[tuple[str, Exception]]:
        """(output id, error) of the requests ended by an error since the last call (a grammar
        that could not be compiled, a fault while handling their output); they produce no
        output of their own."""
        failures, self._failures = self._failures, []
        return failures

    def _detokenizer(self, req: Request) -> IncrementalDetokenizer:
        p = req.sampling_params
        # text asked for only at the end, and no stop string to look for as it grows
        deferred = p.output_kind == RequestOutputKind.FINAL_ONLY and not p.stop
        return IncrementalDetokenizer(self._tokenizer, req.prompt_token_ids, p.stop,
                                      p.include_stop_str_in_output, p.skip_special_tokens, deferred)

    def _new_request(self, request_id, token_ids, params, max_tokens, prompt, cache_salt,
                     pooling: bool = False, arrival_time: float | None = None, mm_items: tuple = ()) -> Request:
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests or request_id in self.outputs.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if "#" in request_id:
            raise ValueError(f"request id {request_id!r}: '#' is kept for the sequences of n > 1")
        req = Request(request_id, token_ids, params, max_tokens, self.config.model.eos_token_ids,
                      prompt, cache_salt, pooling, mm_items)
        if arrival_time is not None:  # when the server took it, not when the engine got it
            req.arrival_time = arrival_time
        self.requests[request_id] = req
        return req

    def abort_request(self, request_id: str) -> None:
        """Abort a request (all its sequences, for n > 1); its blocks are free at once."""
        members = self.outputs.members(request_id) or [self.requests.get(request_id)]
        self.outputs.abort_group(request_id)
        self.structured.waiting.pop(request_id, None)
        aborted = False
        for req in members:
            if req is not None and req.request_id in self.requests and not req.status.finished:
                self._finish(req, RequestStatus.FINISHED_ABORTED)
                aborted = True
        if aborted:
            self.counters.count_finished("abort")

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_waiting_sequences(self) -> int:
        """As num_waiting, a request of n > 1 not yet forked counting n. The server reads it on
        its event loop while a step runs: the queue is copied at once (a C-level copy the step's
        thread cannot interleave with), then counted."""
        return sum(r.num_samples for r in tuple(self.scheduler.waiting))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._in_flight)

    def collect_in_flight(self) -> None:
        """Run the steps still in flight once no request is left (async scheduling and a pipeline
        submit steps ahead: the last may carry only the finished requests' ids)."""
        while self._in_flight and not self.scheduler.has_unfinished():
            self.step()

    def _step_seqs(self) -> int | None:
        """With a pipeline's steps in flight, each takes its share of the requests (None: no
        cap; async scheduling's steps each take every request)."""
        if self._depth == 1 or self.config.scheduler.async_scheduling:
            return None
        s = self.scheduler
        return max(1, -(-(len(s.running) + len(s.waiting) + len(s.swapped)) // self._depth))

    # ---- one step ----

    def step(self) -> list[RequestOutput]:
        """One engine step. Returns an output for each request that has something to report,
        as its `output_kind` asks: every step (cumulative or delta) or only when finished.
        With a pipeline, up to `batches_in_flight` steps are submitted before the oldest one's
        result is collected, each with its own requests; with async scheduling, two, the newer
        one running decodes ahead of the tokens the older one samples (runtime/scheduler.py)."""
        if self.structured.waiting:
            for output_id, error in self.structured.resolve():  # grammars that failed to compile
                self._fail_request(output_id, error)
        if self._lora_pins.pending:
            for output_id, error in self._lora_pins.sync(self.executor):  # adapters that could not be read
                self._fail_request(output_id, RequestFailedError(f"its LoRA adapter cannot be served: {error}"))
        if len(self._in_flight) < self._depth:
            if self.spec is not None:
                self.spec.propose_all(self.scheduler.idle_running(), self.config.model.max_model_len)
            sched = self.scheduler.schedule(self._step_seqs())
            if not (sched.carries_nothing and self._in_flight):  # else nothing to send: on to the oldest step
                started = time.perf_counter()
                try:
                    handle = self.executor.submit(sched)  # also runs the step's swaps and copies
                except ExecutorDeadError:  # the ranks are gone: no step can run again
                    raise
                except Exception as e:
                    raise StepFailed(self._fail_step(sched), e) from e
                self._in_flight.append((sched, handle, started))
                if sched.requests and len(self._in_flight) < self._depth:
                    return []  # the pipeline takes another step before the first one is out
        sched, handle, started = self._in_flight.popleft()
        try:
            result = self.executor.collect(handle)
        except ExecutorDeadError:
            raise
        except Exception as e:
            raise StepFailed(self._fail_step(sched), e) from e
        if sched.is_empty:
            if self.structured.waiting:  # nothing to run but grammars to wait for: no busy loop
                self.structured.wait(0.02)
            return []
        runs = self.spec.accept_all(sched.requests, result.spec_tokens) if self.spec is not None else {}
        scheduled = self.scheduler.update_after_step(
            {rid: len(sr.draft_tokens) + 1 - len(runs[rid]) for sr in sched.requests if (rid := sr.request_id) in runs}
            if runs else None)
        self.counters.step_seconds += time.perf_counter() - started
        for rid, seconds in result.encoder_seconds.items():
            self.counters.encoder_seconds += seconds
            if rid in self.requests:
                self.requests[rid].encoder_seconds += seconds
        outputs: list[RequestOutput] = []
        samples, pools, logprobs = iter(result.sampled), iter(result.pooled), result.logprobs
        for sr, req in zip(sched.requests, scheduled):
            if sr.placeholder and not runs:  # a decode run ahead (async scheduling: most of them)
                tokens, token = None, next(samples)
            elif not sr.sample:
                tokens = runs.get(sr.request_id, [])
            elif sr.num_samples == 1:  # most of them
                tokens = runs.get(sr.request_id) or [next(samples)]
            else:
                tokens = runs.get(sr.request_id) or [next(samples) for _ in range(sr.num_samples)]
            part = next(pools) if sr.pool else None
            # failed earlier in this loop (with its n > 1 siblings), or, run ahead, finished by
            # the step before (its slot was wasted)
            if req.status > LAST_UNFINISHED:
                continue
            try:
                if tokens is None:  # one token past the prompt, nothing else: _update_request's last case
                    out = self._append_token(req, token, logprobs.get(sr.request_id) if logprobs else None)
                    if out is not None:
                        outputs.append(out)
                else:
                    outputs.extend(self._update_request(sr, req, result, tokens, part))
            except ExecutorDeadError:  # a fork's block copy found the ranks gone: the engine's end
                raise
            except Exception as e:  # noqa: BLE001 - one request's fault, not the engine's
                logger.exception("request %s failed after the model step", req.output_id)
                self._fail_request(req.output_id, RequestFailedError(
                    f"the engine failed while handling this request's output: {e!r}"))
        if self._lora_pins.idle:  # adapters whose last request this step finished
            self._lora_pins.release_idle(self.executor)
        self.counters.record_step(self.kv.unused_fraction(self.scheduler.running))
        if self.config.debug_checks:
            self.check_integrity()
        return outputs

    def _update_request(self, sr, req: Request, result, tokens: list[int], part) -> list[RequestOutput]:
        """What one scheduled request's step brought: prompt counts and logprobs, a pooled
        part, or sampled tokens (n of them at an n > 1 request's first sample: it forks)."""
        end = min(sr.start_pos + len(sr.token_ids), req.num_prompt_tokens)
        if end > req.num_prompt_counted:  # a recompute after preemption is not counted again
            self.counters.prompt_tokens += end - max(sr.start_pos, req.num_prompt_counted)
            req.num_prompt_counted = end
        if req.prompt_logprobs is not None and req.request_id in result.prompt_logprobs:
            first, entries = result.prompt_logprobs[req.request_id]
            # after a recompute, positions already recorded come again: keep the first
            req.prompt_logprobs.extend(entries[len(req.prompt_logprobs) - first:])
        if part is not None:
            req.pooled = pooling.combine(req.pooled, part, self.config.model.pooler.pooling_type)
            if req.num_computed_tokens == req.num_tokens:
                self._finish(req, RequestStatus.FINISHED_STOPPED)
                return [self.outputs.embedding_output(req, self.config.model.pooler)]
            return []
        if not tokens:
            return []
        if len(tokens) == 1 and not sr.draft_tokens:  # a decode's token (most of them)
            out = self._append_token(req, tokens[0], result.logprobs.get(req.request_id))
            return [] if out is None else [out]
        outputs = []
        if sr.draft_tokens:  # a speculative run: its tokens in order, until one ends the request
            logprobs = result.spec_logprobs.get(req.request_id)
            for i, token in enumerate(tokens):
                outputs.append(self._append_token(req, token, logprobs[i] if logprobs else None))
                if req.status.finished:
                    break
        else:
            members = [req] + self._fork(req)  # n > 1: the first sample forks the request
            outputs = [self._append_token(member, token, result.logprobs.get(member.request_id))
                       for member, token in zip(members, tokens)
                       if member.status <= LAST_UNFINISHED]  # a sibling's NO_TOKEN fails them all
        return [out for out in outputs if out is not None]

    def _fail_request(self, output_id: str, error: Exception) -> None:
        """End a request (all its sequences) with an error for its owner (see take_failures)."""
        self._failures.append((output_id, error))
        self.abort_request(output_id)

    def _append_token(self, req: Request, token: int, logprobs) -> RequestOutput | None:
        """What the request reports after the token (None: nothing yet). logprobs: the
        token's TokenLogprobs where the request asked for them."""
        if token == NO_TOKEN:
            self._fail_request(req.output_id, no_token_error(req))
            return None
        req.token_ids.append(token)
        self.counters.generation_tokens += 1  # not a speculative run's tokens past the one that ends it
        if req.logprobs is not None:
            assert logprobs is not None, f"no logprobs for {req.request_id}"
            req.logprobs.append(logprobs)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        status = detokenize_and_check_stop(req, token, self._max_model_len)
        if req.matcher is not None and status is None:
            status = advance(req, token)
        if status is None:
            if req.sampling_params.output_kind is _FINAL_ONLY:
                return None  # nothing to report before the end
            # --stream-interval: the tokens since the last report wait for a full interval
            if self._stream_interval > 1 and req.num_sent_tokens and \
                    len(req.token_ids) - req.num_prompt_tokens - req.num_sent_tokens < self._stream_interval:
                return None
        else:
            self._finish(req, status)
        out = self.outputs.output(req, status is not None)
        if out is not None and out.finished:  # the whole request (all n sequences) is done
            self.counters.count_finished(req.finish_reason)
        return out

    def _fork(self, parent: Request) -> list[Request]:
        """n > 1: the parent's prompt is computed and n first tokens are drawn; the other n - 1
        sequences start here (Request.fork), sharing the prompt's blocks by reference."""
        children = [parent.fork(i) for i in range(1, parent.num_samples)]  # whole before registered
        for child in children:
            child.detokenizer = self._detokenizer(child)
        parent.num_samples = 1
        for child in children:
            self.requests[child.request_id] = child
        self.outputs.groups[parent.output_id].extend(children)
        if parent.lora is not None:
            self._lora_pins.add(parent, len(children))
        copies = self.scheduler.fork(parent, children)
        if copies:
            self.executor.copy_blocks(copies)
        return children

    def _fail_step(self, sched) -> list[str]:
        """Abort what the failed step touched: its requests, and those it preempted (their swap
        copy may not have happened). Returns their output ids."""
        ids = [r.request_id for r in sched.requests] + list(sched.preempted)
        failed = list(dict.fromkeys(self.requests[i].output_id for i in ids if i in self.requests))
        if sched.requests:
            self.scheduler.discard_last_step()
        for output_id in failed:
            self.abort_request(output_id)
        self.check_integrity()  # an AssertionError here: the engine is not to be trusted
        return failed

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if self.spec is not None:
            self.spec.release(req.request_id)
        req.finished_time = time.monotonic()
        self.scheduler.finish(req, status)
        del self.requests[req.request_id]
        if req.lora is not None:
            self._lora_pins.finish(req)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        swap = self.scheduler.swap
        swap.check_integrity()
        assert set(swap.req_blocks) == {r.request_id for r in self.scheduler.swapped}
        for req in self.requests.values():
            check_matcher(req)
        self._lora_pins.check_integrity(self.requests.values())
