"""Grammars that wait for the end of reasoning (StructuredOutputsParams.reasoning_end), on the
scripted model (tests/scripted.py): it writes a fixed script that thinks, ends its thinking,
then writes what the grammar forbids, so the output shows where the mask applies. Also the
scripted model through the real server."""

from __future__ import annotations

import json

import httpx
import pytest

from pageserve.app.reasoning import Qwen3ReasoningParser
from pageserve.grammar.matcher import reasoning_end_position
from pageserve.runtime.input_processor import InvalidRequest
from pageserve.sampling.params import SamplingParams, StructuredOutputsParams
from tests.conftest import assert_pool_clean
from tests.scripted import QWEN3_STYLE_TEMPLATE, build_scripted_model, scripted_llm, scripted_server

GiB = 1 << 30
TINY_BLOCK_BYTES = 2 * 2 * 2 * 16 * 16 * 4  # layers, K/V, kv heads, block size, head dim, fp32
SCRIPT = "<think>I should answer yes</think>maybe"  # the grammar below forbids "maybe"
CHOICE = ["yes", "no"]


@pytest.fixture(scope="module")
def think_model(tmp_path_factory):
    """`</think>` is one added token."""
    return build_scripted_model(tmp_path_factory.mktemp("scripted-think"), SCRIPT,
                                chat_template=QWEN3_STYLE_TEMPLATE)


@pytest.fixture(scope="module")
def llm(think_model):
    return scripted_llm(think_model, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def marker(llm) -> tuple[int, ...]:
    return (llm.tokenizer.convert_tokens_to_ids("</think>"),)


def _choice(reasoning_end=None) -> StructuredOutputsParams:
    return StructuredOutputsParams(choice=CHOICE, reasoning_end=reasoning_end)


def _spy_masks(engine) -> list[tuple[str, int, bool]]:
    """(request id, output position sampled, whether its row was masked) for every sample."""
    seen, real = [], engine.runner.execute

    def spy(step):
        seen.extend((r.request_id, len(r.request_tokens) - r.num_prompt_tokens, r.matcher is not None)
                    for r in step.requests if r.sample)
        return real(step)
    engine.runner.execute = spy
    return seen


@pytest.mark.unit
def test_where_reasoning_ends_in_token_ids():
    assert reasoning_end_position([1, 2, 3, 2, 3], (2, 3)) == 3  # the first end counts
    assert reasoning_end_position([2, 1, 3, 3], (2, 3)) is None  # a false start is not an end
    assert reasoning_end_position([7], (7,)) == 1
    assert reasoning_end_position([], (7,)) is None


@pytest.mark.engine
def test_the_grammar_starts_after_the_end_of_reasoning(llm, marker):
    engine = llm.engine
    script = engine.runner.script
    end = script.index(marker[0]) + 1  # output positions from here on are the grammar's
    reasoning_text = llm.tokenizer.decode(script[:end])

    free = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert free.text == SCRIPT and free.token_ids == script + [engine.config.model.eos_token_ids[0]]
    whole = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=64, structured_outputs=_choice()),
                         use_tqdm=False)[0].outputs[0]
    assert whole.text in CHOICE  # a grammar from the first token forbids the thinking too

    seen = _spy_masks(engine)
    try:
        # a prompt that ends with the marker does not end the output's reasoning
        outs = llm.generate(["Hello", [5, 6, *marker]],
                            SamplingParams(temperature=0, max_tokens=64, structured_outputs=_choice(marker)),
                            use_tqdm=False)
    finally:
        del engine.runner.execute
    for out in outs:
        c = out.outputs[0]
        assert c.token_ids[:end] == script[:end], c.text  # unconstrained up to and with </think>
        assert c.text.startswith(reasoning_text) and c.text[len(reasoning_text):] in CHOICE, c.text
        assert c.finish_reason == "stop"
    masked = {(pos, m) for _, pos, m in seen}
    assert {pos for pos, m in masked if not m} == set(range(end))  # no mask while reasoning
    assert {pos for pos, m in masked if m} == set(range(end, max(pos for pos, _ in masked) + 1))
    assert_pool_clean(engine)


@pytest.mark.engine
def test_n2_sequences_each_wait_for_their_own_end(llm, marker):
    script = llm.engine.runner.script
    end = script.index(marker[0]) + 1
    params = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=64, structured_outputs=_choice(marker))
    out = llm.generate("Hi there", params, use_tqdm=False)[0]
    assert len(out.outputs) == 2
    for c in out.outputs:
        assert c.token_ids[:end] == script[:end]
        assert llm.tokenizer.decode(c.token_ids[end:], skip_special_tokens=True) in CHOICE
    assert_pool_clean(llm.engine)


