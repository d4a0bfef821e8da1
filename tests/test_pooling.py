"""Embeddings pooled as the model says: a sentence-transformers checkpoint's own files
(modules.json, 1_Pooling/config.json, a Normalize module) pick the mean, the last token or the
first, normalized or not, as vLLM reads them; --pooler-config overrides. Against HF transformers'
last hidden states of the same tiny Qwen3 checkpoint, pooled by hand as sentence-transformers
does, with prompts longer than a step's token budget (pooled across chunks)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from pageserve.loadtest.tiny_model import build_tiny_model
from pageserve.runtime import LLM
from pageserve.runtime.pooling import PoolerConfig, pooler_config

ST = "sentence_transformers.models."


def _write_sentence_transformers(model_dir, modes: dict, modules=("Transformer", "Pooling", "Normalize")) -> None:
    paths = {"Transformer": "", "Pooling": "1_Pooling", "Normalize": "2_Normalize", "Dense": "2_Dense"}
    (model_dir / "modules.json").write_text(json.dumps(
        [{"idx": i, "name": str(i), "path": paths[m], "type": ST + m} for i, m in enumerate(modules)]))
    (model_dir / "1_Pooling").mkdir(exist_ok=True)
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False, **modes, "include_prompt": True}))


@pytest.mark.unit
def test_the_pooler_read_from_sentence_transformers_files(tmp_path):
    assert pooler_config(tmp_path) == PoolerConfig("MEAN", True)  # no such files: the mean, normalized
    _write_sentence_transformers(tmp_path, {"pooling_mode_lasttoken": True})
    assert pooler_config(tmp_path) == PoolerConfig("LAST", True)
    _write_sentence_transformers(tmp_path, {"pooling_mode_mean_tokens": True}, ("Transformer", "Pooling"))
    assert pooler_config(tmp_path) == PoolerConfig("MEAN", False)  # no Normalize module
    assert pooler_config(tmp_path, '{"pooling_type": "cls", "normalize": true}') == PoolerConfig("CLS", True)
    _write_sentence_transformers(tmp_path, {"pooling_mode_max_tokens": True})
    assert "pooling_mode_max_tokens" in pooler_config(tmp_path).unsupported
    _write_sentence_transformers(tmp_path, {"pooling_mode_lasttoken": True}, ("Transformer", "Pooling", "Dense"))
    assert "Dense" in pooler_config(tmp_path).unsupported
    for bad, words in (('{"pooling_type": "MAX"}', "pooling_type must be one of"), ("{", "not JSON"),
                       ('{"dimensions": 8}', "not dimensions"), ('{"normalize": "yes"}', "true or false")):
        with pytest.raises(ValueError, match=words):
            pooler_config(tmp_path, bad)


def _hf_embeddings(model_dir, prompts: list[list[int]], pooling_type: str, normalize: bool) -> list[torch.Tensor]:
    import transformers

    model = transformers.AutoModel.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
            v = {"MEAN": hidden.mean(0), "LAST": hidden[-1], "CLS": hidden[0]}[pooling_type]
            out.append(torch.nn.functional.normalize(v, dim=0) if normalize else v)
    return out


@pytest.mark.engine
def test_embeddings_match_hf_pooled_as_the_model_says(tmp_path):
    model_dir = build_tiny_model(tmp_path / "qwen3-embedding", arch="qwen3")
    _write_sentence_transformers(model_dir, {"pooling_mode_lasttoken": True})
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in (5, 40, 97)]  # 97: four steps of 32
    cases = [(None, "LAST", True), ('{"pooling_type": "MEAN", "normalize": false}', "MEAN", False),
             ({"pooling_type": "CLS"}, "CLS", True)]
    for override, pooling_type, normalize in cases:
        llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=0.01, max_num_batched_tokens=32,
                  pooler_config=override, debug_checks=True)
        got = [torch.tensor(out.embedding) for out in llm.embed(prompts, use_tqdm=False)]
        expected = _hf_embeddings(model_dir, prompts, pooling_type, normalize)
        for i, (g, e) in enumerate(zip(got, expected)):
            assert torch.allclose(g, e, atol=2e-5, rtol=1e-4), (pooling_type, i, (g - e).abs().max())
        if pooling_type != "MEAN":  # the poolings differ: a test that could tell them apart
            assert not torch.allclose(got[1], _hf_embeddings(model_dir, prompts[1:2], "MEAN", normalize)[0], atol=1e-3)
        del llm


@pytest.mark.engine
def test_a_pooling_not_reproduced_is_refused(tmp_path):
    model_dir = build_tiny_model(tmp_path / "dense", arch="qwen3")
    _write_sentence_transformers(model_dir, {"pooling_mode_lasttoken": True}, ("Transformer", "Pooling", "Dense"))
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=0.01)
    with pytest.raises(ValueError, match="module Dense"):
        llm.embed("hello")
    assert llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs  # generation still serves


@pytest.mark.unit
def test_matryoshka_read_from_config_json_and_hf_overrides(tmp_path):
    from pageserve.runtime.pooling import apply_hf_overrides

    assert not pooler_config(tmp_path, hf={}).matryoshka
    assert pooler_config(tmp_path, hf={"is_matryoshka": True}) == PoolerConfig(matryoshka=True)
    listed = pooler_config(tmp_path, hf={"matryoshka_dimensions": [8, 16]})
    assert listed.matryoshka and listed.matryoshka_dimensions == (8, 16)
    assert apply_hf_overrides({"a": 1}, '{"is_matryoshka": true}') == {"a": 1, "is_matryoshka": True}
    for bad, words in (('{"num_hidden_layers": 2}', "not num_hidden_layers"), ("[1]", "JSON object"), ("{", "not JSON"),
                       ('{"is_matryoshka": "false"}', "true or false"), ('{"matryoshka_dimensions": 5}', "list of")):
        with pytest.raises(ValueError, match=words):
            apply_hf_overrides({}, bad)
    with pytest.raises(ValueError, match="positive integers"):
        pooler_config(tmp_path, hf={"matryoshka_dimensions": [8, 0]})
    assert "Matryoshka" in PoolerConfig().dimensions_error(8, 64)
    assert "dimensions 8, 16 only" in listed.dimensions_error(12, 64)
    assert "64 values, fewer than 128" in PoolerConfig(matryoshka=True).dimensions_error(128, 64)
    assert listed.dimensions_error(16, 64) is None
    v = [3.0, 4.0, 12.0]
    assert PoolerConfig(matryoshka=True).shorten(v, 2) == pytest.approx([0.6, 0.8])
    assert PoolerConfig(normalize=False, matryoshka=True).shorten(v, 2) == [3.0, 4.0]


@pytest.mark.server
def test_embeddings_take_dimensions_where_the_model_is_matryoshka(tiny_model_dir, tiny_server):
    """vLLM's `--hf-overrides '{"is_matryoshka": true}'` (as for Qwen3-Embedding): `dimensions`
    gives the first values of the same embedding, normalized again; elsewhere it is a 400."""
    import httpx

    from pageserve.runtime.engine_args import EngineArgs
    from tests.live_server import InProcessServer

    r = httpx.post(f"{tiny_server.url}/v1/embeddings", json={"input": "hello", "dimensions": 8})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions" and "Matryoshka" in r.text
    srv = InProcessServer(EngineArgs(model=str(tiny_model_dir), dtype="float32", kv_cache_memory=0.01,
                                     max_model_len=256, hf_overrides='{"matryoshka_dimensions": [8, 32]}'))
    try:
        def embed(**extra):
            r = httpx.post(f"{srv.url}/v1/embeddings", json={"input": ["hello there", "a b c"], **extra}, timeout=30)
            return r.status_code, r.json()
        status, full = embed()
        assert status == 200 and len(full["data"][0]["embedding"]) == 64
        status, short = embed(dimensions=8)
        assert status == 200
        for whole, part in zip(full["data"], short["data"]):
            expected = torch.nn.functional.normalize(torch.tensor(whole["embedding"][:8]), dim=0)
            assert len(part["embedding"]) == 8 and torch.allclose(torch.tensor(part["embedding"]), expected, atol=1e-6)
        status, body = embed(dimensions=12)
        assert status == 400 and "dimensions 8, 32 only" in body["error"]["message"]
    finally:
        srv.stop()
