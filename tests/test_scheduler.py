"""Scheduler scenarios on the CPU with a fake model: the runner's output is made up."""

import random

import pytest

from pageserve.runtime.config import SchedulerConfig
from pageserve.runtime.kv_cache_manager import KVCacheManager
from pageserve.runtime.request import Request, RequestStatus
from pageserve.runtime.scheduler import Scheduler
from pageserve.runtime.swap_space import SwapSpace
from pageserve.sampling.logprobs import TokenLogprobs
from pageserve.sampling.params import SamplingParams

pytestmark = pytest.mark.unit


def make(rid, n_prompt, max_tokens=4):
    return Request(rid, list(range(1000, 1000 + n_prompt)), SamplingParams(max_tokens=max_tokens),
                   max_tokens, (0,))


def make_scheduler(num_blocks=64, block_size=16, budget=64, max_seqs=8, prefix=False, swap_blocks=0,
                   prompts_first=False):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=4096,
                          enable_chunked_prefill=True, prompts_first=prompts_first)
    return Scheduler(cfg, kv, SwapSpace(swap_blocks), "swap" if swap_blocks else "recompute")


def fake_step(sched: Scheduler, next_token=7):
    """One step with a fake runner: sampled requests get `next_token`, finished ones leave."""
    out = sched.schedule()
    assert out.num_tokens <= sched.config.max_num_batched_tokens
    assert len(out.requests) <= sched.config.max_num_seqs
    assert len(out.slot_mapping) == out.num_tokens
    assert len(set(out.slot_mapping)) == out.num_tokens, "two tokens written to one slot"
    reqs = sched.update_after_step()
    for sr, req in zip(out.requests, reqs):
        if sr.sample:
            req.token_ids.append(next_token)
            if req.num_output_tokens >= req.max_tokens:
                sched.finish(req, RequestStatus.FINISHED_LENGTH)
    sched.kv.check_integrity()
    sched.swap.check_integrity()
    return out


def test_long_prompt_is_chunked_and_shares_steps_with_decodes():
    sched = make_scheduler(budget=64)
    short = make("short", 10, max_tokens=10)
    sched.add_request(short)
    out = fake_step(sched)
    assert [(r.request_id, len(r.token_ids)) for r in out.requests] == [("short", 10)]
    long = make("long", 150)
    sched.add_request(long)  # joins at any step
    out = fake_step(sched)
    assert [(r.request_id, len(r.token_ids), r.sample) for r in out.requests] == [
        ("short", 1, True), ("long", 63, False)]
    out = fake_step(sched)
    assert [(r.request_id, len(r.token_ids)) for r in out.requests] == [("short", 1), ("long", 63)]
    out = fake_step(sched)
    assert [(r.request_id, len(r.token_ids), r.sample) for r in out.requests] == [
        ("short", 1, True), ("long", 24, True)]
    assert out.requests[1].start_pos == 126


def test_prompts_first_leaves_the_decodes_for_one_step_at_most():
    sched = make_scheduler(budget=64, max_seqs=4, prompts_first=True)
    steps = lambda out: [(r.request_id, len(r.token_ids)) for r in out.requests]  # noqa: E731
    sched.add_request(make("a", 10, max_tokens=20))
    assert steps(fake_step(sched)) == [("a", 10)]
    sched.add_request(make("b", 20, max_tokens=20))
    assert steps(fake_step(sched)) == [("b", 20)]  # a's decode waits
    sched.add_request(make("c", 100, max_tokens=20))
    # never two steps without the decodes: c is admitted beside them, chunked
    assert steps(fake_step(sched)) == [("a", 1), ("b", 1), ("c", 62)]
    sched.add_request(make("d", 5, max_tokens=20))
    assert steps(fake_step(sched)) == [("c", 38), ("d", 5)]  # a prompt's chunks are prompt work
    assert steps(fake_step(sched)) == [("a", 1), ("b", 1), ("c", 1), ("d", 1)]
    sched.add_request(make("e", 5, max_tokens=20))  # past max_num_seqs: cannot start, nothing waits
    assert steps(fake_step(sched)) == [("a", 1), ("b", 1), ("c", 1), ("d", 1)]
    long = make_scheduler(budget=64, max_seqs=4, prompts_first=True)
    long.add_request(make("a", 10, max_tokens=20))
    fake_step(long)
    long.add_request(make("c", 400, max_tokens=20))
    long.add_request(make("d", 5, max_tokens=20))
    assert steps(fake_step(long)) == [("c", 64)]  # c starts; a waits one step
    for _ in range(3):  # c's chunks fill the budget, so d cannot start: a decodes every step
        assert [r for r, _ in steps(fake_step(long))] == ["a", "c"]
    tight = make_scheduler(num_blocks=3, budget=64, max_seqs=4, prompts_first=True)
    tight.add_request(make("a", 10, max_tokens=20))
    fake_step(tight)
    tight.add_request(make("b", 40, max_tokens=20))  # needs 3 blocks where 2 are free (1 kept for a)
    assert steps(fake_step(tight)) == [("a", 1)]  # b cannot start after all: a decodes at once
    mixed = make_scheduler(budget=64, max_seqs=4)  # the default: decodes and prompts together
    mixed.add_request(make("a", 10, max_tokens=20))
    fake_step(mixed)
    mixed.add_request(make("b", 20, max_tokens=20))
    assert steps(fake_step(mixed)) == [("a", 1), ("b", 20)]


