"""Faults inside the engine that must stay local: a failed step leaves nothing behind that a
later request could read, an error after the forward ends only its own request, and the
counters stay true."""

from __future__ import annotations

import random

import pytest

from pageserve.runtime import SamplingParams
from pageserve.runtime.engine import RequestFailedError, StepFailed
from tests.test_prefix_and_swap import assert_all_free, tiny, token_ids

pytestmark = pytest.mark.engine

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _fail_next_step(engine) -> None:
    """The next step that runs requests raises, as a GPU out-of-memory would."""
    real = engine.runner.execute

    def execute(out):
        if not out.requests:
            return real(out)
        engine.runner.execute = real
        raise RuntimeError("injected fault")
    engine.runner.execute = execute


def _run(engine) -> tuple[dict, dict]:
    """Step until idle: (final outputs, failures) by request id."""
    outputs, failures = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        failures.update(engine.take_failures())
    return outputs, failures


@pytest.mark.parametrize("chunk", [128, 48])
def test_a_failed_step_leaves_no_unwritten_block_findable(tiny_model_dir, chunk):
    """A 100-token prompt whose step raises, then the same prompt again: the tokens of a clean
    engine. With chunk 48 the first chunk succeeds (its blocks are written and may be hit) and
    the second fails."""
    prompt = [random.Random(1).randrange(3, 384) for _ in range(100)]
    expected = token_ids(tiny(tiny_model_dir, blocks=100).generate(prompt, GREEDY, use_tqdm=False))
    llm = tiny(tiny_model_dir, blocks=100, max_num_batched_tokens=chunk)
    engine = llm.engine
    rid = engine.add_request(prompt, GREEDY)
    if chunk < len(prompt):
        engine.step()
        assert engine.kv.pool.counts()[2] == len(engine.kv.block_ids(rid))
    _fail_next_step(engine)
    with pytest.raises(StepFailed):
        engine.step()
    num_cached = engine.kv.pool.counts()[1]
    assert token_ids(llm.generate(prompt, GREEDY, use_tqdm=False)) == expected
    written = 16 * (chunk // 16) if chunk < len(prompt) else 0
    assert num_cached == written // 16  # findable: only blocks that a finished step wrote
    assert engine.kv.prefix_hits == written
    assert_all_free(llm)


def test_a_failed_fork_copy_fails_only_its_request(tiny_model_dir):
    """n = 2 forks after the prompt by copying the partial block; when that copy raises, only
    the n = 2 request ends (with an error), the other one finishes as if alone."""
    llm = tiny(tiny_model_dir, blocks=100)
    engine = llm.engine
    other = [5, 6, 7, 8, 9]
    expected = token_ids(llm.generate(other, GREEDY, use_tqdm=False))

    def broken_copy(pairs):
        raise RuntimeError("injected copy fault")
    engine.runner.copy_blocks = broken_copy
    forked = engine.add_request(list(range(3, 23)), SamplingParams(n=2, temperature=0.8, max_tokens=8))
    alone = engine.add_request(other, GREEDY)
    outputs, failures = _run(engine)
    assert set(failures) == {forked} and isinstance(failures[forked], RequestFailedError)
    assert "injected copy fault" in str(failures[forked])
    assert set(outputs) == {alone} and outputs[alone].outputs[0].token_ids == expected[0]
    assert engine.counters.finished == {"abort": 1, "length": 2}  # the reference run and `alone`
    assert_all_free(llm)
    del engine.runner.copy_blocks
    assert len(llm.generate(list(range(3, 23)), SamplingParams(n=2, max_tokens=4))[0].outputs) == 2


def test_an_output_error_fails_only_its_request(tiny_model_dir):
    """A detokenizer (or grammar matcher) that raises on one request's token."""
    llm = tiny(tiny_model_dir, blocks=100)
    engine = llm.engine
    expected = token_ids(llm.generate([5, 6, 7], GREEDY, use_tqdm=False))
    bad = engine.add_request([9, 10, 11], GREEDY)
    good = engine.add_request([5, 6, 7], GREEDY)

    class Broken:
        def add_token(self, *args):
            raise UnicodeError("injected detokenizer fault")
    engine.requests[bad].detokenizer = Broken()
    outputs, failures = _run(engine)
    assert set(failures) == {bad} and "injected detokenizer fault" in str(failures[bad])
    assert set(outputs) == {good} and outputs[good].outputs[0].token_ids == expected[0]
    assert_all_free(llm)


def test_recomputed_prompts_are_counted_once(tiny_model_dir):
    """Prompt tokens computed are counted once per request, even for the forked sequences of
    n > 1 requests that are preempted and recomputed (prefix caching off: no hit to discount)."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 384) for _ in range(rng.randrange(40, 120))] for _ in range(8)]
    params = SamplingParams(n=3, temperature=0.8, max_tokens=40, ignore_eos=True)
    llm = tiny(tiny_model_dir, blocks=40, preemption_mode="recompute", enable_prefix_caching=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs) == 3 for o in outs)
    assert llm.engine.scheduler.num_recomputed > 0
    assert llm.engine.counters.prompt_tokens == sum(len(p) for p in prompts)
    assert_all_free(llm)
