"""Where every layer attends within a sliding window (Mistral with sliding_window), a request's
blocks wholly before the window of its next token go back to the pool: the KV manager, the
scheduler's swap maps, the max_model_len check, and greedy parity with HF on a tiny all-sliding
Mistral whose requests outgrow the whole pool, with prefix hits and forced preemptions."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from pageserve.loadtest.tiny_model import build_tiny_model
from pageserve.runtime import LLM, SamplingParams
from pageserve.runtime.block_pool import NULL_BLOCK
from pageserve.runtime.config import SchedulerConfig
from pageserve.runtime.kv_cache_manager import KVCacheManager, cdiv
from pageserve.runtime.models import registry
from pageserve.runtime.request import Request, RequestStatus
from pageserve.runtime.scheduler import Scheduler, SchedulerOutput
from pageserve.runtime.step_inputs import BlockTables
from pageserve.runtime.swap_space import SwapSpace
from pageserve.sampling.params import SamplingParams as Params
from tests.conftest import assert_pool_clean
from tests.hf_reference import hf_greedy
from tests.test_properties import SETTINGS, SchedulerMachine

GiB = 1 << 30
# the tiny models: 2 layers, 2 KV heads of 16 dims, float32, 16-token blocks
TINY_BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4


def _request(rid: str, prompt: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, prompt, Params(max_tokens=max_tokens), max_tokens, (0,))


def _live(kv: KVCacheManager, rid: str) -> list:
    return [b for b in kv.req_blocks[rid] if b is not NULL_BLOCK]


@pytest.mark.unit
def test_blocks_before_the_window_go_back_to_the_pool():
    kv = KVCacheManager(8, 4, enable_prefix_caching=True, sliding_window=6)
    req = _request("a", list(range(1, 41)))
    for chunk in range(5):  # 8 tokens a step: 40 tokens, 10 blocks, through a pool of 8
        assert kv.allocate_slots(req, 8)
        req.num_computed_tokens += 8
        kv.cache_computed_blocks(req)
        kv.check_integrity()
        # the next token (at num_computed) sees positions num_computed - 5 on: blocks before
        # (num_computed - 5) // 4 are placeholders once the next allocation runs
        skip = kv.num_skipped_blocks(chunk * 8)
        assert kv.req_blocks["a"][:skip] == [NULL_BLOCK] * skip
        assert len(kv.req_blocks["a"]) == cdiv(req.num_computed_tokens, 4)
    assert len(_live(kv, "a")) <= cdiv(6 - 1 + 8, 4) + 1
    free, cached, in_use = kv.pool.counts()
    assert in_use == len(_live(kv, "a")) and cached > 0  # the freed blocks keep their hashes
    kv.free(req)
    kv.check_integrity()
    assert kv.pool.counts()[2] == 0


@pytest.mark.unit
def test_no_window_keeps_every_block():
    kv = KVCacheManager(16, 4)
    req = _request("a", list(range(1, 41)))
    for _ in range(5):
        assert kv.allocate_slots(req, 8)
        req.num_computed_tokens += 8
    assert NULL_BLOCK not in kv.req_blocks["a"] and len(kv.req_blocks["a"]) == 10


@pytest.mark.unit
def test_prefix_hits_before_the_window_are_not_taken():
    kv = KVCacheManager(12, 4, enable_prefix_caching=True, sliding_window=6)
    first = _request("a", list(range(1, 25)))
    assert kv.allocate_slots(first, 24)
    first.num_computed_tokens = 24
    kv.cache_computed_blocks(first)
    kv.free(first)
    second = _request("b", list(range(1, 25)) + [99, 98])
    hits, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 24 and len(hits) == 6
    assert kv.allocate_slots(second, 2, hits)
    # the first new token (position 24) sees 19..24: blocks 0..3 end before it
    assert kv.req_blocks["b"][:4] == [NULL_BLOCK] * 4
    assert kv.req_blocks["b"][4:6] == hits[4:] and all(h.ref_cnt == 0 for h in hits[:4])
    kv.check_integrity()


@pytest.mark.unit
def test_fork_shares_the_placeholders():
    kv = KVCacheManager(12, 4, enable_prefix_caching=False, sliding_window=5)
    parent = _request("p", list(range(1, 23)))
    assert kv.allocate_slots(parent, 20)
    parent.num_computed_tokens = 20
    assert kv.allocate_slots(parent, 2)  # frees blocks 0..3
    parent.num_computed_tokens = 22
    child = parent.fork(1)
    pair = kv.fork(parent, child)
    assert kv.req_blocks[child.request_id][:4] == [NULL_BLOCK] * 4 and pair is not None
    kv.check_integrity()
    kv.free(parent)
    kv.free(child)
    kv.check_integrity()
    assert kv.pool.counts()[2] == 0


@pytest.mark.unit
def test_a_fork_with_no_block_to_copy_into_recomputes_what_its_window_needs():
    """With no free block for the partial block's copy, the child recomputes from the last full
    block; where that token's window reaches blocks the parent already let go, from the start."""
    kv = KVCacheManager(8, 4, enable_prefix_caching=False, sliding_window=6)
    parent = _request("p", list(range(1, 24)))
    assert kv.allocate_slots(parent, 20)
    parent.num_computed_tokens = 20
    assert kv.allocate_slots(parent, 3)  # position 20 sees 15..20: blocks 0..2 go
    parent.num_computed_tokens = 23
    parent.token_ids.append(50)
    assert kv.allocate_slots(parent, 1)  # position 23 sees 18..23: block 3 goes too
    assert kv.req_blocks["p"][:4] == [NULL_BLOCK] * 4
    filler = _request("f", list(range(1, 1 + 4 * kv.pool.num_free_blocks)))
    assert kv.allocate_slots(filler, filler.num_tokens) and kv.pool.num_free_blocks == 0
    child = parent.fork(1)
    # from position 20 it would read 15..19, in block 3, gone: it starts over
    assert kv.fork(parent, child) is None and child.num_computed_tokens == 0 and kv.req_blocks[child.request_id] == []
    kv.check_integrity()
    for r in (parent, child, filler):
        kv.free(r)
    kv.check_integrity()
    assert kv.pool.counts()[2] == 0


