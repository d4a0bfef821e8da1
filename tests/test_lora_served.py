"""LoRA adapters through the real server and the openai client: an adapter chosen by `model`
gives what the offline engine gives under it, /v1/models lists adapters with the base model
as parent, adapters load and unload at run time behind the API key, every bad load is a 4xx
and the server serves on, and /metrics shows the running adapters."""

from __future__ import annotations

import httpx
import openai
import pytest

from pageserve.loadtest.tiny_lora import peft_adapter
from pageserve.loadtest.tiny_model import build_tiny_model
from pageserve.runtime import LLM, LoRARequest, SamplingParams
from pageserve.runtime.engine_args import EngineArgs
from tests.live_server import InProcessServer

pytestmark = pytest.mark.server

KEY = "sk-lora-test"
PROMPT = [1, 5, 9, 13, 20, 40, 7, 77]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    from pageserve.app.lora import LoRAModule

    root = tmp_path_factory.mktemp("lora-served")
    base = build_tiny_model(root / "base")
    adapters = [peft_adapter(base, root / f"a{i}", rank=8, alpha=16, seed=20 + i) for i in range(3)]
    args = EngineArgs(model=str(base), dtype="float32", kv_cache_memory=0.01, enable_lora=True, max_loras=2)
    srv = InProcessServer(args, api_keys=(KEY,), allow_runtime_lora_updating=True,
                          lora_modules=(LoRAModule("first", str(adapters[0])),))
    try:
        yield srv, base, adapters
    finally:
        srv.stop()


def expected(base, adapter) -> str:
    llm = LLM(str(base), dtype="float32", kv_cache_memory=0.01, enable_lora=True)
    lora = LoRARequest("x", 1, str(adapter)) if adapter is not None else None
    return llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False,
                        lora_request=lora)[0].outputs[0].text


def completion_text(client, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text


def test_adapters_by_model_name_loaded_and_unloaded_at_run_time(case):
    srv, base, adapters = case
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"test-model", "first"}
    assert models["first"].parent == "test-model" and models["test-model"].parent is None
    assert expected(base, adapters[0]) != expected(base, None)  # the adapter shows
    assert completion_text(client, "first") == expected(base, adapters[0])
    assert completion_text(client, "test-model") == expected(base, None)

    admin = httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    r = admin.post("/v1/load_lora_adapter", json={"lora_name": "second", "lora_path": str(adapters[1])})
    assert r.status_code == 200, r.text
    chat = client.chat.completions.create(model="second", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0)
    assert chat.model == "second" and chat.choices[0].message.content is not None
    assert completion_text(client, "second") == expected(base, adapters[1])
    metrics = admin.get("/metrics").text
    assert "pageserve:lora_requests_info{" in metrics and 'max_lora="2"' in metrics

    r = admin.post("/v1/unload_lora_adapter", json={"lora_name": "second"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        completion_text(client, "second")
    # loaded again: a new id, so it never meets the KV its first loading cached
    assert admin.post("/v1/load_lora_adapter", json={"lora_name": "second", "lora_path": str(adapters[2])}
                      ).status_code == 200
    assert completion_text(client, "second") == expected(base, adapters[2])
    assert admin.post("/v1/unload_lora_adapter", json={"lora_name": "second"}).status_code == 200


def test_bad_loads_are_4xx_and_the_server_serves_on(case, tmp_path):
    srv, base, adapters = case
    admin = httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    (tmp_path / "empty").mkdir()
    cases = [({"lora_name": "x", "lora_path": str(tmp_path / "missing")}, 400, "does not exist"),
             ({"lora_name": "x", "lora_path": str(tmp_path / "empty")}, 400, "adapter_config.json"),
             ({"lora_name": "first", "lora_path": str(adapters[1])}, 400, "already been loaded"),
             ({"lora_name": "test-model", "lora_path": str(adapters[1])}, 400, "already been loaded"),
             ({"lora_name": "", "lora_path": str(adapters[1])}, 400, "lora_name"),
             ({"lora_path": str(adapters[1])}, 400, "lora_name")]
    for body, status, words in cases:
        r = admin.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == status and words in r.text, (body, r.status_code, r.text)
    r = admin.post("/v1/unload_lora_adapter", json={"lora_name": "nobody"})
    assert r.status_code == 404 and "cannot be found" in r.text
    r = httpx.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": "y", "lora_path": str(adapters[1])})
    assert r.status_code == 401  # behind the API key
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0)
    assert completion_text(client, "first") == expected(base, adapters[0])


def test_run_time_loading_is_off_unless_allowed(tmp_path):
    base = build_tiny_model(tmp_path / "base")
    srv = InProcessServer(EngineArgs(model=str(base), dtype="float32", kv_cache_memory=0.01, enable_lora=True))
    try:
        r = httpx.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
        assert r.status_code == 404
        assert "/v1/load_lora_adapter" not in httpx.get(f"{srv.url}/openapi.json").json()["paths"]
    finally:
        srv.stop()


@pytest.mark.unit
def test_lora_modules_flag_forms_and_mistakes():
    from pageserve.app.cli import build_parser
    from pageserve.app.lora import LoRAModule, parse_lora_modules
    from pageserve.app.serve import settings_from_args

    assert parse_lora_modules(["sql=/a/sql", '{"name": "legal", "path": "/a/legal", "base_model_name": "m"}']) == (
        LoRAModule("sql", "/a/sql"), LoRAModule("legal", "/a/legal", "m"))
    for bad in ("sql", "=/a", "sql=", '{"name": "x"}', "{not json"):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules([bad])
    ns = build_parser().parse_args(["serve", "--lora-modules", "sql=/a/sql"])
    with pytest.raises(ValueError, match="needs --enable-lora"):
        settings_from_args(ns, "m")
    ns = build_parser().parse_args(["serve", "--enable-lora", "--lora-modules", "sql=/a/sql"])
    assert settings_from_args(ns, "m").lora_modules == (LoRAModule("sql", "/a/sql"),)