@pytest.mark.engine
def test_a_reasoning_that_never_ends_is_never_constrained(llm, marker):
    engine = llm.engine
    eos = engine.config.model.eos_token_ids[0]
    real = engine.runner.script
    engine.runner.script = llm.tokenizer.encode("<think>I keep on thinking", add_special_tokens=False)
    try:
        gated = SamplingParams(temperature=0, max_tokens=64, structured_outputs=_choice(marker))
        c = llm.generate("Hello", gated, use_tqdm=False)[0].outputs[0]
        assert c.text == "<think>I keep on thinking" and c.finish_reason == "stop"
        assert c.token_ids == engine.runner.script + [eos]
        cut = SamplingParams(temperature=0, max_tokens=4, structured_outputs=_choice(marker))
        c = llm.generate("Hello", cut, use_tqdm=False)[0].outputs[0]
        assert c.token_ids == engine.runner.script[:4] and c.finish_reason == "length"
        # min_tokens still holds EOS back: the model's own (unconstrained) tokens fill the rest
        n = len(engine.runner.script) + 5
        longer = SamplingParams(temperature=0, max_tokens=64, min_tokens=n, structured_outputs=_choice(marker))
        c = llm.generate("Hello", longer, use_tqdm=False)[0].outputs[0]
        assert c.token_ids[:len(engine.runner.script)] == engine.runner.script
        assert len(c.token_ids) >= n and eos not in c.token_ids[:n]
    finally:
        engine.runner.script = real
    # a stop string inside the reasoning still stops it
    stopped = SamplingParams(temperature=0, max_tokens=64, stop=["answer"], structured_outputs=_choice(marker))
    c = llm.generate("Hello", stopped, use_tqdm=False)[0].outputs[0]
    assert c.text == "<think>I should " and c.finish_reason == "stop" and c.stop_reason == "answer"
    assert_pool_clean(engine)


@pytest.mark.engine
def test_the_first_token_decides_whether_the_grammar_waits(llm, marker):
    """With reasoning_start (qwen3: a think block opens only as the output's first token) the
    first token may be `<think>` (then the grammar waits for `</think>`) or one the grammar
    allows (then it governs from there). Without it, an answer that does not think would never
    be constrained."""
    engine = llm.engine
    opener = llm.tokenizer.convert_tokens_to_ids("<think>")
    real = engine.runner.script
    reasoning_text = SCRIPT[:SCRIPT.index("</think>") + len("</think>")]

    def run(script: str, spec: StructuredOutputsParams):
        engine.runner.script = llm.tokenizer.encode(script, add_special_tokens=False)
        params = SamplingParams(temperature=0, max_tokens=64, structured_outputs=spec)
        return llm.generate(["Hello", "Hi"], params, use_tqdm=False)

    seen = _spy_masks(engine)
    try:
        for out in run(SCRIPT, StructuredOutputsParams(choice=CHOICE, reasoning_end=marker, reasoning_start=opener)):
            text = out.outputs[0].text
            assert text.startswith(reasoning_text) and text[len(reasoning_text):] in CHOICE, text
        assert all(m for _, pos, m in seen if pos == 0)  # the first token is masked: <think> or the grammar's
        for out in run("maybe", StructuredOutputsParams(choice=CHOICE, reasoning_end=marker, reasoning_start=opener)):
            assert out.outputs[0].text in CHOICE  # no thinking: constrained from the first token
        for out in run("maybe", StructuredOutputsParams(choice=CHOICE, reasoning_end=marker)):
            assert out.outputs[0].text == "maybe"  # waiting for a </think> that never comes
    finally:
        engine.runner.script = real
        del engine.runner.execute
    with pytest.raises(ValueError, match="reasoning_start"):
        StructuredOutputsParams(choice=CHOICE, reasoning_start=opener)  # only beside reasoning_end
    assert_pool_clean(engine)