@pytest.mark.unit
def test_swap_moves_only_the_blocks_inside_the_window():
    kv = KVCacheManager(6, 4, enable_prefix_caching=False, sliding_window=6)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64, enable_chunked_prefill=True)
    sched = Scheduler(cfg, kv, SwapSpace(8))
    a = _request("a", list(range(1, 33)), 4)
    sched.add_request(a)
    for _ in range(4):  # the prompt, 8 tokens a step: 32 tokens (8 blocks) through a pool of 6
        sched.schedule()
        sched.update_after_step()
        kv.check_integrity()
    a.token_ids.append(7)
    live = _live(kv, "a")
    assert a.num_computed_tokens == 32 and len(kv.req_blocks["a"]) == 8 and len(live) == 4
    sched.running.remove(a)  # as the scheduler takes its victim out before preempting it
    out = SchedulerOutput()
    sched._preempt(a, out)
    # the next token (position 32) sees 27..32: blocks 6 and 7 only
    assert kv.num_skipped_blocks(32) == 6
    assert [d for d, _ in out.swap_out] == [b.block_id for b in live[2:]]
    assert a.status == RequestStatus.SWAPPED and len(sched.swap.req_blocks["a"]) == 2
    assert kv.pool.counts()[2] == 0
    out = sched.schedule()
    assert [s for s, _ in out.swap_in] == [0, 1]
    assert kv.req_blocks["a"][:6] == [NULL_BLOCK] * 6 and len(kv.req_blocks["a"]) == 9
    assert [d for _, d in out.swap_in] == kv.block_ids("a")[6:8]
    kv.check_integrity()
    sched.swap.check_integrity()


