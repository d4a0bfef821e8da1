"""Engine behaviour on the tiny model: bad input, continuous batching, stops, memory."""

import pytest

from pageserve.runtime import LLM, SamplingParams
from pageserve.runtime.engine_args import EngineArgs
from pageserve.runtime.engine import LLMEngine
from pageserve.sampling.params import RequestOutputKind
from tests.conftest import assert_pool_clean

pytestmark = pytest.mark.engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("prompt,params,match", [
    ([1] * 2000, GREEDY, r"maximum context length is 1024 tokens\. However, your request has 2000"),
    ([1] * 1024, GREEDY, r"maximum context length is 1024 tokens\. However, your request has 1024"),
    ("", GREEDY, "empty"),
    ([], GREEDY, "empty"),
    ([5, 99999], GREEDY, r"token id 99999 is outside the vocabulary \(valid ids are 0 to 383\)"),
    ([5, -1], GREEDY, "token id -1"),
])
def test_bad_prompt_is_refused_before_the_engine(tiny_llm, prompt, params, match):
    engine = tiny_llm.engine
    good = engine.add_request([5, 6, 7], GREEDY)
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, params)
    with pytest.raises(ValueError, match="prompt 1: "):
        tiny_llm.generate([[8, 9], prompt], params, use_tqdm=False)
    # the good request is unaffected and the engine keeps serving
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == [good] and len(done[0].outputs[0].token_ids) == 8
    assert_pool_clean(engine)


@pytest.mark.parametrize("field,value,match", [
    ("max_tokens", 0, r"max_tokens must be >= 1, got 0"),
    ("max_tokens", 2.5, r"max_tokens must be an integer, got 2.5"),
    ("temperature", -0.5, r"temperature must be in \[0, 10000\], got -0.5"),
    ("temperature", "hot", r"temperature must be a finite number"),
    ("seed", -1, r"seed must be an integer"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\], got 0.0"),
    ("top_k", -3, r"top_k must be -1"),
    ("output_kind", 7, r"output_kind must be one of \['CUMULATIVE', 'DELTA', 'FINAL_ONLY'\], got 7"),
])
def test_bad_sampling_params(field, value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{field: value})


def test_output_kind_given_as_its_value_is_the_member():
    """The engine tells a final-only request by identity with the member."""
    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY


def test_requests_join_and_leave_at_any_step(tiny_llm):
    engine = tiny_llm.engine
    long_id = engine.add_request(list(range(3, 200)), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.step()
    short_id = engine.add_request([10, 11, 12], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    finished_at = {}
    step = 1
    while engine.has_unfinished_requests():
        step += 1
        for out in engine.step():
            if not out.finished:
                continue
            finished_at[out.request_id] = step
            assert engine.kv.block_ids(out.request_id) == []  # its blocks are freed at once
    # the short request joined the long one mid-prefill and left long before it
    assert finished_at[short_id] < finished_at[long_id]
    assert_pool_clean(engine)



def test_a_one_token_embedding_between_decodes_samples_nothing(tiny_llm):
    """A step of one token per request (the runner's decode path) with an embedding request among
    them: its row is not sampled, and the requests after it get their own tokens."""
    engine = tiny_llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in tiny_llm.generate([[7, 8, 9], [40]], params, use_tqdm=False)]
    first = engine.add_request([7, 8, 9], params)
    engine.step()  # its prompt; it decodes from here on
    pooled, last = engine.add_embedding_request([5]), engine.add_request([40], params)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert [outs[first].outputs[0].token_ids, outs[last].outputs[0].token_ids] == alone
    assert outs[pooled].embedding is not None
    assert_pool_clean(engine)

def test_batched_output_equals_alone(tiny_llm):
    prompts = [list(range(3, 3 + n)) for n in (4, 70, 130, 9)]
    together = tiny_llm.generate(prompts, GREEDY, use_tqdm=False)
    alone = [tiny_llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    assert_pool_clean(tiny_llm.engine)


def test_stop_token_ids_and_eos(tiny_llm):
    free_run = tiny_llm.generate([5, 6, 7], GREEDY, use_tqdm=False)[0].outputs[0]
    stop_at = free_run.token_ids[3]
    first = free_run.token_ids.index(stop_at)
    out = tiny_llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                      stop_token_ids=[stop_at]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free_run.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    eos = tiny_llm.engine.config.model.eos_token_ids[0]
    runs = tiny_llm.generate([[t, t + 1] for t in range(3, 60)],
                             SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    for r in runs:
        o = r.outputs[0]
        assert (o.finish_reason == "stop") == (eos in o.token_ids)
        assert eos not in o.token_ids[:-1]
    assert_pool_clean(tiny_llm.engine)


def test_seeded_sampling_is_reproducible(tiny_model_dir):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=12, ignore_eos=True)
    a = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=0.01, seed=3)
    b = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=0.01, seed=3)
    prompts = [[5, 6, 7], [8, 9]]
    outs_a = [o.outputs[0].token_ids for o in a.generate(prompts, params, use_tqdm=False)]
    outs_b = [o.outputs[0].token_ids for o in b.generate(prompts, params, use_tqdm=False)]
    assert outs_a == outs_b  # same engine seed, same batch: same draws
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    greedy_outs = [o.outputs[0].token_ids for o in a.generate(prompts, greedy, use_tqdm=False)]
    assert outs_a != greedy_outs  # sampling is not greedy in disguise


