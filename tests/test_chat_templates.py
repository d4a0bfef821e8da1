"""--chat-template, chat_template_kwargs and --generation-config through the real server on
the tiny model."""

from __future__ import annotations

import argparse
import json

import httpx
import pytest

from pageserve.app.generation import sampling_params
from pageserve.app.protocol import ChatCompletionRequest
from pageserve.app.serve import read_chat_template
from pageserve.loadtest.tiny_model import build_tiny_model
from pageserve.runtime.engine_args import EngineArgs
from tests.live_server import InProcessServer

pytestmark = pytest.mark.server

MESSAGES = [{"role": "user", "content": "hello there"}]


def serve(model_dir, **settings) -> InProcessServer:
    return InProcessServer(EngineArgs(model=str(model_dir), dtype="float32", kv_cache_memory=0.005,
                                      max_model_len=256, swap_space=0), **settings)


def chat(srv, **body):
    return httpx.post(f"{srv.url}/v1/chat/completions",
                      json={"model": srv.model, "messages": MESSAGES, "max_tokens": 4, **body}, timeout=60)


@pytest.fixture(scope="module")
def bare_model(tmp_path_factory):
    """The tiny model without any chat template, and with sampling defaults of its own."""
    path = build_tiny_model(tmp_path_factory.mktemp("bare"))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.0, "top_k": 7}))
    return path


def test_no_template_names_the_flag_and_the_flag_fixes_it(bare_model):
    srv = serve(bare_model)
    try:
        r = chat(srv)
        assert r.status_code == 400 and "--chat-template" in r.json()["error"]["message"]
        assert srv.state.sampling_defaults == {"temperature": 0.0, "top_k": 7}  # auto: the model's
    finally:
        srv.stop()
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}{% if loud %}!!{% endif %}>"
    srv = serve(bare_model, chat_template=template, generation_config="vllm")
    try:
        quiet, loud = chat(srv, temperature=0), chat(srv, temperature=0, chat_template_kwargs={"loud": True})
        assert quiet.status_code == loud.status_code == 200
        tok = srv.engine.tokenizer
        assert quiet.json()["usage"]["prompt_tokens"] == len(tok.encode("[hello there]>", add_special_tokens=False))
        assert loud.json()["usage"]["prompt_tokens"] == len(tok.encode("[hello there]!!>", add_special_tokens=False))
        assert srv.state.sampling_defaults == {}
    finally:
        srv.stop()


def test_generation_config_supplies_what_a_request_omits(bare_model, tmp_path):
    srv = serve(bare_model, chat_template="{{ messages[0]['content'] }}>")
    try:  # the model's temperature 0: a request without one is greedy, as an explicit 0 is
        outs = {json.dumps(chat(srv, ignore_eos=True, max_tokens=8).json()["choices"][0]["message"]["content"])
                for _ in range(3)}
        greedy = chat(srv, ignore_eos=True, max_tokens=8, temperature=0).json()["choices"][0]["message"]["content"]
        assert outs == {json.dumps(greedy)}
    finally:
        srv.stop()
    body = ChatCompletionRequest(messages=MESSAGES, top_p=0.5)
    p = sampling_params(body, 4, None, defaults={"temperature": 0.6, "top_p": 0.9, "top_k": 20})
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.6, 0.5, 20, 0.0)  # the request's own top_p wins
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"top_p": 0.8, "repetition_penalty": 1.1}))
    srv = serve(bare_model, chat_template="{{ messages[0]['content'] }}>", generation_config=str(folder),
                override_generation_config={"top_p": 0.5, "min_p": 0.05})
    try:
        assert srv.state.sampling_defaults == {"top_p": 0.5, "repetition_penalty": 1.1, "min_p": 0.05}
    finally:
        srv.stop()


def test_generation_defaults_are_checked_at_start_up():
    from pageserve.app.state import generation_defaults

    assert generation_defaults("auto", {"top_k": 0, "temperature": 0.7, "do_sample": True}) == {
        "top_k": -1, "temperature": 0.7}  # transformers' top_k 0 is "none"
    with pytest.raises(ValueError, match="sampling defaults of the model's generation_config.json are not valid"):
        generation_defaults("auto", {"top_p": 1.5})
    assert generation_defaults("vllm", {"temperature": 0.7}) == {}


def test_override_generation_config_sets_fields_on_top():
    from pageserve.app.serve import add_args, settings_from_args
    from pageserve.app.state import generation_defaults

    model = {"temperature": 0.7, "top_p": 0.9}
    assert generation_defaults("auto", model, {"temperature": 0.2, "top_k": 0}) == {
        "temperature": 0.2, "top_p": 0.9, "top_k": -1}
    assert generation_defaults("vllm", model, {"min_p": 0.1}) == {"min_p": 0.1}  # vLLM's: only the overrides
    for bad, words in (({"temprature": 1}, "cannot set temprature; it sets temperature, top_p"),
                       ({"max_new_tokens": 9}, "cannot set max_new_tokens"),
                       ({"top_p": 2}, "--override-generation-config: top_p must be in")):
        with pytest.raises(ValueError, match=words):
            generation_defaults("auto", model, bad)
    parser = argparse.ArgumentParser()
    add_args(parser)
    ns = parser.parse_args(["--override-generation-config", '{"repetition_penalty": 1.2}'])
    assert settings_from_args(ns, "m").override_generation_config == {"repetition_penalty": 1.2}
    for value, words in (("[1]", "is not a JSON object"), ("{temperature", "is not a JSON object"),
                         ('{"top_k": -5}', "top_k")):  # refused before the model loads
        ns = parser.parse_args(["--override-generation-config", value])
        with pytest.raises(ValueError, match=words):
            settings_from_args(ns, "m")


def test_chat_template_flag_reads_a_file_or_a_template(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages }}")
    assert read_chat_template(str(f)) == "{{ messages }}"
    assert read_chat_template("{% if x %}y{% endif %}") == "{% if x %}y{% endif %}"
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
