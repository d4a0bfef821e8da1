"""A bound on a reasoning model's thinking (ThinkingBudget, vLLM's thinking_token_budget): once
the thinking has its tokens the engine writes the end marker, then the answer follows, under
the request's grammar where it has one. Offline on the tiny random-weight model, whose greedy
tokens without a budget are the reference; served on the scripted model that thinks."""

from __future__ import annotations

import pytest

from pageserve.sampling.params import SamplingParams, StructuredOutputsParams, ThinkingBudget

pytestmark = pytest.mark.engine
PROMPT = [5, 6, 7, 8]


def _greedy(llm, **kw) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, **kw)
    return [list(c.token_ids) for c in llm.generate([PROMPT], params, use_tqdm=False)[0].outputs]


def _unused(tokens: list[int], count: int) -> list[int]:
    return [t for t in range(300, 384) if t not in tokens][:count]


def test_the_thinking_ends_at_its_budget(tiny_llm):
    free = _greedy(tiny_llm)[0]
    end = tuple(_unused(free, 2))
    out = _greedy(tiny_llm, thinking_budget=ThinkingBudget(5, end))[0]
    assert out[:7] == free[:5] + list(end)  # five tokens of thinking, then the marker, whole
    assert len(out) == 14  # and the answer after it, within max_tokens
    # a budget the thinking does not reach changes nothing
    assert _greedy(tiny_llm, thinking_budget=ThinkingBudget(20, end))[0] == free
    # a budget of 0 ends the thinking at once
    assert _greedy(tiny_llm, thinking_budget=ThinkingBudget(0, end))[0][:2] == list(end)


def test_an_end_marker_the_model_began_is_finished_not_restarted(tiny_llm):
    """The fifth token of thinking happens to be the marker's first id: the budget writes the
    rest of it, once (a marker restarted would read `</` `</think>`)."""
    free = _greedy(tiny_llm)[0]
    (rest,) = _unused(free, 1)
    out = _greedy(tiny_llm, thinking_budget=ThinkingBudget(5, (free[4], rest)))[0]
    assert out[:6] == free[:5] + [rest]


def test_an_opener_starts_the_count_and_no_opener_means_no_thinking(tiny_llm):
    free = _greedy(tiny_llm)[0]
    end = tuple(_unused(free, 2))
    # the output opens the thinking with its first token: two tokens of thinking after it
    opened = _greedy(tiny_llm, thinking_budget=ThinkingBudget(2, end, start=free[0]))[0]
    assert opened[:5] == free[:3] + list(end)
    # an output that does not open it has no thinking to bound
    (other,) = [t for t in _unused(free, 3) if t not in end]
    assert _greedy(tiny_llm, thinking_budget=ThinkingBudget(2, end, start=other))[0] == free


def test_the_grammar_governs_the_answer_after_a_forced_end(tiny_llm):
    free = _greedy(tiny_llm)[0]
    end = tuple(_unused(free, 2))
    params = SamplingParams(temperature=0.0, max_tokens=30, thinking_budget=ThinkingBudget(3, end),
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    c = tiny_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert list(c.token_ids[:5]) == free[:3] + list(end) and c.finish_reason == "stop"
    answer = tiny_llm.engine.tokenizer.decode(list(c.token_ids[5:]))
    assert answer in ("yes", "no"), answer


def test_each_of_n_sequences_has_its_own_budget(tiny_llm):
    free = _greedy(tiny_llm)[0]
    end = tuple(_unused(free, 2))
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=12, ignore_eos=True,
                            thinking_budget=ThinkingBudget(4, end))
    for c in tiny_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs:
        ids = list(c.token_ids)
        at = next(i for i in range(len(ids) - 1) if tuple(ids[i:i + 2]) == end)
        assert at <= 4, ids  # the marker by the fifth token (sooner only if sampled)


def test_a_thinking_budget_is_checked(tiny_llm):
    from pageserve.runtime.input_processor import InvalidRequest

    with pytest.raises(ValueError, match="integer >= 0"):
        ThinkingBudget(-1, (5,))
    with pytest.raises(ValueError, match="non-empty"):
        ThinkingBudget(3, ())
    with pytest.raises(InvalidRequest, match="thinking_budget"):
        tiny_llm.engine.inputs.process(PROMPT, SamplingParams(thinking_budget=ThinkingBudget(3, (10 ** 6,))))