def test_request_seed_ignores_the_rest_of_the_batch(tiny_llm):
    seeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=1234)
    other = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    alone = tiny_llm.generate([5, 6, 7], seeded, use_tqdm=False)[0].outputs[0].token_ids
    crowd = tiny_llm.generate([[9, 9], [5, 6, 7], [10, 11, 12]], [other, seeded, other],
                              use_tqdm=False)[1].outputs[0].token_ids
    assert alone == crowd
    reseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=99)
    assert tiny_llm.generate([5, 6, 7], reseeded, use_tqdm=False)[0].outputs[0].token_ids != alone
    tiny_llm.engine.step()  # the next step tells the runner which requests finished
    assert not tiny_llm.engine.runner.seeded  # their generators are dropped


def test_chat_applies_template(tiny_llm):
    msgs = [{"role": "user", "content": "hello"}]
    ids = tiny_llm.apply_chat_template(msgs)
    assert tiny_llm.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    out = tiny_llm.chat(msgs, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids and len(out.outputs[0].token_ids) == 8


def test_kv_pool_follows_memory_budget(tiny_model_dir):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), dtype="float32",
                                                   kv_cache_memory=0.001, block_size=8))
    cfg = engine.config.model
    block_bytes = 2 * cfg.num_layers * 8 * cfg.num_kv_heads * cfg.head_dim * 4
    assert engine.config.cache.num_blocks == (1 << 30) // 1000 // block_bytes
    storage = engine.runner._kv_storage
    assert storage.numel() * storage.element_size() <= 0.001 * (1 << 30)


def test_huge_top_k_and_tiny_temperature_are_safe(tiny_llm):
    huge = SamplingParams(temperature=0.8, top_k=2 ** 62, max_tokens=4, ignore_eos=True)
    assert len(tiny_llm.generate([5, 6], huge, use_tqdm=False)[0].outputs[0].token_ids) == 4
    tiny_t = SamplingParams(temperature=1e-30, max_tokens=6, ignore_eos=True)
    assert tiny_t.greedy
    assert (tiny_llm.generate([5, 6], tiny_t, use_tqdm=False)[0].outputs[0].token_ids
            == tiny_llm.generate([5, 6], GREEDY, use_tqdm=False)[0].outputs[0].token_ids[:6])


@pytest.mark.parametrize("args,match", [
    ({"block_size": 0}, "block_size must be 8, 16 or 32"),
    ({"num_threads": -1}, "num_threads must be > 0"),
    ({"max_model_len": 0}, "max_model_len must be >= 2"),
    ({"kv_cache_memory": 0}, "kv_cache_memory must be > 0"),
    ({"swap_space": -1}, "swap_space must be >= 0"),
])
def test_bad_engine_args_fail_before_loading(args, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model="/nonexistent", **args)


def test_single_dict_and_tuple_prompts(tiny_llm):
    one = tiny_llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)
    assert len(one) == 1 and one[0].prompt_token_ids == [5, 6, 7]
    assert len(tiny_llm.generate((5, 6, 7), GREEDY, use_tqdm=False)) == 1
    with pytest.raises(ValueError, match="not int"):
        tiny_llm.generate([[5], 3], GREEDY, use_tqdm=False)


def test_max_model_len_is_checked(tiny_model_dir):
    with pytest.raises(ValueError, match=r"max_model_len \(4096\) is larger than the model's own limit \(1024\)"):
        LLM(str(tiny_model_dir), max_model_len=4096)
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        LLM(str(tiny_model_dir), kv_cache_memory=1e-5)


def test_stats_snapshot_starts_at_zero_after_warm_up(tiny_model_dir):
    from pageserve.runtime import LLM

    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=0.01, max_num_batched_tokens=64)
    s = llm.engine.stats()
    assert (s.steps, s.prompt_tokens, s.generation_tokens, s.finished) == (0, 0, 0, {})
    assert (s.scheduler.num_running, s.scheduler.kv_cache_usage, s.scheduler.prefix_cache_queries) == (0, 0.0, 0)
    llm.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                 use_tqdm=False)
    s = llm.engine.stats()
    assert (s.prompt_tokens, s.generation_tokens, s.finished) == (6, 6, {"length": 2})
    assert s.scheduler.prefix_cache_queries == 6 and s.steps == 3
    s.finished["length"] = 99  # a copy: the engine's counters are not touched
    assert llm.engine.stats().finished == {"length": 2}


def test_kv_waste_is_the_share_of_held_slots_without_a_token(tiny_llm):
    """The KV waste metric: per step, the allocated slots not holding a computed token over the
    allocated slots (a 20-token prompt in two 16-token blocks: 12 of 32)."""
    engine = tiny_llm.engine
    c = engine.counters
    assert engine.kv.block_size == 16 and not engine.scheduler.running
    engine.add_request(list(range(300, 320)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    waste, steps = c.kv_waste_sum, c.kv_waste_steps
    engine.step()  # the whole prompt
    assert c.kv_waste_steps == steps + 1 and c.kv_waste_sum - waste == pytest.approx(12 / 32)
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_clean(engine)