def test_slot_mapping_follows_block_table():
    sched = make_scheduler(num_blocks=4, block_size=16, prefix=False)
    first, second = make("x", 32), make("y", 16)
    sched.kv.allocate_slots(first, 32)  # blocks 0, 1
    sched.kv.allocate_slots(second, 16)  # block 2
    sched.kv.free(first)  # free queue now: 3, 1, 0
    sched.add_request(make("a", 40))
    out = sched.schedule()
    assert (out.requests[0].block_ids_start, out.requests[0].new_block_ids) == (0, [3, 1, 0])
    assert out.slot_mapping == list(range(48, 64)) + list(range(16, 32)) + list(range(0, 8))



def test_runner_tables_take_only_what_changed_and_refuse_a_table_they_never_got():
    """A runner's block tables (step_inputs.BlockTables) apply each step's changes; a request
    sent from past the start of a table that runner never got is refused by name, with or
    without new ids of its own."""
    from types import SimpleNamespace

    from pageserve.runtime.step_inputs import BlockTables

    def sent(rid, start, new):
        return SimpleNamespace(request_id=rid, block_ids_start=start, new_block_ids=new)

    tables = BlockTables()
    rows = tables.update([sent("a", 0, [5, 6]), sent("b", 0, [9])])
    assert tables.of(rows).tolist() == [[5, 6], [9, 0]]
    rows = tables.update([sent("b", 1, []), sent("a", 2, [7])])  # b unchanged, a one block longer
    assert tables.of(rows).tolist() == [[9, 0, 0], [5, 6, 7]]
    for new in ([], [3]):
        with pytest.raises(RuntimeError, match="request c: a block table update from index 2 for a table"):
            tables.update([sent("a", 3, []), sent("c", 2, new)])

def test_step_inputs_give_the_adapters_every_token_of_the_step():
    """The step's adapter batch is built over all its tokens (prompt chunks and decodes, with
    and without an adapter): the Triton kernels read every token's row from it."""
    import torch

    from pageserve.runtime.device import HostDevice
    from pageserve.runtime.lora.request import LoRARequest
    from pageserve.runtime.step_inputs import BlockTables, step_inputs

    class Recorder:
        def batch(self, requests, num_tokens):
            self.seen = ([r.request_id for r in requests], num_tokens)

    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=4096,
                          enable_chunked_prefill=True, max_loras=1)
    sched = Scheduler(cfg, KVCacheManager(64, 16, enable_prefix_caching=False))
    a, b = make("a", 5), make("b", 3)
    a.lora = LoRARequest("x", 1, "/nowhere")
    sched.add_request(a)
    sched.add_request(b)
    lora, tables = Recorder(), BlockTables()
    step_inputs(sched.schedule(), HostDevice(), torch.device("cpu"), tables, lora)
    assert lora.seen == (["a", "b"], 8)
    sched.update_after_step()
    for req in (a, b):
        req.token_ids.append(7)
    step_inputs(sched.schedule(), HostDevice(), torch.device("cpu"), tables, lora)
    assert lora.seen == (["a", "b"], 2)