@pytest.mark.unit
def test_decodes_running_ahead_free_the_blocks_before_the_window():
    """Async scheduling: a decode run ahead (its slot mostly in a block it holds) still gives
    back the blocks that fall before its window, at every step, as a decode scheduled after its
    token does."""
    kv = KVCacheManager(8, 4, enable_prefix_caching=False, sliding_window=6)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
                          enable_chunked_prefill=True, async_scheduling=True)
    sched = Scheduler(cfg, kv, SwapSpace(0))
    a = _request("a", list(range(1, 9)), 48)
    sched.add_request(a)
    assert [r.placeholder for r in sched.schedule().requests] == [False]  # the prompt
    ahead = 0
    for token in range(40):
        ahead += [r.placeholder for r in sched.schedule().requests] == [True]
        skip = kv.num_skipped_blocks(a.num_computed_tokens)  # before the window of what it computes
        assert kv.req_blocks["a"][:skip] == [NULL_BLOCK] * skip, token
        sched.update_after_step()
        a.token_ids.append(token)
        assert len(_live(kv, "a")) <= cdiv(6 - 1 + 2, 4) + 1
        kv.check_integrity()
    assert ahead == 40


class SlidingWindowSchedulerMachine(SchedulerMachine):
    """The scheduler machine of test_properties over an all-sliding model: requests may be
    longer than the whole pool, as long as one request's window and step fit in it."""

    @initialize(mode=st.sampled_from(["swap", "recompute"]), block_size=st.sampled_from([4, 16]),
                window=st.integers(2, 40), budget=st.integers(8, 64), max_seqs=st.integers(1, 8),
                prefix=st.booleans(), spare=st.integers(0, 8))
    def setup(self, mode, block_size, window, budget, max_seqs, prefix, spare):
        self.live_bound = cdiv(window - 1 + budget, block_size) + 1
        num_blocks = self.live_bound + spare
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix, sliding_window=window)
        cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=4096,
                              enable_chunked_prefill=True)
        self.swap = SwapSpace(num_blocks // 2 if mode == "swap" else 0)
        self.sched = Scheduler(cfg, self.kv, self.swap, mode)
        self.tables = BlockTables()
        self.requests: dict[str, Request] = {}
        self.count = 0
        self.ended: set[str] = set()
        self.written: set[int] = set()

    @rule(prefix=st.sampled_from([[], [11] * 20, [12, 13] * 9]), tail=st.lists(st.integers(1, 50), max_size=60),
          max_tokens=st.integers(1, 120), n=st.sampled_from([1, 1, 2]))
    def arrive(self, prefix, tail, max_tokens, n):
        prompt = (prefix + tail) or [1]
        if n > self.sched.config.max_num_seqs:
            return
        if cdiv(len(prompt) + max_tokens, self.kv.block_size) > self.kv.pool.num_blocks:
            event("longer than the pool")
        self.count += 1
        req = _request(f"r{self.count}", prompt, max_tokens)
        req.num_samples = n
        self.requests[req.request_id] = req
        self.sched.add_request(req)

    @invariant()
    def bounded_by_the_window(self):
        if not hasattr(self, "sched"):
            return
        for r in self.sched.running:
            assert len(_live(self.kv, r.request_id)) <= self.live_bound, r


TestSlidingWindowScheduler = pytest.mark.unit(SlidingWindowSchedulerMachine.TestCase)
TestSlidingWindowScheduler.settings = settings(SETTINGS, max_examples=150, stateful_step_count=80)


# --- the engine on a tiny all-sliding Mistral (window 12 on both layers) ---

def _mistral_llm(model_dir, blocks: int, swap_blocks: int = 0, **kw) -> LLM:
    kw.setdefault("max_num_batched_tokens", 32)
    return LLM(str(model_dir), dtype="float32", kv_cache_memory=blocks * TINY_BLOCK_BYTES / GiB,
               swap_space=swap_blocks * TINY_BLOCK_BYTES / GiB, debug_checks=True, **kw)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("mistral-sw"), arch="mistral")


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("gemma2-sw"), arch="gemma2")


