"""vLLM's /score and /rerank routes through the real server on the tiny model: each score is the
cosine similarity of the two texts' /v1/embeddings vectors, pairs one-to-many and one-to-one,
documents ordered best first with top_n, and 400s for what does not pair up."""

from __future__ import annotations

import math

import httpx
import pytest

pytestmark = pytest.mark.server

QUERY = "the cat sat on the mat"
DOCS = ["a cat was sitting on a rug", "stock markets fell today", "the cat sat on the mat", "rain in spain"]


def _cosine(a, b):
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


@pytest.fixture(scope="module")
def vectors(tiny_server):
    r = httpx.post(f"{tiny_server.url}/v1/embeddings", json={"input": [QUERY, *DOCS]}, timeout=60)
    assert r.status_code == 200, r.text
    return [d["embedding"] for d in r.json()["data"]]


def test_score_pairs_are_their_embeddings_cosine(tiny_server, vectors):
    expected = [_cosine(vectors[0], v) for v in vectors[1:]]
    for path in ("/score", "/v1/score"):
        r = httpx.post(f"{tiny_server.url}{path}", json={"text_1": QUERY, "text_2": DOCS}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert [d["index"] for d in body["data"]] == [0, 1, 2, 3] and body["object"] == "list"
        assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-5)
        assert body["data"][2]["score"] == pytest.approx(1.0, abs=1e-5)  # the same text
        assert body["usage"]["prompt_tokens"] > 0
    one_to_one = httpx.post(f"{tiny_server.url}/v1/score", timeout=60,
                            json={"text_1": [DOCS[0], DOCS[1]], "text_2": [DOCS[1], DOCS[1]]}).json()
    assert [d["score"] for d in one_to_one["data"]] == pytest.approx([_cosine(vectors[1], vectors[2]), 1.0], abs=1e-5)


def test_rerank_orders_documents_best_first(tiny_server, vectors):
    scores = [_cosine(vectors[0], v) for v in vectors[1:]]
    best_first = sorted(range(len(DOCS)), key=lambda i: -scores[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = httpx.post(f"{tiny_server.url}{path}", json={"query": QUERY, "documents": DOCS, "top_n": 3}, timeout=60)
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == best_first[:3] and results[0]["index"] == 2
        assert [x["relevance_score"] for x in results] == pytest.approx([scores[i] for i in best_first[:3]], abs=1e-5)
        assert [x["document"]["text"] for x in results] == [DOCS[i] for i in best_first[:3]]
    bare = httpx.post(f"{tiny_server.url}/rerank", timeout=60,
                      json={"query": QUERY, "documents": DOCS, "return_documents": False}).json()
    assert len(bare["results"]) == 4 and "document" not in bare["results"][0] and bare["usage"]["total_tokens"] > 0


@pytest.mark.parametrize("path, body, param", [
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
    ("/v1/rerank", {"query": "a", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "", "documents": ["b"]}, "query"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": "a " * 600, "documents": ["b"]}, "query"),  # past the context length
    ("/v1/score", {"text_1": "a", "text_2": ["b", "c " * 600]}, "text_2"),
])
def test_what_does_not_pair_up_is_a_400(tiny_server, path, body, param):
    r = httpx.post(f"{tiny_server.url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert httpx.get(f"{tiny_server.url}/health").status_code == 200
