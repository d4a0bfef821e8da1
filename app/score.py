"""vLLM's scoring routes for an embedding model: POST /score (/v1/score) scores text pairs, and
POST /rerank (/v1/rerank, /v2/rerank, the Jina and Cohere shape) orders documents by how well
each answers a query. A pair's score is the cosine similarity of its two texts' embeddings
(/v1/embeddings' vectors), as vLLM scores with an embedding model; each distinct text is
embedded once."""

from __future__ import annotations

import math
import time
import uuid
from typing import Annotated

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from pageserve.app.completions import prompt_token_ids
from pageserve.app.embeddings import embed
from pageserve.app.errors import bad_request
from pageserve.app.http import api_route, json_response, read_json
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


def _cosine(a: list[float], b: list[float]) -> float:
    norms = math.sqrt(math.fsum(x * x for x in a) * math.fsum(y * y for y in b))
    return math.fsum(x * y for x, y in zip(a, b)) / norms if norms else 0.0


async def _scores(state: ServerState, request: Request, model: str, pairs: list[tuple[str, str]],
                  fields: tuple[str, str]) -> tuple[list[float], int]:
    """Each pair's cosine similarity, and the prompt tokens embedded (each distinct text once;
    `fields`: the request fields the pairs' two sides come from, named in errors)."""
    texts: dict[str, str] = {}  # text -> its field
    for pair in pairs:
        for text, field in zip(pair, fields):
            texts.setdefault(text, field)
    ids = await prompt_token_ids(state, list(texts))
    vectors = dict(zip(texts, await embed(state, request, model, ids, list(texts.values()))))
    return [_cosine(vectors[a], vectors[b]) for a, b in pairs], sum(map(len, ids))


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
    scores, tokens = await _scores(state, request, model, list(zip(first, second)), ("text_1", "text_2"))
    return json_response({
        "id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}})


@api_route
async def rerank(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await read_json(request, RerankRequest, state.settings.max_request_body_bytes)
    model = state.check_model(body.model)
    scores, tokens = await _scores(state, request, model, [(body.query, d) for d in body.documents],
                                   ("query", "documents"))
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n or None]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": body.documents[i]}} if body.return_documents else {})} for i in order]
    return json_response({"id": f"rerank-{uuid.uuid4().hex}", "model": model, "results": results,
                          "usage": {"total_tokens": tokens}})