@pytest.mark.unit
def test_only_models_windowed_in_every_layer_free_blocks(mistral_dir, gemma2_dir):
    from pageserve.runtime.models.loader import read_config

    mistral, gemma = read_config(mistral_dir), read_config(gemma2_dir)
    assert registry.kv_sliding_window("MistralForCausalLM", mistral, 2) == 12
    assert registry.kv_sliding_window("Gemma2ForCausalLM", gemma, 2) == 0  # its second layer is global
    assert registry.kv_sliding_window("Gemma2ForCausalLM", dict(gemma, layer_types=["sliding_attention"] * 2), 2) == 12
    assert registry.kv_sliding_window("LlamaForCausalLM", mistral, 2) == 0


@pytest.mark.engine
def test_max_model_len_beyond_the_pool_only_where_the_window_allows(mistral_dir, gemma2_dir):
    # 8 blocks hold 128 tokens; one Mistral request holds at most cdiv(11 + 32, 16) + 1 = 4
    llm = _mistral_llm(mistral_dir, blocks=8, max_model_len=1024)
    assert llm.engine.kv.sliding_window == 12 and llm.engine.config.cache.num_blocks == 8
    with pytest.raises(ValueError, match="fewer than max_model_len"):  # the existing error
        _mistral_llm(gemma2_dir, blocks=8, max_model_len=1024)
    _mistral_llm(gemma2_dir, blocks=8, max_model_len=128)  # within the pool: as before
    with pytest.raises(ValueError, match="sliding window of 12 tokens"):  # not even one window fits
        _mistral_llm(mistral_dir, blocks=3, max_model_len=1024)


def force_preemptions(engine, every: int = 13):
    """Every `every`-th block request of a running request (with another running beside it)
    fails once, so the scheduler preempts its newest running request there."""
    kv, sched = engine.kv, engine.scheduler
    real, calls = kv.allocate_slots, itertools.count()

    def allocate_slots(req, num_new, hits=(), keep_free=0):
        if req.status == RequestStatus.RUNNING and len(sched.running) > 1 and next(calls) % every == every - 1:
            return False
        return real(req, num_new, hits, keep_free)

    kv.allocate_slots = allocate_slots


@pytest.mark.engine
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_greedy_parity_with_requests_longer_than_the_pool(mistral_dir, mode):
    """Six requests of up to 318 tokens through a pool of 12 blocks (192 tokens): the longest
    lives only because its blocks before the window are freed as it goes. Three share a
    48-token prefix that a first request left in the cache (hits, some of them before the
    window); preemptions are forced mid-run (swap with a 3-block swap space, so some are
    recomputed too)."""
    rng = random.Random(3)
    shared = [rng.randrange(3, 384) for _ in range(48)]
    prompts = [(shared if i % 2 else []) + [rng.randrange(3, 384) for _ in range(10 + 20 * i)] for i in range(6)]
    expected = hf_greedy(mistral_dir, prompts, max_new_tokens=160)
    llm = _mistral_llm(mistral_dir, blocks=12, swap_blocks=3, max_model_len=512, preemption_mode=mode)
    engine = llm.engine
    first = llm.generate([prompts[1]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                         use_tqdm=False)
    force_preemptions(engine)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True),
                        use_tqdm=False)
    assert_pool_clean(engine)
    sched = engine.scheduler
    assert sched.num_preemptions > 0 and engine.kv.prefix_hits > 0
    if mode == "swap":
        assert sched.num_swapped_out_blocks > 0 and sched.num_recomputed > 0
    assert max(len(p) for p in prompts) + 160 > 12 * 16
    assert first[0].outputs[0].token_ids == expected[1][:4]
    for i, (o, e) in enumerate(zip(outs, expected)):
        assert o.outputs[0].token_ids == e, f"prompt {i} ({len(prompts[i])} tokens) diverges"
