"""Prefix caching and preemption (swap and recompute) on the tiny model: same outputs under
pressure, nothing lost, blocks shared exactly when they should be."""

import random

import pytest

from pageserve.runtime import LLM, SamplingParams
from pageserve.runtime.request import RequestStatus
from tests.conftest import assert_pool_clean

pytestmark = pytest.mark.engine

GiB = 1 << 30
TINY_BLOCK_BYTES = 2 * 2 * 2 * 16 * 16 * 4  # layers, K/V, kv heads, block size, head dim, fp32


def tiny(model_dir, blocks, swap_blocks=0, **kw):
    kw.setdefault("max_num_batched_tokens", 128)
    return LLM(str(model_dir), dtype="float32", kv_cache_memory=blocks * TINY_BLOCK_BYTES / GiB,
               swap_space=swap_blocks * TINY_BLOCK_BYTES / GiB, max_model_len=512,
               debug_checks=True, **kw)


def workload(n, seed=0, lo=100, hi=350, out_lo=8, out_hi=48):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 384) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(out_lo, out_hi), ignore_eos=True)
              for _ in range(n)]
    return prompts, params


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def assert_all_free(llm):
    assert_pool_clean(llm.engine)
    swap = llm.engine.scheduler.swap
    assert swap.num_free == swap.num_blocks and not swap.req_blocks


def test_same_greedy_output_under_pressure(tiny_model_dir):
    prompts, params = workload(24)
    roomy = tiny(tiny_model_dir, blocks=2000, enable_prefix_caching=False)
    expected = token_ids(roomy.generate(prompts, params, use_tqdm=False))
    assert roomy.engine.scheduler.num_preemptions == 0
    # room for about two long requests; the swap space holds one short one, so long ones
    # fall back to recompute
    tight = tiny(tiny_model_dir, blocks=40, swap_blocks=14)
    got = token_ids(tight.generate(prompts, params, use_tqdm=False))
    sched = tight.engine.scheduler
    assert sched.num_swapped_out_blocks > 0 and sched.num_swapped_in_blocks == sched.num_swapped_out_blocks
    assert sched.num_recomputed > 0, "the swap space never filled up: no recompute happened"
    assert sched.num_preemptions > 10
    assert got == expected
    assert_all_free(tight)
    recompute = tiny(tiny_model_dir, blocks=40, preemption_mode="recompute")
    assert token_ids(recompute.generate(prompts, params, use_tqdm=False)) == expected
    assert recompute.engine.scheduler.num_swapped_out_blocks == 0
    assert recompute.engine.scheduler.num_recomputed > 10
    assert_all_free(recompute)