def test_first_come_first_served_and_max_num_seqs():
    sched = make_scheduler(budget=1000, max_seqs=3)
    for i in range(5):
        sched.add_request(make(f"r{i}", 5))
    out = fake_step(sched)
    assert [r.request_id for r in out.requests] == ["r0", "r1", "r2"]
    assert [r.request_id for r in sched.waiting] == ["r3", "r4"]


def test_finished_request_frees_blocks_at_once():
    sched = make_scheduler(num_blocks=8)
    req = make("a", 30, max_tokens=1)
    sched.add_request(req)
    fake_step(sched)
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert sched.kv.pool.num_free_blocks == 8 and not sched.has_unfinished()


def test_preemption_under_pressure_finishes_everything():
    """A pool for about two requests, twenty submitted: requests get preempted and
    recomputed, and all of them finish with their full output."""
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=12, block_size=8, budget=48, max_seqs=8)
    reqs = [make(f"r{i}", rng.randrange(5, 40), max_tokens=rng.randrange(1, 20)) for i in range(20)]
    for r in reqs:
        sched.add_request(r)
    preempted = 0
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        out = fake_step(sched)
        preempted += len(out.preempted)
    assert not sched.has_unfinished()
    assert preempted > 0 and sched.num_preemptions == preempted
    assert all(r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == r.max_tokens
               for r in reqs)
    assert sched.kv.pool.num_free_blocks == 12


def test_preempted_request_restarts_from_scratch():
    sched = make_scheduler(num_blocks=5, block_size=4, budget=100, max_seqs=4)
    a, b = make("a", 7, max_tokens=20), make("b", 7, max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    fake_step(sched)  # both prefilled: 2 blocks each, one kept free for growth
    fake_step(sched)  # position 7 still fits
    out = fake_step(sched)  # position 8: a takes the last block, b (newest) is preempted
    assert out.preempted == ["b"] and [r.request_id for r in out.requests] == ["a"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert sched.waiting[0] is b and b.num_tokens == 9  # keeps the tokens it generated


def test_admission_keeps_a_block_per_running_request():
    sched = make_scheduler(num_blocks=6, block_size=4, budget=100, max_seqs=8)
    for rid in ("a", "b", "c"):
        sched.add_request(make(rid, 7, max_tokens=20))
    out = fake_step(sched)
    # a and b take 2 blocks each; c would leave 0 free for a's and b's next block
    assert [r.request_id for r in out.requests] == ["a", "b"]
    assert sched.kv.pool.num_free_blocks == 2


def test_swap_out_and_back_in_moves_the_computed_blocks():
    sched = make_scheduler(num_blocks=5, block_size=4, budget=100, max_seqs=4, swap_blocks=8)
    a, b = make("a", 7, max_tokens=6), make("b", 6, max_tokens=20)  # a alone fits in the pool
    sched.add_request(a)
    sched.add_request(b)
    fake_step(sched)  # a: blocks for 7 tokens, b: for 6
    b_blocks = sched.kv.block_ids("b")
    fake_step(sched)  # a computes position 7, b position 6
    fake_step(sched)  # a takes the last free block for position 8; b computes position 7
    out = fake_step(sched)  # b needs a block for position 8: none left, b is swapped out
    assert out.preempted == ["b"] and b.status == RequestStatus.SWAPPED
    # b had computed 8 tokens: both of its blocks hold tokens and go to the swap space
    assert [d for d, _ in out.swap_out] == b_blocks
    swap_ids = [s for _, s in out.swap_out]
    assert sched.swap.req_blocks["b"] == swap_ids and b.num_computed_tokens == 8
    late = make("late", 3)
    sched.add_request(late)
    for _ in range(40):  # b comes back before the later request is admitted
        out = fake_step(sched)
        if out.swap_in:
            break
        assert late.status == RequestStatus.WAITING
    assert [s for s, _ in out.swap_in] == swap_ids
    assert [d for _, d in out.swap_in] == sched.kv.block_ids("b")[:2]
    assert b.status == RequestStatus.RUNNING and not sched.swap.req_blocks


def test_a_fork_copies_every_field_but_what_each_sequence_owns():
    """Request.fork is the one place n > 1 sequences are made: any field not listed as the
    sequence's own (a field added later included) is the parent's."""
    parent = Request("r", [1, 2, 3], SamplingParams(n=3, max_tokens=5, logprobs=2), 5, (0,), "text", "salt")
    parent.num_computed_tokens, parent.scheduled_time, parent.num_prompt_counted = 3, 12.5, 3
    child = parent.fork(2)
    own = {"request_id", "index", "num_samples", "token_ids", "logprobs", "matcher", "detokenizer",
           "stop_reason", "num_sent_tokens", "status"}
    for name in Request.__slots__:
        if name not in own:
            assert getattr(child, name) is getattr(parent, name), name
    assert (child.request_id, child.index, child.num_samples) == ("r#2", 2, 1)
    assert child.status == RequestStatus.WAITING  # running only once the scheduler has forked it
    child.token_ids.append(9)
    child.logprobs.append(TokenLogprobs(9, -0.5, 1, b"", b""))
    assert parent.token_ids == [1, 2, 3] and parent.logprobs == [] and len(child.logprobs) == 1


def test_a_scheduled_request_carries_the_requests_own_fields():
    """_emit builds ScheduledRequest positionally: each field must hold what its name says."""
    from dataclasses import fields

    from pageserve.runtime.lora.request import LoRARequest
    from pageserve.runtime.scheduler import ScheduledRequest

    class Matcher:
        active = True

    assert [f.name for f in fields(ScheduledRequest)] == [
        "request_id", "token_ids", "start_pos", "block_ids_start", "new_block_ids", "sample", "sampling_params",
        "pool", "num_samples", "num_prompt_tokens", "matcher", "request_tokens", "eos_token_ids", "mm_items",
        "lora", "draft_tokens", "placeholder"]
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=4096,
                                      enable_chunked_prefill=True, max_loras=1),
                      KVCacheManager(64, 16))
    req = Request("a", list(range(1000, 1040)), SamplingParams(n=2, max_tokens=9), 9, (5, 6))
    req.lora, req.matcher = LoRARequest("ad", 3, "/x"), Matcher()
    sched.add_request(req)
    sr = sched.schedule().requests[0]
    assert (sr.request_id, sr.token_ids, sr.start_pos, sr.block_ids_start, sr.new_block_ids, sr.sample) == \
        ("a", req.token_ids, 0, 0, sched.kv.block_ids("a"), True)
    assert sr.sampling_params is req.sampling_params and sr.request_tokens is req.token_ids
    assert (sr.pool, sr.num_samples, sr.num_prompt_tokens, sr.eos_token_ids) == (False, 2, 40, (5, 6))
    assert (sr.matcher, sr.mm_items, sr.lora) == (req.matcher, (), req.lora)
    assert (sr.draft_tokens, sr.placeholder) == ([], False)


