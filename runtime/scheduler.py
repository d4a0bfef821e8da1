"""Continuous batching under a per-step token budget, with no prefill/decode phases.

Each step every running request gets the tokens it still lacks (one for a decode, a chunk
for a prompt); then swapped-out requests come back; then, once none is left swapped out,
waiting requests are admitted first come, first served (or by priority:
runtime/request_queue.py) while the budget, the sequence limit and the KV pool allow. With
`prompts_first` (CPUs), a step where a waiting request can start leaves the decodes out (the
next step always has them). When a running request cannot get a block, the newest running
request (under the priority policy: the one of lowest priority) is preempted: its blocks go to
the CPU swap space when there is room (mode "swap"), else they are freed and the request is
recomputed from its tokens later.

With async scheduling the next step is scheduled while the last one runs: a request whose step
in flight samples its next token runs ahead in the new step with that token as a placeholder
(`ScheduledRequest.placeholder`), which the runner takes from the step before on the device.
The host appends the token when that step is collected; a request that finished there wastes
its slot in the step after, whose output for it is dropped."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from pageserve.runtime.config import PreemptionMode, SchedulerConfig, SchedulingPolicy
from pageserve.runtime.encoder_cache import EncoderCacheManager
from pageserve.runtime.kv_cache_manager import KVCacheManager
from pageserve.runtime.lora.request import LoRARequest
from pageserve.runtime.request import LAST_UNFINISHED, Request, RequestStatus
from pageserve.runtime.request_queue import priority_key, request_queue
from pageserve.runtime.stats import SchedulerStats
from pageserve.runtime.swap_space import SwapSpace
from pageserve.sampling.params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens to compute this step
    start_pos: int  # position of token_ids[0]
    # its block table from index block_ids_start on (KVCacheManager.block_update): the runners
    # keep the rest from earlier steps
    block_ids_start: int
    new_block_ids: list[int]
    sample: bool  # this chunk reaches the end of the request's tokens, so a token is sampled
    sampling_params: SamplingParams
    pool: bool = False  # an embedding request: sum its tokens' last hidden states
    num_samples: int = 1  # tokens drawn from this request's logits (n before an n > 1 fork)
    num_prompt_tokens: int = 0
    matcher: object = None  # grammar.Matcher: the runner fills its row of the token bitmask
    # (None while the request's grammar waits for the end of its reasoning)
    request_tokens: list[int] = field(default_factory=list)  # all its tokens (read only)
    eos_token_ids: tuple[int, ...] = ()
    mm_items: tuple = ()  # the request's images (multimodal.ImageItem): the runner encodes those the chunk reaches
    lora: LoRARequest | None = None  # the adapter it runs under
    # speculative tokens after its last one (the end of token_ids): the runner returns the
    # target's greedy token at each of them and after the last
    draft_tokens: list[int] = field(default_factory=list)
    # async scheduling: its one token is the one the step before samples for it (unknown here)
    placeholder: bool = False


@dataclass(slots=True)
class SchedulerOutput:
    requests: list[ScheduledRequest] = field(default_factory=list)
    slot_mapping: list[int] = field(default_factory=list)  # cache slot of every scheduled token
    num_tokens: int = 0
    preempted: list[str] = field(default_factory=list)
    # copied before the step's forward, swap-outs first: (device block, swap block) pairs
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (swap block, device block)
    finished_ids: list[str] = field(default_factory=list)  # finished or aborted since the last step
    freed_images: list[bytes] = field(default_factory=list)  # encoder outputs the runner may drop

    @property
    def is_empty(self) -> bool:
        return not self.requests

    @property
    def carries_nothing(self) -> bool:
        """No request, and nothing for the runner to swap, copy, free or forget."""
        return not (self.requests or self.preempted or self.swap_out or self.swap_in or self.finished_ids
                    or self.freed_images)


def _adapter_names(requests) -> tuple[str, ...]:
    return tuple(sorted({r.lora.lora_name for r in requests if r.lora is not None}))


def _decoding(req: Request) -> bool:
    """One token to go: a decode (a prompt's or a recompute's chunks are more)."""
    return req.num_tokens - req.num_computed_tokens == 1


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, swap: SwapSpace | None = None,
                 preemption_mode: PreemptionMode = PreemptionMode.SWAP,
                 encoder_cache: EncoderCacheManager | None = None):
        self.config = config
        self.kv = kv
        self.swap = swap or SwapSpace(0)
        self.preemption_mode = PreemptionMode(preemption_mode)
        self.encoder_cache = encoder_cache or EncoderCacheManager(0)
        self.block_size = kv.block_size
        self.waiting = request_queue(config.policy)
        # oldest first; by priority_key under the priority policy, so that the newest idle one
        # (the victim of a preemption) is the one of lowest priority
        self.running: list[Request] = []
        self.swapped = request_queue(config.policy)
        self._by_priority = config.policy == SchedulingPolicy.PRIORITY
        self._joined = False  # requests joined the running list since it was last put in order
        self.reset_counters()
        self._steps: deque[list[tuple[Request, int]]] = deque()  # each step in flight: what it computes
        # the requests of those steps: their tokens in flight (not scheduled again until done,
        # but for a decode running ahead under async scheduling)
        self._in_flight: dict[str, int] = {}
        self._step_cap = config.max_num_seqs
        self._finished_ids: list[str] = []
        self._deferred = False  # the last step left the decodes for prompts

    def reset_counters(self) -> None:
        self._warned_preemption = False  # warned once per serving run (warm-up may preempt)
        self.num_preemptions = 0
        self.num_recomputed = 0  # preemptions that freed the blocks
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), len(self.swapped), self.kv.usage,
                              self.kv.prefix_queries, self.kv.prefix_hits, self.num_preemptions,
                              self.num_recomputed, self.config.max_loras, _adapter_names(self.running),
                              _adapter_names([*self.waiting, *self.swapped]))

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def schedule(self, max_step_seqs: int | None = None) -> SchedulerOutput:
        """The next step. `max_step_seqs`: the most requests it takes (with several steps in
        flight, each takes a share of the requests, so that the batches are even)."""
        self._step_cap = max_step_seqs or self.config.max_num_seqs
        if self._by_priority and self._joined:  # (leaving keeps the order)
            self.running.sort(key=priority_key)
            self._joined = False
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        self.encoder_cache.begin_step()
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        # prompts first: decodes wait one step (never two in a row) while prompts are admitted
        defer = self.config.prompts_first and not self._deferred and self._prompts_can_start()
        # the running requests' parts go into `out` as they are scheduled, the others' after
        budget, preempted_any = self._schedule_running(budget, scheduled, out, skip_decodes=defer)
        emitted = len(scheduled)
        if not preempted_any:
            budget = self._swap_in(budget, scheduled, out)
            if not self.swapped:
                self._admit_waiting(budget, scheduled)
        if defer and not scheduled and not preempted_any:  # no prompt could start after all
            defer = False
            self._schedule_running(budget, scheduled, out, skip_decodes=False)
            emitted = len(scheduled)
        self._deferred = defer

        for req, num_new in scheduled[emitted:]:
            self._emit(out, req, num_new)
        if scheduled:
            self._steps.append(scheduled)
        out.freed_images = self.encoder_cache.take_freed()
        return out

    def _fit(self, req: Request, num_new: int, start: int | None = None) -> int:
        """num_new cut where the encoder cache cannot hold the images the chunk reaches."""
        start = req.num_computed_tokens if start is None else start
        return self.encoder_cache.schedulable(req, start, num_new)

    def _schedule_running(self, budget: int, scheduled: list[tuple[Request, int]], out: SchedulerOutput,
                          skip_decodes: bool) -> tuple[int, bool]:
        """The running requests' next tokens, oldest first, preempting the newest where blocks
        run out; each one's part goes into `out` at once (a victim is never one already scheduled:
        it is the newest request no step holds, at or after the one that needs the block).
        Returns the budget left and whether anything was preempted."""
        preempted_any = False
        run_ahead = self.config.async_scheduling and not skip_decodes
        in_flight = self._in_flight
        i = 0
        while i < len(self.running) and budget > 0 and len(scheduled) < self._step_cap:
            req = self.running[i]
            if req.request_id in in_flight:
                if run_ahead and self._run_ahead(req, out):
                    scheduled.append((req, 1))
                    budget -= 1
                i += 1
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if req.mm_items:
                num_new = self._fit(req, num_new)
            if num_new <= 0 or (skip_decodes and _decoding(req)):
                i += 1
                continue
            if req.draft_tokens and _decoding(req):  # the drafts the budget leaves room for
                req.draft_tokens = req.draft_tokens[:budget - 1]
                num_new += len(req.draft_tokens)
            while not self.kv.allocate_slots(req, num_new):
                victim = self._pop_newest_idle()  # req itself at the latest
                self._preempt(victim, out)
                preempted_any = True
                if victim is req:
                    break
            else:
                self.encoder_cache.hold(req, req.num_computed_tokens, num_new)
                scheduled.append((req, num_new))
                self._emit(out, req, num_new)
                budget -= num_new
                i += 1
        return budget, preempted_any

    def _run_ahead(self, req: Request, out: SchedulerOutput) -> bool:
        """Async scheduling (the caller checks it is on and decodes are not deferred): the
        request, in flight in a step that samples its next token, takes a slot for that token
        in this step where it can without preempting anything (its part goes into `out`).
        Not where the host must see the token first: a grammar (or thinking a budget bounds),
        drafts, n > 1 forks, a min_tokens mask, bad words of several tokens, or a token that may
        be its last by length."""
        tokens = req.token_ids
        num_tokens = len(tokens)
        num_output = num_tokens - req.num_prompt_tokens
        p = req.sampling_params
        if req.pooling or (req.matcher is not None and req.matcher.reads_tokens) or req.num_samples != 1 \
                or req.draft_tokens or num_output < p.min_tokens or p.bans_by_context:
            return False
        rid = req.request_id
        ahead = self._in_flight[rid]
        if req.num_computed_tokens + ahead != num_tokens:  # the step in flight samples nothing
            return False
        if num_output + 1 >= req.max_tokens or num_tokens + 1 >= self.config.max_model_len:
            return False
        kv, bs = self.kv, self.block_size
        ids = kv.req_block_ids[rid]
        # its slot is most often in a block it holds (15 steps in 16): allocate_slots' answer,
        # but under a sliding window, whose blocks before the window that call gives back
        if kv.sliding_window or num_tokens >= len(ids) * bs:
            if not kv.allocate_slots(req, ahead + 1):
                return False
            block_ids_start, new_block_ids = kv.block_update(rid)
        else:  # its table as the step in flight sent it (block_update's answer, without the call)
            block_ids_start, new_block_ids = len(ids), []
        self._in_flight[rid] = ahead + 1
        # positional, in the fields' order (tests/test_scheduler.py checks it): by keyword the
        # call costs three times as much, at every request of every step
        out.requests.append(ScheduledRequest(
            rid, [0], num_tokens, block_ids_start, new_block_ids, True, p, False, 1, req.num_prompt_tokens,
            None, tokens, req.eos_token_ids, req.mm_items, req.lora, [], True))
        out.slot_mapping.append(ids[num_tokens // bs] * bs + num_tokens % bs)
        out.num_tokens += 1
        return True

    def _pop_newest_idle(self) -> Request:
        """Take out the newest running request that no step in flight holds (the last in the
        running order: under the priority policy, the one of lowest priority)."""
        for j in range(len(self.running) - 1, -1, -1):
            if self.running[j].request_id not in self._in_flight:
                return self.running.pop(j)
        raise AssertionError("every running request is in flight")

    def idle_running(self) -> list[Request]:
        """The running requests that no step in flight holds (those the next step may take)."""
        return [r for r in self.running if r.request_id not in self._in_flight]

    def _prompts_can_start(self) -> bool:
        """A waiting request could be admitted this step, with budget left after the running
        prompts' chunks, and a running one is decoding (so that deferring the decodes has
        something to give way to)."""
        if self.swapped or not self.waiting or not any(_decoding(r) for r in self.running):
            return False
        chunks = sum(r.num_tokens - r.num_computed_tokens for r in self.running if not _decoding(r))
        if chunks >= self.config.max_num_batched_tokens:
            return False
        for req in self.waiting:
            if req.status != RequestStatus.WAITING_FOR_GRAMMAR:
                return self.num_running_seqs + req.num_samples <= self.config.max_num_seqs
        return False

    def _running_adapters(self) -> set[int]:
        return {r.lora.lora_int_id for r in self.running if r.lora is not None}

    def _adapter_fits(self, req: Request, adapters: set[int]) -> bool:
        """Whether the running batch can take req's adapter: --max-loras distinct adapters at most."""
        return req.lora is None or req.lora.lora_int_id in adapters or len(adapters) < self.config.max_loras

    def _swap_in(self, budget: int, scheduled: list[tuple[Request, int]], out: SchedulerOutput) -> int:
        if not self.swapped:
            return budget
        adapters = self._running_adapters()
        while self.swapped and budget > 0 and self.num_running_seqs < self.config.max_num_seqs \
                and len(scheduled) < self._step_cap:
            req = self.swapped[0]
            if not self._adapter_fits(req, adapters):
                break
            num_new = self._fit(req, min(req.num_tokens - req.num_computed_tokens, budget))
            if num_new <= 0:
                break
            # room for the swapped blocks and this step's tokens, all at once, keeping a block
            # per running request free so that it is not swapped straight back out
            if not self.kv.allocate_slots(req, num_new, keep_free=len(self.running)):
                break
            self.swapped.popleft()
            swap_ids = self.swap.free(req.request_id)
            first, valid = self._live_blocks(req)
            out.swap_in.extend(zip(swap_ids, self.kv.block_ids(req.request_id)[first:valid]))
            self.num_swapped_in_blocks += valid - first
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._joined = True
            if req.lora is not None:
                adapters.add(req.lora.lora_int_id)
            self.encoder_cache.hold(req, req.num_computed_tokens, num_new)
            scheduled.append((req, num_new))
            budget -= num_new
        return budget

    def _admit_waiting(self, budget: int, scheduled: list[tuple[Request, int]]) -> None:
        # passed over, in arrival order: until their grammar is compiled, or while the running
        # batch holds --max-loras other adapters
        if not self.waiting:
            return
        passed = []
        adapters = self._running_adapters()
        while self.waiting and budget > 0 and len(scheduled) < self._step_cap:
            req = self.waiting[0]
            if req.status == RequestStatus.WAITING_FOR_GRAMMAR or not self._adapter_fits(req, adapters):
                passed.append(self.waiting.popleft())
                continue
            if self.num_running_seqs + req.num_samples > self.config.max_num_seqs:
                break
            hits, num_hit = self.kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_hit
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = self._fit(req, min(num_new, budget), num_hit)
            if num_new <= 0:
                break
            # keep a block per running request free: admitting a request only to preempt it at
            # the next block boundary of the others would thrash (recompute mode above all)
            if not self.kv.allocate_slots(req, num_new, hits, keep_free=len(self.running)):
                break
            self.waiting.popleft()
            if req.scheduled_time is None:  # a recomputed request's own blocks are no news
                self.kv.record_prefix_query(req.num_tokens, num_hit)
                req.scheduled_time = time.monotonic()
                req.num_cached_tokens = num_hit
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._joined = True
            if req.lora is not None:
                adapters.add(req.lora.lora_int_id)
            self.encoder_cache.hold(req, num_hit, num_new)
            scheduled.append((req, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(passed))

    def _emit(self, out: SchedulerOutput, req: Request, num_new: int) -> None:
        """The request's part of the step (but a decode run ahead's: _run_ahead); its tokens
        are in flight from now on."""
        rid = req.request_id
        ahead = self._in_flight.get(rid, 0)
        self._in_flight[rid] = ahead + num_new
        start = req.num_computed_tokens + ahead
        block_ids = self.kv.req_block_ids[rid]
        block_ids_start, new_block_ids = self.kv.block_update(rid)
        bs = self.block_size
        num_tokens = len(req.token_ids)
        drafts = req.draft_tokens if start + num_new > num_tokens else []
        end = start + num_new - len(drafts)
        out.requests.append(ScheduledRequest(
            rid, req.token_ids[start:end] + drafts if drafts else req.token_ids[start:end],
            start, block_ids_start, new_block_ids, end == num_tokens and not req.pooling,
            req.sampling_params, req.pooling, req.num_samples, req.num_prompt_tokens,
            req.matcher if req.matcher is None or req.matcher.active else None, req.token_ids,
            req.eos_token_ids, req.mm_items, req.lora, drafts, False))
        if num_new == 1:  # a decode (most of them)
            out.slot_mapping.append(block_ids[start // bs] * bs + start % bs)
        else:
            out.slot_mapping.extend(block_ids[p // bs] * bs + p % bs for p in range(start, start + num_new))
        out.num_tokens += num_new

    def _live_blocks(self, req: Request) -> tuple[int, int]:
        """[first, end) of the request's blocks that hold KV it will read again: those holding
        computed tokens, less those before its sliding window (placeholders, or about to be)."""
        return (self.kv.num_skipped_blocks(req.num_computed_tokens),
                -(-req.num_computed_tokens // self.block_size))

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        block_ids = self.kv.block_ids(req.request_id)
        first, valid = self._live_blocks(req)
        if self.preemption_mode == PreemptionMode.SWAP and self.swap.can_hold(valid - first):
            swap_ids = self.swap.allocate(req.request_id, valid - first)
            out.swap_out.extend(zip(block_ids[first:valid], swap_ids))
            self.num_swapped_out_blocks += valid - first
            req.status = RequestStatus.SWAPPED
            self.swapped.append(req)
        else:  # recompute: nothing kept but the tokens
            req.status = RequestStatus.PREEMPTED
            req.num_computed_tokens = 0
            req.pooled = None  # an embedding request pools its tokens again
            self.waiting.appendleft(req)
            self.num_recomputed += 1
        req.draft_tokens = []
        # the freed blocks are rewritten only by this step's forward, after the swap-out copy
        self.kv.free(req)
        self.encoder_cache.release(req)
        out.preempted.append(req.request_id)
        self.num_preemptions += 1
        if not self._warned_preemption:
            self._warned_preemption = True
            logger.warning(
                "Request %s was preempted (%s): the KV cache is too small for the running batch. "
                "Raise --kv-cache-memory / --gpu-memory-utilization or lower --max-num-seqs / "
                "--max-num-batched-tokens to avoid it.", req.request_id,
                "swapped out" if req.status == RequestStatus.SWAPPED else "recompute")

    def update_after_step(self, rejected: dict[str, int] | None = None) -> list[Request]:
        """The oldest step in flight is done: its tokens are in the KV cache, so its full blocks
        may serve prefix hits from now on; `rejected`: per request, the speculative tokens at the
        end of its chunk that the target model did not accept (their KV slots are written again
        later, and no block holding one is ever cached). Returns its scheduled requests (those
        aborted while it ran included)."""
        reqs = []
        bs, cached, in_flight = self.block_size, self.kv.req_num_cached, self._in_flight
        for req, num_new in self._steps.popleft() if self._steps else ():
            rid = req.request_id
            left = in_flight.pop(rid) - num_new  # _land, inline: at every request of every step
            if left:
                in_flight[rid] = left
            reqs.append(req)
            if req.status > LAST_UNFINISHED:  # aborted while in flight: its blocks are free already
                continue
            req.num_computed_tokens += num_new - (rejected.get(rid, 0) if rejected else 0)
            if req.draft_tokens:
                req.draft_tokens = []
            if req.num_computed_tokens // bs > cached.get(rid, 0):  # a block filled
                self.kv.cache_computed_blocks(req)
            if req.mm_items:
                self.encoder_cache.release_done(req)
        return reqs

    def discard_last_step(self) -> None:
        """The oldest step in flight failed: none of its tokens reached the cache."""
        for req, num_new in self._steps.popleft() if self._steps else ():
            self._land(req, num_new)

    def _land(self, req: Request, num_new: int) -> None:
        """A step in flight is over for the request: its tokens leave the count in flight."""
        left = self._in_flight.pop(req.request_id) - num_new
        if left:
            self._in_flight[req.request_id] = left

    def fork(self, parent: Request, children: list[Request]) -> list[tuple[int, int]]:
        """n > 1: after the parent's first sample, its siblings run beside it, sharing its
        blocks. Returns the (source, destination) copies of the partial block, which the caller
        makes at once: before anything can be preempted, freed or written."""
        copies = []
        for child in children:
            copy = self.kv.fork(parent, child)
            if copy is not None:
                copies.append(copy)
            child.status = RequestStatus.RUNNING
            self.running.append(child)
            self._joined = True
        return copies

    @property
    def num_running_seqs(self) -> int:
        """Sequences in the running batch: an n > 1 request not yet forked counts n."""
        return sum(r.num_samples for r in self.running)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Take a request out (finished or aborted) and free its blocks at once."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.SWAPPED:
            self.swapped.remove(req)
            self.swap.free(req.request_id)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
        self.encoder_cache.release(req)
        self._finished_ids.append(req.request_id)
