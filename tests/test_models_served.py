"""One chat request per architecture through the real server and the openai client: the
streamed answer is the greedy continuation (HF transformers' own, on the same weights) of the
prompt the model's chat template renders. The tiny models' tokenizer carries a ChatML
template, except where a family's own real template is kept in tests/fixtures/chat_templates
(Gemma 2, which refuses a system turn, and Gemma 3, which folds it into the first user turn)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pageserve.loadtest.tiny_model import ARCHITECTURES, build_tiny_model
from pageserve.runtime.engine_args import EngineArgs
from tests.hf_reference import hf_greedy
from tests.live_server import InProcessServer

pytestmark = pytest.mark.server

MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What does paged attention keep in blocks?"}]
TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
REAL_TEMPLATES = {"gemma2": "gemma2.jinja", "gemma3_text": "gemma3.jinja"}


@pytest.mark.parametrize("arch", sorted(set(ARCHITECTURES) - {"llama"}))
def test_chat_through_the_server(tmp_path, arch):
    from transformers import AutoTokenizer

    model_dir = build_tiny_model(tmp_path / arch, arch=arch)
    tok = AutoTokenizer.from_pretrained(model_dir)
    messages = MESSAGES
    if arch in REAL_TEMPLATES:
        tok.chat_template = (TEMPLATES / REAL_TEMPLATES[arch]).read_text()
        tok.save_pretrained(model_dir)
        tok = AutoTokenizer.from_pretrained(model_dir)
        if arch == "gemma2":
            messages = MESSAGES[1:]
        assert "<start_of_turn>user\n" in tok.apply_chat_template(messages, add_generation_prompt=True,
                                                                   tokenize=False)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    expected = hf_greedy(model_dir, [prompt], max_new_tokens=12)[0]
    assert_served_chat(model_dir, messages, len(prompt), tok.decode(expected, skip_special_tokens=True))


def assert_served_chat(model_dir: Path, messages: list[dict], num_prompt: int, expected: str) -> None:
    """One streamed chat through the real server and the openai client: `expected` (greedy, 12
    tokens) for a prompt of `num_prompt` tokens."""
    from openai import OpenAI

    srv = InProcessServer(EngineArgs(model=str(model_dir), dtype="float32", kv_cache_memory=0.01,
                                     max_model_len=256, debug_checks=True))  # Phi-3: the short factors
    try:
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="unused")
        stream = client.chat.completions.create(
            model=srv.model, messages=messages, temperature=0, max_tokens=12, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        assert usage.prompt_tokens == num_prompt and usage.completion_tokens == 12
        assert text == expected
        srv.wait_idle()
    finally:
        srv.stop()