@pytest.mark.engine
def test_parser_and_engine_together(llm):
    """What the app does with --reasoning-parser qwen3: the rendered prompt decides whether the
    grammar waits; the parser splits the output into reasoning and the grammar's content."""
    parser = Qwen3ReasoningParser(llm.tokenizer)
    messages = [{"role": "user", "content": "yes or no?"}]
    for thinking in (True, False):
        prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                   enable_thinking=thinking)
        spec = parser.after_reasoning(_choice(), prompt)
        assert (spec.reasoning_end is not None) == thinking
        assert spec.reasoning_start == (llm.tokenizer.convert_tokens_to_ids("<think>") if thinking else None)
        text = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=64, structured_outputs=spec),
                            use_tqdm=False)[0].outputs[0].text
        reasoning, content = parser.extract(text, prompt)
        assert content in CHOICE
        assert reasoning == ("I should answer yes" if thinking else None), text
    assert_pool_clean(llm.engine)


@pytest.mark.engine
def test_an_end_marker_outside_the_vocabulary_is_refused(llm):
    with pytest.raises(InvalidRequest, match="outside the vocabulary") as e:
        llm.engine.add_request("Hi", SamplingParams(structured_outputs=_choice((10 ** 6,))))
    assert e.value.param == "structured_outputs.reasoning_end"


def _force_preemptions(engine) -> set:
    """Preempt a running request once at each of its output lengths: its first allocation
    there fails, so the scheduler preempts the newest running request (swap or recompute)."""
    fired, real = set(), engine.kv.allocate_slots

    def allocate(req, num_new, *args, **kwargs):
        key = (req.request_id, req.num_output_tokens)
        if req.status.name == "RUNNING" and key not in fired:
            fired.add(key)
            return False
        return real(req, num_new, *args, **kwargs)
    engine.kv.allocate_slots = allocate
    return fired


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory):
    """`</think>` is several BPE tokens; the script holds a false start of it before the real one."""
    from pageserve.loadtest.tiny_model import build_tokenizer

    tok = build_tokenizer(tmp_path_factory.mktemp("plain-tok"))
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    end = enc("</think>")
    assert len(end) > 2
    script = enc("<think>I should") + end[:1] + enc(" so") + end[:-1] + enc(" and") + end + enc("maybe")
    path = build_scripted_model(tmp_path_factory.mktemp("scripted-plain"), script, think_tokens=False)
    return path, tuple(end), script


@pytest.mark.engine
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_at_every_step_with_a_marker_of_several_tokens(plain_model, mode):
    """Preempted before every sample, also between the marker's tokens; recomputed in chunks of
    8 tokens, one of which ends inside the marker: the grammar starts after the whole marker,
    as without preemption, for one sequence and for n = 2."""
    path, end, script = plain_model
    start = next(n for n in range(len(end), len(script) + 1) if tuple(script[n - len(end):n]) == end)
    # a chunk boundary after the marker's first token: its second one starts a chunk
    prompt = list(range(5, 5 + 8 + (-(start - len(end) + 1) % 8)))
    assert (len(prompt) + start - len(end) + 1) % 8 == 0
    swap = 40 * TINY_BLOCK_BYTES / GiB if mode == "swap" else 0
    llm = scripted_llm(path, max_num_batched_tokens=8, preemption_mode=mode, swap_space=swap)
    engine = llm.engine
    params = [SamplingParams(temperature=0, max_tokens=64, structured_outputs=_choice(end)),
              SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=64, structured_outputs=_choice(end))]
    baseline = [[c.token_ids for c in o.outputs] for o in llm.generate([prompt, prompt], params, use_tqdm=False)]
    for outputs in baseline:
        for ids in outputs:
            assert ids[:start] == script[:start]
            assert llm.tokenizer.decode(ids[start:], skip_special_tokens=True) in CHOICE
    fired = _force_preemptions(engine)
    try:
        pressed = [[c.token_ids for c in o.outputs] for o in llm.generate([prompt, prompt], params, use_tqdm=False)]
    finally:
        del engine.kv.allocate_slots
    assert pressed == baseline
    sched = engine.scheduler
    assert sched.num_preemptions >= start and len(fired) >= start
    if mode == "recompute":
        assert sched.num_recomputed >= start and sched.num_swapped_out_blocks == 0
    else:
        assert sched.num_swapped_out_blocks > 0
    assert_pool_clean(engine)


@pytest.mark.server
def test_the_scripted_model_through_the_real_server(think_model):
    srv = scripted_server(think_model)
    try:
        body = {"model": srv.model, "prompt": "Say something", "max_tokens": 64, "temperature": 0}
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == SCRIPT and r.json()["choices"][0]["finish_reason"] == "stop"
        with httpx.stream("POST", f"{srv.url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == SCRIPT
        srv.wait_idle()
    finally:
        srv.stop()