def test_a_decode_run_ahead_carries_the_requests_own_fields():
    """Async scheduling's record of a decode run ahead (built positionally too, apart): its
    one placeholder token at the position after the request's tokens, in the next block."""
    from pageserve.runtime.lora.request import LoRARequest

    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=4096,
                                      enable_chunked_prefill=True, async_scheduling=True, max_loras=1),
                      KVCacheManager(64, 16))
    req = Request("a", list(range(1000, 1032)), SamplingParams(max_tokens=9), 9, (5, 6))
    req.lora = LoRARequest("ad", 3, "/x")
    sched.add_request(req)
    sched.schedule()  # the prompt: two full blocks, its first token sampled
    second = sched.schedule()  # run ahead of that token, into a third block
    sr = second.requests[0]
    assert (sr.request_id, sr.token_ids, sr.start_pos, sr.sample, sr.placeholder) == ("a", [0], 32, True, True)
    assert (sr.block_ids_start, sr.new_block_ids) == (2, sched.kv.block_ids("a")[2:]) and len(sr.new_block_ids) == 1
    assert sr.sampling_params is req.sampling_params and sr.request_tokens is req.token_ids
    assert (sr.pool, sr.num_samples, sr.num_prompt_tokens, sr.eos_token_ids) == (False, 1, 32, (5, 6))
    assert (sr.matcher, sr.mm_items, sr.lora, sr.draft_tokens) == (None, (), req.lora, [])
    assert (second.slot_mapping, second.num_tokens) == ([sched.kv.block_ids("a")[2] * 16], 1)
    assert sched._steps[-1] == [(req, 1)]
