"""vLLM's scoring routes for an embedding model: POST /score (/v1/score) scores text pairs, and
POST /rerank (/v1/rerank, /v2/rerank, the Jina and Cohere shape) orders documents by how well
each answers a query. A pair's score is the cosine similarity of its two texts' embeddings
(/v1/embeddings' vectors), as vLLM scores with an embedding model; each distinct text is
embedded once."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Annotated

import numpy as np

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from pageserve.app.completions import prompt_token_ids
from pageserve.app.embeddings import embed
from pageserve.app.errors import bad_request
from pageserve.app.http import LARGE_REPLY_FLOATS, api_route, read_json, reply
from pageserve.app.protocol import MAX_PROMPTS, PromptText, _Body, integer
from pageserve.app.state import ServerState

Texts = PromptText | Annotated[list[PromptText], Field(min_length=1, max_length=MAX_PROMPTS)]


class ScoreRequest(_Body):
    model: str | None = None
    text_1: Texts  # one text scored against each of text_2, or one text per text_2
    text_2: Texts
    user: str | None = None


class RerankRequest(_Body):
    model: str | None = None
    query: PromptText
    documents: Annotated[list[PromptText], Field(min_length=1, max_length=MAX_PROMPTS)]
    top_n: integer(ge=0) | None = None  # the best this many (None or 0: all of them)
    return_documents: bool = True
    user: str | None = None


def _cosines(pairs: list[tuple[list[float], list[float]]]) -> list[float]:
    a, b = (np.asarray(side, dtype=np.float64) for side in zip(*pairs))
    norms = np.sqrt((a * a).sum(axis=1) * (b * b).sum(axis=1))
    return np.divide((a * b).sum(axis=1), norms, out=np.zeros(len(pairs)), where=norms > 0).tolist()


async def _scored(state: ServerState, request: Request, model: str, pairs: list[tuple[str, str]],
                  fields: tuple[str, str], build: Callable[[list[float], int], dict]) -> Response:
    """The reply `build` makes from each pair's cosine similarity and the prompt tokens embedded
    (each distinct text once; `fields`: the request fields the pairs' two sides come from, named
    in errors). Off the event loop for many floats, as /v1/embeddings' replies."""
    texts: dict[str, str] = {}  # text -> its field
    for pair in pairs:
        for text, field in zip(pair, fields):
            texts.setdefault(text, field)
    ids = await prompt_token_ids(state, list(texts), list(texts.values()))
    vectors = dict(zip(texts, await embed(state, request, model, ids, list(texts.values()))))
    floats = 2 * len(pairs) * len(next(iter(vectors.values())))
    return await reply(lambda: build(_cosines([(vectors[a], vectors[b]) for a, b in pairs]), sum(map(len, ids))),
                       floats >= LARGE_REPLY_FLOATS)


@api_route
async def score(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await read_json(request, ScoreRequest, state.settings.max_request_body_bytes)
    model = state.check_model(body.model)
    first = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    second = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if len(first) == 1:
        first = first * len(second)
    elif len(first) != len(second):
        raise bad_request(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many "
                          "as text_2", "text_1")

    def build(scores: list[float], tokens: int) -> dict:
        return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}
    return await _scored(state, request, model, list(zip(first, second)), ("text_1", "text_2"), build)


@api_route
async def rerank(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await read_json(request, RerankRequest, state.settings.max_request_body_bytes)
    model = state.check_model(body.model)

    def build(scores: list[float], tokens: int) -> dict:
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n or None]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": body.documents[i]}} if body.return_documents else {})} for i in order]
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results,
                "usage": {"total_tokens": tokens}}
    return await _scored(state, request, model, [(body.query, d) for d in body.documents], ("query", "documents"),
                         build)
