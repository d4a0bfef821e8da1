"""One chat request per architecture through the real server and the openai client: the
streamed answer is the greedy continuation (HF transformers' own, on the same weights) of the
prompt the model's chat template renders. The tiny models' tokenizer carries a ChatML
template, not each family's own."""

from __future__ import annotations

import pytest

from pageserve.loadtest.tiny_model import ARCHITECTURES, build_tiny_model
from pageserve.runtime.engine_args import EngineArgs
from tests.hf_reference import hf_greedy
from tests.live_server import InProcessServer

pytestmark = pytest.mark.server

MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What does paged attention keep in blocks?"}]


@pytest.mark.parametrize("arch", sorted(set(ARCHITECTURES) - {"llama"}))
def test_chat_through_the_server(tmp_path, arch):
    from openai import OpenAI
    from transformers import AutoTokenizer

    model_dir = build_tiny_model(tmp_path / arch, arch=arch)
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    expected = hf_greedy(model_dir, [prompt], max_new_tokens=12)[0]
    srv = InProcessServer(EngineArgs(model=str(model_dir), dtype="float32", kv_cache_memory=0.01,
                                     max_model_len=256, debug_checks=True))  # Phi-3: the short factors
    try:
        client = OpenAI(base_url=f"{srv.url}/v1", api_key="unused")
        stream = client.chat.completions.create(
            model=srv.model, messages=MESSAGES, temperature=0, max_tokens=12, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == 12
        assert text == tok.decode(expected, skip_special_tokens=True)
        srv.wait_idle()
    finally:
        srv.stop()
