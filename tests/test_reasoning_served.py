"""--reasoning-parser through the real server, on a scripted model that "thinks" (tests/scripted.py:
whatever the prompt, it writes a fixed script unless a grammar forbids it): chat completions give
the thinking as message.reasoning_content / reasoning and stream it as delta.reasoning_content /
reasoning; the Responses API gives a reasoning item and its reasoning_text events; content never
holds a piece of a tag; a grammar (response_format, text.format, forced tool calls) applies from
the end of the thinking on, so the thinking stays as scripted while the answer obeys the grammar."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.scripted import QWEN3_STYLE_TEMPLATE, R1_STYLE_TEMPLATE, build_scripted_model, scripted_server

pytestmark = pytest.mark.server

THOUGHT = "I should answer in JSON"
ANSWER = "maybe"  # what the grammars below forbid
SCRIPT = f"<think>{THOUGHT}</think>{ANSWER}"
YES_NO = {"type": "object", "properties": {"a": {"type": "string", "enum": ["yes", "no"]}}, "required": ["a"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = build_scripted_model(tmp_path_factory.mktemp("qwen3-think"), SCRIPT, chat_template=QWEN3_STYLE_TEMPLATE)
    srv = scripted_server(path, reasoning_parser="qwen3", enable_auto_tool_choice=True)
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
