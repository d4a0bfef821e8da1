"""--reasoning-parser through the real server, on a scripted model that "thinks" (tests/scripted.py:
whatever the prompt, it writes a fixed script unless a grammar forbids it): chat completions give
the thinking as message.reasoning_content / reasoning and stream it as delta.reasoning_content /
reasoning; the Responses API gives a reasoning item and its reasoning_text events; content never
holds a piece of a tag; a grammar (response_format, text.format, forced tool calls) applies from
the end of the thinking on, so the thinking stays as scripted while the answer obeys the grammar."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.scripted import (QWEN3_STYLE_TEMPLATE, R1_STYLE_TEMPLATE, build_scripted_model, scripted_server,
                            write_script)

pytestmark = pytest.mark.server

NODE_DIR = Path(__file__).resolve().parent / "node"
THOUGHT = "I should answer in JSON"
ANSWER = "maybe"  # what the grammars below forbid
SCRIPT = f"<think>{THOUGHT}</think>{ANSWER}"
YES_NO = {"type": "object", "properties": {"a": {"type": "string", "enum": ["yes", "no"]}}, "required": ["a"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = build_scripted_model(tmp_path_factory.mktemp("qwen3-think"), SCRIPT, chat_template=QWEN3_STYLE_TEMPLATE)
    srv = scripted_server(path, {"max_model_len": 1024, "kv_cache_memory": 0.02}, reasoning_parser="qwen3")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def r1(tmp_path_factory):
    path = build_scripted_model(tmp_path_factory.mktemp("r1-think"), f"{THOUGHT}</think>{ANSWER}",
                                chat_template=R1_STYLE_TEMPLATE)
    srv = scripted_server(path, reasoning_parser="deepseek_r1")
    yield srv
    srv.stop()


def post(srv, path: str, body: dict) -> dict:
    r = httpx.post(f"{srv.url}/v1/{path}", json={"model": srv.model, "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def events(srv, path: str, body: dict) -> list[dict]:
    body = {"model": srv.model, "temperature": 0, "stream": True, **body}
    with httpx.stream("POST", f"{srv.url}/v1/{path}", json=body, timeout=60) as r:
        assert r.status_code == 200
        text = r.read().decode()
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def no_tags(*texts) -> bool:
    return not any(t and ("<think" in t or "think>" in t) for t in texts)


def thinking_tokens(srv) -> int:
    r = httpx.post(f"{srv.url}/tokenize", json={"prompt": f"<think>{THOUGHT}</think>", "add_special_tokens": False})
    return r.json()["count"]


USER = [{"role": "user", "content": "Is it?"}]


def test_responses_reasoning_item_whole_and_streamed(qwen3):
    whole = post(qwen3, "responses", {"input": "Is it?"})
    assert [o["type"] for o in whole["output"]] == ["reasoning", "message"]
    assert whole["output"][0]["content"] == [{"type": "reasoning_text", "text": THOUGHT}]
    assert whole["output"][1]["content"][0]["text"] == ANSWER
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == thinking_tokens(qwen3)
    assert whole["status"] == "completed"

    evs = events(qwen3, "responses", {"input": "Is it?"})
    kinds = [e["type"] for e in evs]
    first_text = kinds.index("response.output_text.delta")
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert evs[2]["item"]["type"] == "reasoning" and evs[3]["part"]["type"] == "reasoning_text"
    reasoning_end = kinds.index("response.reasoning_text.done")
    assert set(kinds[4:reasoning_end]) == {"response.reasoning_text.delta"}
    assert kinds[reasoning_end:reasoning_end + 5] == [
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added"]
    assert first_text == reasoning_end + 5 and kinds[-1] == "response.completed"
    deltas = [e["delta"] for e in evs if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == THOUGHT == evs[reasoning_end]["text"] and no_tags(*deltas)
    text = [e["delta"] for e in evs if e["type"] == "response.output_text.delta"]
    assert "".join(text) == ANSWER and no_tags(*text)
    assert evs[-1]["response"]["output"] == [{**o, "id": e["id"]} for o, e in
                                             zip(whole["output"], evs[-1]["response"]["output"])]
    qwen3.wait_idle()


def test_responses_text_format_applies_after_the_thinking(qwen3):
    r = post(qwen3, "responses", {"input": "Is it?", "max_output_tokens": 60,
                                  "text": {"format": {"type": "json_schema", "name": "a", "schema": YES_NO}}})
    assert r["output"][0]["content"][0]["text"] == THOUGHT  # the thinking is as scripted, unconstrained
    assert json.loads(r["output"][1]["content"][0]["text"])["a"] in ("yes", "no")  # the answer obeys
    qwen3.wait_idle()


def test_chat_reasoning_whole_and_streamed(qwen3):
    whole = post(qwen3, "chat/completions", {"messages": USER})
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"] == message["reasoning"] == THOUGHT
    assert message["content"] == ANSWER and whole["choices"][0]["finish_reason"] == "stop"
    # the thinking's share of the completion, as vLLM and OpenAI report it
    assert whole["usage"]["completion_tokens_details"] == {"reasoning_tokens": thinking_tokens(qwen3)}

    chunks = events(qwen3, "chat/completions", {"messages": USER, "n": 2, "seed": 1,
                                                "stream_options": {"include_usage": True}})
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2 * thinking_tokens(qwen3)}
    for index in (0, 1):
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        thought = [d["reasoning_content"] for d in deltas if "reasoning_content" in d]
        assert [d["reasoning"] for d in deltas if "reasoning" in d] == thought
        content = [d["content"] for d in deltas if d.get("content")]
        assert "".join(thought) == THOUGHT and "".join(content) == ANSWER
        assert len(thought) > 1 and no_tags(*thought, *content)
        assert not any("reasoning_content" in d and d.get("content") for d in deltas)  # one kind per delta
    qwen3.wait_idle()


def test_chat_grammars_apply_after_the_thinking(qwen3):
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": YES_NO}}
    message = post(qwen3, "chat/completions", {"messages": USER, "response_format": fmt,
                                               "max_tokens": 60})["choices"][0]["message"]
    assert message["reasoning_content"] == THOUGHT and json.loads(message["content"])["a"] in ("yes", "no")

    tools = [{"type": "function", "function": {"name": "decide", "parameters": YES_NO}}]
    choice = post(qwen3, "chat/completions", {"messages": USER, "tools": tools, "tool_choice": "required",
                                              "parallel_tool_calls": False, "max_tokens": 120})["choices"][0]
    assert choice["message"]["reasoning_content"] == THOUGHT and choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "decide" and json.loads(call["arguments"])["a"] in ("yes", "no")
    assert no_tags(choice["message"]["content"])

    # enable_thinking false: the template closes the think block in the prompt, so the grammar
    # governs from the first token and there is no reasoning at all
    off = post(qwen3, "chat/completions", {"messages": USER, "response_format": fmt, "max_tokens": 60,
                                           "chat_template_kwargs": {"enable_thinking": False}})
    message = off["choices"][0]["message"]
    assert message["reasoning_content"] is None and json.loads(message["content"])["a"] in ("yes", "no")
    qwen3.wait_idle()


def test_reasoning_effort_reaches_the_template(qwen3):
    """A reasoning effort (chat's reasoning_effort, the Responses API's reasoning.effort,
    Messages' output_config.effort) reaches the template as reasoning_effort, with
    enable_thinking false for "none" (this template then closes the think block: no reasoning,
    the scripted tags are content) and true otherwise; chat_template_kwargs win."""
    tok = qwen3.engine.tokenizer

    def rendered(**variables) -> int:  # the prompt's tokens, rendered here with these variables
        text = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True, **variables)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    def chat(**fields) -> dict:
        return post(qwen3, "chat/completions", {"messages": USER, "max_tokens": 40, **fields})

    assert rendered(reasoning_effort="low") != rendered() != rendered(enable_thinking=False)
    for effort in ("low", "xhigh", "max"):
        r = chat(reasoning_effort=effort)
        assert r["usage"]["prompt_tokens"] == rendered(reasoning_effort=effort, enable_thinking=True)
        assert r["choices"][0]["message"]["reasoning_content"] == THOUGHT
    r = chat(reasoning_effort="none")
    assert r["usage"]["prompt_tokens"] == rendered(reasoning_effort="none", enable_thinking=False)
    assert r["choices"][0]["message"]["reasoning_content"] is None
    assert r["choices"][0]["message"]["content"] == SCRIPT
    r = chat(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True, "reasoning_effort": "high"})
    assert r["usage"]["prompt_tokens"] == rendered(reasoning_effort="high", enable_thinking=True)
    assert r["choices"][0]["message"]["reasoning_content"] == THOUGHT

    r = post(qwen3, "responses", {"input": "Is it?", "reasoning": {"effort": "none"}, "max_output_tokens": 40})
    assert [item["type"] for item in r["output"]] == ["message"]
    assert r["reasoning"]["effort"] == "none"
    r = post(qwen3, "responses", {"input": "Is it?", "reasoning": {"effort": "medium"}, "max_output_tokens": 40})
    assert [item["type"] for item in r["output"]] == ["reasoning", "message"]
    assert r["usage"]["input_tokens"] == rendered(reasoning_effort="medium", enable_thinking=True)

    def prompt(usage: dict) -> int:  # Messages counts the prefix cache's tokens apart
        return usage["input_tokens"] + usage["cache_read_input_tokens"]

    r = post(qwen3, "messages", {"messages": USER, "max_tokens": 40, "output_config": {"effort": "low"}})
    assert prompt(r["usage"]) == rendered(reasoning_effort="low", enable_thinking=True)
    r = post(qwen3, "messages", {"messages": USER, "max_tokens": 40, "output_config": {"effort": "high"},
                                 "thinking": {"type": "disabled"}})
    assert prompt(r["usage"]) == rendered(reasoning_effort="high", enable_thinking=False)
    assert [b["type"] for b in r["content"]] == ["text"]
    r = httpx.post(f"{qwen3.url}/v1/chat/completions", timeout=60,
                   json={"model": qwen3.model, "messages": USER, "reasoning_effort": "extreme"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
    qwen3.wait_idle()


def test_r1_template_opens_the_thinking(r1):
    message = post(r1, "chat/completions", {"messages": USER})["choices"][0]["message"]
    assert message["reasoning_content"] == THOUGHT and message["content"] == ANSWER
    chunks = events(r1, "chat/completions", {"messages": USER})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == THOUGHT
    assert "".join(d.get("content", "") for d in deltas) == ANSWER
    r = post(r1, "responses", {"input": "Is it?"})
    assert [o["type"] for o in r["output"]] == ["reasoning", "message"]
    assert r["output"][0]["content"][0]["text"] == THOUGHT
    r1.wait_idle()


def test_thinking_token_budget_bounds_the_thinking(qwen3, r1, tiny_server):
    """vLLM's thinking_token_budget: after that many tokens of thinking the engine writes
    `</think>` and the answer follows (here the rest of the script, which the budget cut), whole
    and streamed, also with a grammar; a budget the thinking does not reach changes nothing; a
    server without a reasoning parser refuses it."""
    for srv, opener in ((qwen3, 1), (r1, 0)):
        script = srv.engine.runner.script
        head = srv.engine.tokenizer.decode(script[opener:opener + 3])  # the first 3 tokens of thinking
        message = post(srv, "chat/completions", {"messages": USER, "thinking_token_budget": 3,
                                                 "max_tokens": 40})["choices"][0]["message"]
        assert message["reasoning_content"] == head and message["content"], message
        chunks = events(srv, "chat/completions", {"messages": USER, "thinking_token_budget": 3, "max_tokens": 40})
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == head
        assert "".join(d.get("content") or "" for d in deltas) == message["content"]
        whole = post(srv, "chat/completions", {"messages": USER, "thinking_token_budget": 100})
        assert whole["choices"][0]["message"]["reasoning_content"] == THOUGHT
        fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": YES_NO}}
        bounded = post(srv, "chat/completions", {"messages": USER, "response_format": fmt, "max_tokens": 60,
                                                 "thinking_token_budget": 2})["choices"][0]["message"]
        assert bounded["reasoning_content"] == srv.engine.tokenizer.decode(script[opener:opener + 2])
        assert json.loads(bounded["content"])["a"] in ("yes", "no")
        srv.wait_idle()
    r = httpx.post(f"{tiny_server.url}/v1/chat/completions", timeout=60, json={
        "model": tiny_server.model, "messages": USER, "thinking_token_budget": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget"


def test_output_text_logprobs_and_reasoning_tokens_leave_the_thinking_out(qwen3):
    """The thinking's tokens are counted as reasoning_tokens and carry no output_text logprobs,
    whole or streamed."""
    body = {"input": "Is it?", "top_logprobs": 2, "include": ["message.output_text.logprobs"]}
    whole = post(qwen3, "responses", body)
    part = whole["output"][1]["content"][0]
    usage = whole["usage"]
    assert usage["output_tokens_details"]["reasoning_tokens"] == thinking_tokens(qwen3)
    # one per answer token, the end-of-turn token included
    assert part["text"] == ANSWER and len(part["logprobs"]) == usage["output_tokens"] - thinking_tokens(qwen3)
    assert "".join(lp["token"] for lp in part["logprobs"]).startswith(ANSWER)
    evs = events(qwen3, "responses", body)
    streamed = [lp for e in evs if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    assert [lp["token"] for lp in streamed] == [lp["token"] for lp in part["logprobs"]]
    assert evs[-1]["response"]["usage"] == whole["usage"]
    qwen3.wait_idle()


TAGGED_CALL = '{"name": "note", "arguments": {"text": "<think>not a thought</think>"}}'


@pytest.fixture(scope="module")
def qwen3_tools(tmp_path_factory):
    """Qwen3 answering with a tool call (no thinking) whose arguments hold the think tags' text,
    spelled in ordinary tokens (a grammar never writes the added tag tokens)."""
    from transformers import AutoTokenizer

    path = build_scripted_model(tmp_path_factory.mktemp("qwen3-tools"), "", chat_template=QWEN3_STYLE_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(path)
    at, end = TAGGED_CALL.index("<think>"), TAGGED_CALL.index("</think>")
    pieces = ["<tool_call>\n" + TAGGED_CALL[:at + 1], TAGGED_CALL[at + 1:end + 1], TAGGED_CALL[end + 1:] + "\n</tool_call>"]
    write_script(path, [i for piece in pieces for i in tok.encode(piece, add_special_tokens=False)])
    srv = scripted_server(path, {"max_model_len": 1024, "kv_cache_memory": 0.02}, reasoning_parser="qwen3",
                          tool_call_parser="hermes", enable_auto_tool_choice=True)
    yield srv
    srv.stop()


NOTE = [{"type": "function", "name": "note", "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}]


def test_think_tags_inside_a_tool_call_stay_in_its_arguments(qwen3_tools):
    """A think block opens only at the start of the output: tags inside a call's arguments are
    arguments, whole and streamed."""
    body = {"input": "Note it", "tools": NOTE, "max_output_tokens": 200}
    whole = post(qwen3_tools, "responses", body)
    assert whole["status"] == "completed", whole["usage"]
    assert [(o["type"], o["status"]) for o in whole["output"]] == [("function_call", "completed")]
    assert json.loads(whole["output"][0]["arguments"]) == json.loads(TAGGED_CALL)["arguments"]
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
    evs = events(qwen3_tools, "responses", body)
    done = [e["item"] for e in evs if e["type"] == "response.output_item.done"]
    assert [(d["type"], d["status"], d["arguments"]) for d in done] == [
        (o["type"], o["status"], o["arguments"]) for o in whole["output"]]
    assert evs[-1]["type"] == "response.completed"

    tools = [{"type": "function", "function": {k: v for k, v in NOTE[0].items() if k != "type"}}]
    chat = post(qwen3_tools, "chat/completions", {"messages": USER, "tools": tools, "max_tokens": 200})
    message = chat["choices"][0]["message"]
    assert message["reasoning_content"] is None and not message["content"]
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [
        json.loads(TAGGED_CALL)["arguments"]]
    qwen3_tools.wait_idle()


def test_an_answer_that_does_not_think_is_constrained_from_its_first_token(qwen3_tools):
    """qwen3 with thinking on in the prompt, but the model answers at once: its first token is
    not <think>, so response_format governs from there (it used to wait for a </think> that
    never came, leaving the answer unconstrained)."""
    runner = qwen3_tools.engine.runner
    real = runner.script
    runner.script = qwen3_tools.engine.tokenizer.encode('{"a": "maybe"}', add_special_tokens=False)
    try:
        fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": YES_NO}}
        message = post(qwen3_tools, "chat/completions", {"messages": USER, "response_format": fmt,
                                                         "max_tokens": 60})["choices"][0]["message"]
        assert message["reasoning_content"] is None and json.loads(message["content"])["a"] in ("yes", "no")
        qwen3_tools.wait_idle()
    finally:
        runner.script = real


@pytest.mark.unit
def test_past_thinking_reaches_the_template_as_reasoning_content():
    from pageserve.app.protocol import ChatMessage
    from pageserve.app.responses import chat_messages
    from pageserve.app.tools import tool_format

    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Is it?"}]},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": THOUGHT}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": ANSWER}]},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "lost"}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Sure?"}]}]
    messages = chat_messages(None, items)
    assert [(m.role, m.reasoning_content) for m in messages] == [("user", None), ("assistant", THOUGHT),
                                                                ("user", None)]
    dicts, _ = tool_format(None).chat_dicts(
        [*messages, ChatMessage(role="assistant", content="x", reasoning="newer name")], None, "")
    assert dicts[1]["reasoning_content"] == THOUGHT and dicts[3]["reasoning_content"] == "newer name"
    assert "reasoning_content" not in dicts[0]


def test_ai_sdk_reads_the_thinking(qwen3):
    node = shutil.which("node")
    assert node, "node is needed for this test (make test installs the npm packages)"
    proc = subprocess.run([node, str(NODE_DIR / "reasoning.mjs"), f"{qwen3.url}/v1", qwen3.model],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # reasoningEffort "none": the template closed the think block, so the scripted tags are content
    assert out == {"streamedReasoning": THOUGHT, "streamedText": ANSWER, "reasoning": THOUGHT, "text": ANSWER,
                   "offReasoning": None, "offText": SCRIPT}
    qwen3.wait_idle()
