"""--stream-interval N (vLLM's flag): a streamed request reports its first token at once, then
every N tokens, and its end at once; what it reports adds up to the same tokens and text. Through
the real server with a reasoning parser and a tool-call parser, the pieces give the same thinking
and the same call as the whole answer (where vLLM's first version lost arguments and the last
thinking tokens)."""

from __future__ import annotations

import json

import httpx
import pytest

from pageserve.runtime import SamplingParams
from pageserve.runtime.config import SchedulerConfig
from pageserve.runtime.engine import LLMEngine
from pageserve.runtime.engine_args import EngineArgs
from pageserve.sampling.params import RequestOutputKind
from tests.scripted import QWEN3_STYLE_TEMPLATE, build_scripted_model, scripted_server


def _run(engine: LLMEngine, params: SamplingParams) -> list:
    rid = engine.add_request([5, 6, 7, 8], params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


@pytest.mark.engine
def test_a_streamed_request_reports_its_first_token_then_every_n_then_its_end(tiny_model_dir):
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), dtype="float32", kv_cache_memory=0.01,
                                                   max_model_len=256, swap_space=0, stream_interval=4))
    base = dict(temperature=0, max_tokens=10, ignore_eos=True)
    whole = _run(engine, SamplingParams(**base))[-1].outputs[0]
    pieces = _run(engine, SamplingParams(**base, output_kind=RequestOutputKind.DELTA))
    assert [len(p.outputs[0].token_ids) for p in pieces] == [1, 4, 4, 1]
    assert [p.finished for p in pieces] == [False, False, False, True]
    assert [t for p in pieces for t in p.outputs[0].token_ids] == whole.token_ids
    assert "".join(p.outputs[0].text for p in pieces) == whole.text
    cumulative = _run(engine, SamplingParams(**base, output_kind=RequestOutputKind.CUMULATIVE))
    assert [len(p.outputs[0].token_ids) for p in cumulative] == [1, 5, 9, 10]
    assert cumulative[-1].outputs[0].text == whole.text


@pytest.mark.unit
def test_the_interval_is_a_positive_integer():
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="--stream-interval must be an integer >= 1"):
            SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=True,
                            stream_interval=bad)


CALL = {"name": "note", "arguments": {"text": "the sky is blue and the grass is green"}}
SCRIPT = f"<think>I should write a note about colours</think><tool_call>\n{json.dumps(CALL)}\n</tool_call>"
NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def thinking_caller(tmp_path_factory):
    path = build_scripted_model(tmp_path_factory.mktemp("stream-interval"), SCRIPT, chat_template=QWEN3_STYLE_TEMPLATE)
    srv = scripted_server(path, {"max_model_len": 1024, "kv_cache_memory": 0.02, "stream_interval": 5},
                          reasoning_parser="qwen3", tool_call_parser="hermes", enable_auto_tool_choice=True)
    yield srv
    srv.stop()


@pytest.mark.server
def test_pieces_of_five_tokens_give_the_whole_answers_thinking_and_call(thinking_caller):
    srv = thinking_caller
    body = {"model": srv.model, "temperature": 0, "max_tokens": 200, "tools": [NOTE],
            "messages": [{"role": "user", "content": "Note the colours"}]}
    whole = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=60).json()
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"] == "I should write a note about colours"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == \
        [(CALL["name"], CALL["arguments"])]
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", timeout=60,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.read().decode().splitlines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
    calls = [call for d in deltas for call in d.get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "note"
    assert json.loads("".join(c["function"].get("arguments") or "" for c in calls)) == CALL["arguments"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"
    tokens = chunks[-1]["usage"]["completion_tokens"]
    assert tokens == whole["usage"]["completion_tokens"]
    assert len(deltas) < tokens / 3  # pieces of five tokens, not one each

    # the Responses API's events from the same pieces: the same thinking and call as its whole answer
    body = {"model": srv.model, "temperature": 0, "max_output_tokens": 200, "input": "Note the colours",
            "tools": [{"type": "function", **NOTE["function"]}]}
    whole = httpx.post(f"{srv.url}/v1/responses", json=body, timeout=60).json()
    with httpx.stream("POST", f"{srv.url}/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.read().decode().splitlines() if line.startswith("data: {")]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [item["type"] for item in done] == [item["type"] for item in whole["output"]] == ["reasoning", "function_call"]
    assert json.loads(done[1]["arguments"]) == json.loads(whole["output"][1]["arguments"]) == CALL["arguments"]
    assert done[0]["content"] == whole["output"][0]["content"]
    assert events[-1]["type"] == "response.completed"
    srv.wait_idle()
