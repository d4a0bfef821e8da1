"""Property-based tests (hypothesis) of the block pool and of the scheduler on top of it:
random arrivals, aborts, stops, forks, preemptions (swap and recompute) and finishes, with every
invariant checked after each step, and every request finishing once arrivals stop."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize, invariant,
                                 precondition, rule)

from pageserve.runtime.block_pool import BlockPool
from pageserve.runtime.config import SchedulerConfig
from pageserve.runtime.kv_cache_manager import KVCacheManager, cdiv
from pageserve.runtime.request import Request, RequestStatus
from pageserve.runtime.request_queue import priority_key
from pageserve.runtime.scheduler import Scheduler
from pageserve.runtime.step_inputs import BlockTables
from pageserve.runtime.swap_space import SwapSpace
from pageserve.sampling.params import SamplingParams

pytestmark = pytest.mark.unit

SETTINGS = settings(max_examples=60, stateful_step_count=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


class BlockPoolMachine(RuleBasedStateMachine):
    """The pool against a model of who holds what: reference counts, the free queue and the
    hash map must agree after every operation."""

    held = Bundle("held")

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(12, enable_prefix_caching=True)
        self.holds: dict[int, int] = {}  # block id -> holders in the model
        self.next_hash = 0

    @rule(target=held, n=st.integers(1, 5))
    def allocate(self, n):
        before = self.pool.num_free_blocks
        if n > before:
            with pytest.raises(ValueError):
                self.pool.get_new_blocks(n)
            assert self.pool.num_free_blocks == before, "a failed allocation took blocks"
            return []
        blocks = self.pool.get_new_blocks(n)
        assert len(blocks) == n and len({b.block_id for b in blocks}) == n
        assert self.pool.num_free_blocks == before - n
        for b in blocks:
            assert b.block_hash is None, "a reused block kept its old hash"
            self.holds[b.block_id] = self.holds.get(b.block_id, 0) + 1
        return blocks

    @rule(blocks=held)
    def cache(self, blocks):
        for b in blocks:
            if b.ref_cnt > 0 and b.block_hash is None:
                self.next_hash += 1
                self.pool.cache_block(b, self.next_hash.to_bytes(8, "little"), (self.next_hash,))

    @rule(blocks=held)
    def share(self, blocks):
        """A prefix hit: another request takes the same (cached) blocks."""
        hits = []
        for b in blocks:
            if b.block_hash is None:
                break
            found = self.pool.lookup(b.block_hash, b.token_ids)
            assert found is b
            hits.append(found)
        self.pool.touch(hits)
        for b in hits:
            self.holds[b.block_id] += 1

    @rule(blocks=consumes(held))
    def free(self, blocks):
        live = [b for b in blocks if self.holds.get(b.block_id, 0) > 0]
        self.pool.free_blocks(live)
        for b in live:
            self.holds[b.block_id] -= 1

    @rule()
    def reset_prefix_cache(self):
        if all(v == 0 for v in self.holds.values()):
            self.pool.reset_prefix_cache()
            assert not self.pool.hash_to_block

    @invariant()
    def consistent(self):
        self.pool.check_integrity()
        for b in self.pool.blocks:
            assert b.ref_cnt == self.holds.get(b.block_id, 0), b
        assert self.pool.num_free_blocks == sum(1 for b in self.pool.blocks if b.ref_cnt == 0)


def _request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), max_tokens, (0,))


class SchedulerMachine(RuleBasedStateMachine):
    """The scheduler with a fake model (every sampled token is 7) over a pool small enough
    that running requests are preempted often."""

    @initialize(mode=st.sampled_from(["swap", "recompute"]), num_blocks=st.integers(6, 24),
                block_size=st.sampled_from([4, 16]), budget=st.integers(8, 96), max_seqs=st.integers(1, 8),
                prefix=st.booleans(), prompts_first=st.booleans(), policy=st.sampled_from(["fcfs", "priority"]))
    def setup(self, mode, num_blocks, block_size, budget, max_seqs, prefix, prompts_first, policy):
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix)
        cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=4096,
                              enable_chunked_prefill=True, prompts_first=prompts_first, policy=policy)
        self.swap = SwapSpace(num_blocks // 2 if mode == "swap" else 0)
        self.sched = Scheduler(cfg, self.kv, self.swap, mode)
        self.tables = BlockTables()  # what a runner holds, from the steps' updates alone
        self.capacity = num_blocks * block_size
        self.requests: dict[str, Request] = {}
        self.count = 0
        self.ended: set[str] = set()
        self.written: set[int] = set()  # blocks whose KV a finished step (or swap-in) wrote

    def _live(self) -> list[Request]:
        return [r for r in self.requests.values() if not r.status.finished]

    @rule(prefix=st.sampled_from([[], [11] * 20, [12, 13] * 9]), tail=st.lists(st.integers(1, 50), max_size=30),
          max_tokens=st.integers(1, 40), n=st.sampled_from([1, 1, 1, 2, 3]), grammar=st.booleans(),
          priority=st.integers(-2, 2))
    def arrive(self, prefix, tail, max_tokens, n, grammar, priority):
        prompt = (prefix + tail) or [1]
        # the engine refuses these before they reach the scheduler (n > --max-num-seqs; a
        # context longer than max_model_len, which is never more than the pool holds)
        if n > self.sched.config.max_num_seqs or \
                cdiv(len(prompt) + max_tokens, self.kv.block_size) > self.kv.pool.num_blocks:
            return
        self.count += 1
        req = _request(f"r{self.count}", prompt, max_tokens)
        req.num_samples = n  # n > 1: forked after its first token, as the engine does
        req.priority = priority  # read under the priority policy only
        if grammar:  # structured output: not admitted until its grammar has compiled
            req.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.requests[req.request_id] = req
        self.sched.add_request(req)

    @precondition(lambda self: any(not r.status.finished for r in self.requests.values()))
    @rule(data=st.data())
    def abort(self, data):
        req = data.draw(st.sampled_from(self._live()))
        self.sched.finish(req, RequestStatus.FINISHED_ABORTED)
        self.ended.add(req.request_id)

    @precondition(lambda self: any(r.status == RequestStatus.RUNNING and r.num_output_tokens
                                   for r in self.requests.values()))
    @rule(data=st.data())
    def stop_string(self, data):
        """A request that stops early (a stop string or EOS) leaves at once."""
        running = [r for r in self._live() if r.status == RequestStatus.RUNNING and r.num_output_tokens]
        req = data.draw(st.sampled_from(running))
        self.sched.finish(req, RequestStatus.FINISHED_STOPPED)
        self.ended.add(req.request_id)

    @precondition(lambda self: any(r.status == RequestStatus.WAITING_FOR_GRAMMAR for r in self.requests.values()))
    @rule(data=st.data())
    def grammar_ready(self, data):
        event("grammar compiled")
        req = data.draw(st.sampled_from([r for r in self._live() if r.status == RequestStatus.WAITING_FOR_GRAMMAR]))
        req.status = RequestStatus.WAITING

    @rule()
    def step(self):
        self._step()

    @rule()
    def failed_step(self):
        """A step whose forward raises, as the engine handles it: the step is discarded and
        what it ran or preempted is aborted. Whatever it was to write holds garbage now."""
        out = self.sched.schedule()
        self._being_written(out)
        self.sched.discard_last_step()
        event("failed step")
        for rid in [sr.request_id for sr in out.requests] + out.preempted:
            req = self.requests.get(rid)
            if req is not None and not req.status.finished:
                self.sched.finish(req, RequestStatus.FINISHED_ABORTED)
                self.ended.add(rid)

    def _being_written(self, out):
        bs = self.kv.block_size
        self.written -= {slot // bs for slot in out.slot_mapping}
        self.written -= {dst for _, dst in out.swap_in}

    def _step(self):
        out = self.sched.schedule()
        assert out.num_tokens <= self.sched.config.max_num_batched_tokens
        assert len(out.requests) <= self.sched.config.max_num_seqs
        assert len(out.slot_mapping) == out.num_tokens
        assert len(set(out.slot_mapping)) == out.num_tokens, "two tokens written to one slot"
        bs, offset = self.kv.block_size, 0
        self.tables.release(out.finished_ids)
        self.tables.release(out.preempted)
        table = self.tables.of(self.tables.update(out.requests))
        for i, sr in enumerate(out.requests):
            req = self.requests[sr.request_id]
            assert req.status == RequestStatus.RUNNING  # never one still waiting for its grammar
            ids = self.kv.block_ids(req.request_id)
            # the runner's table, from the updates alone, is the request's, padded with 0
            assert table[i, :len(ids)].tolist() == ids and not table[i, len(ids):].any()
            # each token goes to its own position's slot in the request's own blocks
            for j, slot in enumerate(out.slot_mapping[offset:offset + len(sr.token_ids)]):
                pos = sr.start_pos + j
                assert slot == ids[pos // bs] * bs + pos % bs
            offset += len(sr.token_ids)
        for what, happened in (("preempted", out.preempted), ("swapped out", out.swap_out),
                               ("swapped in", out.swap_in)):
            if happened:
                event(what)
        assert all(0 <= dst < self.swap.num_blocks for _, dst in out.swap_out)
        assert all(0 <= src < self.swap.num_blocks for src, _ in out.swap_in)
        self._being_written(out)
        reqs = self.sched.update_after_step()
        for req in reqs:  # the step went through: every computed block holds its KV
            blocks = self.kv.block_ids(req.request_id)
            self.written |= set(blocks[:req.num_computed_tokens // self.kv.block_size])
        for sr, req in zip(out.requests, reqs):
            if not sr.sample:
                continue
            family = [req] + (self._fork(req) if req.num_samples > 1 else [])
            req.token_ids.append(7)
            for r in family:
                if r.num_output_tokens >= r.max_tokens:
                    self.sched.finish(r, RequestStatus.FINISHED_LENGTH)
                    self.ended.add(r.request_id)
        return out

    def _fork(self, parent: Request) -> list[Request]:
        """As the engine forks: before the parent's own first token is appended."""
        children = [parent.fork(i) for i in range(1, parent.num_samples)]
        for child in children:
            child.token_ids.append(8)
            self.requests[child.request_id] = child
        parent.num_samples = 1
        event("forked")
        self.sched.fork(parent, children)
        return children

    @invariant()
    def consistent(self):
        if not hasattr(self, "sched"):
            return
        self.kv.check_integrity()
        self.swap.check_integrity()
        s = self.sched
        sets = [list(s.waiting), s.running, s.swapped]
        ids = [r.request_id for group in sets for r in group]
        assert len(ids) == len(set(ids)), "a request is in two queues"
        assert set(ids) == {r.request_id for r in self._live()}
        for r in s.running:
            assert r.status == RequestStatus.RUNNING
            assert len(self.kv.block_ids(r.request_id)) >= cdiv(r.num_computed_tokens, self.kv.block_size)
            assert r.num_computed_tokens <= r.num_tokens
        for r in s.swapped:
            assert r.status == RequestStatus.SWAPPED and r.request_id not in self.kv.req_blocks
            assert r.request_id in self.swap.req_blocks
        for r in s.waiting:
            assert r.request_id not in self.kv.req_blocks
        if s.config.policy == "priority":  # the queues in the order they are taken
            for queue in (list(s.waiting), list(s.swapped)):
                assert queue == sorted(queue, key=priority_key)
        for rid in self.ended:
            assert rid not in self.kv.req_blocks and rid not in self.swap.req_blocks
        for block in self.kv.pool.hash_to_block.values():  # a prefix hit reads only written KV
            assert block.block_id in self.written, f"{block} is findable but its KV was never written"

    def teardown(self):
        """Once arrivals stop, everything left finishes in bounded steps, all blocks free."""
        if not hasattr(self, "sched"):
            return
        for r in self._live():
            if r.status == RequestStatus.WAITING_FOR_GRAMMAR:
                r.status = RequestStatus.WAITING
        bound = 10 + sum(r.num_tokens + r.max_tokens for r in self._live()) * 4
        for _ in range(bound):
            if not self.sched.has_unfinished():
                break
            self._step()
            self.consistent()
        assert not self.sched.has_unfinished(), "requests never finished"
        assert all(r.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
                                RequestStatus.FINISHED_STOPPED) for r in self.requests.values())
        assert all(r.num_output_tokens == r.max_tokens for r in self.requests.values()
                   if r.status == RequestStatus.FINISHED_LENGTH)
        free, cached, in_use = self.kv.pool.counts()
        assert in_use == 0 and free + cached == self.kv.pool.num_blocks
        assert not self.swap.req_blocks


TestBlockPool = BlockPoolMachine.TestCase
TestBlockPool.settings = SETTINGS
TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(SETTINGS, max_examples=250, stateful_step_count=100)