def test_prefix_caching_does_not_change_output(tiny_model_dir):
    rng = random.Random(5)
    shared = [rng.randrange(3, 384) for _ in range(200)]
    prompts = [shared + [rng.randrange(3, 384) for _ in range(rng.randrange(1, 40))] for _ in range(12)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = tiny(tiny_model_dir, blocks=400, enable_prefix_caching=False)
    cached = tiny(tiny_model_dir, blocks=400)
    expected = token_ids(plain.generate(prompts, params, use_tqdm=False))
    first = token_ids(cached.generate(prompts, params, use_tqdm=False))
    second = token_ids(cached.generate(prompts, params, use_tqdm=False))  # all from the cache now
    assert first == expected and second == expected
    kv = cached.engine.kv
    assert kv.prefix_hits >= 12 * 192  # 12 full blocks of the shared prefix per request
    assert plain.engine.kv.prefix_hits == 0
    assert_all_free(cached)


def test_two_hundred_requests_all_finish(tiny_model_dir):
    prompts, params = workload(200, seed=1, lo=20, hi=100, out_lo=20, out_hi=120)
    llm = tiny(tiny_model_dir, blocks=60, swap_blocks=30, max_num_seqs=64)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o, p in zip(outs, params):
        assert o.finished and len(o.outputs[0].token_ids) == p.max_tokens
        assert o.outputs[0].finish_reason == "length"
    assert llm.engine.scheduler.num_preemptions > 0
    assert_all_free(llm)


def _run_pair(llm, a, b, salt_a=None, salt_b=None):
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ra = engine.add_request(a, params, cache_salt=salt_a)
    while engine.requests[ra].num_computed_tokens < len(a):
        engine.step()
    blocks_a = engine.kv.block_ids(ra)
    rb = engine.add_request(b, params, cache_salt=salt_b)
    engine.step()
    blocks_b = engine.kv.block_ids(rb)
    while engine.has_unfinished_requests():
        engine.step()
    return blocks_a, blocks_b


def test_shared_prefix_uses_its_blocks_once(tiny_model_dir):
    rng = random.Random(2)
    prefix = [rng.randrange(3, 384) for _ in range(500)]
    a, b = prefix + [7, 8, 9], prefix + [10, 11]
    llm = tiny(tiny_model_dir, blocks=200)
    blocks_a, blocks_b = _run_pair(llm, a, b)
    n_full = 500 // 16
    assert blocks_b[:n_full] == blocks_a[:n_full]
    assert not set(blocks_b[n_full:]) & set(blocks_a)
    assert llm.engine.kv.prefix_hits == n_full * 16
    assert_all_free(llm)

    salted = tiny(tiny_model_dir, blocks=200)
    blocks_a, blocks_b = _run_pair(salted, a, b, salt_a="tenant-a", salt_b="tenant-b")
    assert not set(blocks_a) & set(blocks_b)
    assert salted.engine.kv.prefix_hits == 0
    same_salt = tiny(tiny_model_dir, blocks=200)
    blocks_a, blocks_b = _run_pair(same_salt, a, b, salt_a="tenant-a", salt_b="tenant-a")
    assert blocks_b[:n_full] == blocks_a[:n_full]


def test_abort_of_swapped_request_frees_swap(tiny_model_dir):
    llm = tiny(tiny_model_dir, blocks=40, swap_blocks=40, max_num_batched_tokens=512)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    ids = [engine.add_request(list(range(3, 203)), params) for _ in range(3)]
    for _ in range(200):
        engine.step()
        swapped = [r for r in engine.scheduler.swapped]
        if swapped:
            break
    assert swapped and swapped[0].status == RequestStatus.SWAPPED
    engine.abort_request(swapped[0].request_id)
    engine.check_integrity()
    for rid in ids:
        engine.abort_request(rid)
    assert_all_free(llm)


def test_bad_cache_salt(tiny_llm):
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        tiny_llm.engine.add_request([5, 6], SamplingParams(), cache_salt="")
    with pytest.raises(ValueError, match="exactly one of 'prompt' or 'prompt_token_ids'"):
        tiny_llm.generate([{"prompt": "hi", "prompt_token_ids": [1]}], use_tqdm=False)


def test_same_seeded_output_under_pressure(tiny_model_dir):
    prompts, _ = workload(16, seed=3)
    params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=32, ignore_eos=True, seed=100 + i)
              for i in range(16)]
    roomy = tiny(tiny_model_dir, blocks=2000, enable_prefix_caching=False)
    expected = token_ids(roomy.generate(prompts, params, use_tqdm=False))
    for mode, swap_blocks in (("swap", 14), ("recompute", 0)):
        tight = tiny(tiny_model_dir, blocks=40, swap_blocks=swap_blocks, preemption_mode=mode)
        assert token_ids(tight.generate(prompts, params, use_tqdm=False)) == expected
        assert tight.engine.scheduler.num_preemptions > 0
        assert_all_free(tight)


def test_penalty_rows_are_dropped_at_preemption_and_rebuilt(tiny_model_dir):
    """A preempted request gives its penalty row back (rows never outnumber the running
    sequences, which the CUDA memory profile counts on) and gets one rebuilt from its tokens
    when it runs again: greedy outputs with every penalty match a run without pressure."""
    prompts, _ = workload(16, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, repetition_penalty=1.3,
                             presence_penalty=0.4, frequency_penalty=0.6) for _ in prompts]
    roomy = tiny(tiny_model_dir, blocks=2000, enable_prefix_caching=False)
    expected = token_ids(roomy.generate(prompts, params, use_tqdm=False))
    tight = tiny(tiny_model_dir, blocks=40, swap_blocks=14, max_num_seqs=4)
    runner, engine = tight.engine.runner, tight.engine
    most_rows = []
    execute = runner.execute

    def watch(out):
        result = execute(out)
        most_rows.append(len(runner.counts.rows))
        running = {r.request_id for r in out.requests}
        assert set(runner.counts.rows) <= running | set(engine.requests), "a row outlived its request"
        assert not set(out.preempted) & set(runner.counts.rows)
        return result
    runner.execute = watch
    assert token_ids(tight.generate(prompts, params, use_tqdm=False)) == expected
    assert engine.scheduler.num_preemptions > 0
    assert max(most_rows) <= 4  # max_num_seqs (the last finished row goes back at the next step)
    assert_all_free(tight)
