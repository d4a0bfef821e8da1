"""POST /v1/embeddings: the served model's last hidden states pooled (runtime/pooling.py),
computed as prefill-only requests through the same engine as generation."""

from __future__ import annotations

import base64
import uuid
from array import array

from starlette.requests import Request
from starlette.responses import Response

from pageserve.app.completions import prompt_token_ids, split_prompts
from pageserve.app.errors import bad_request
from pageserve.app.generation import collect, request_id
from pageserve.app.http import LARGE_REPLY_FLOATS, api_route, off_loop_if, read_json, reply, until_disconnected
from pageserve.app.protocol import EmbeddingRequest
from pageserve.app.state import LONG_TEXT, ServerState


@api_route
async def embeddings(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await read_json(request, EmbeddingRequest, state.settings.max_request_body_bytes)
    model = state.check_model(body.model)
    pooler = state.engine.pooler
    if body.dimensions is not None and (error := pooler.dimensions_error(body.dimensions, state.engine.hidden_size)):
        raise bad_request(f"dimensions {body.dimensions}: {error}", "dimensions")
    inputs = await prompt_token_ids(state, split_prompts(body.input), "input", state.truncation(body))
    vectors = await embed(state, request, model, inputs, "input")
    if body.dimensions is not None:  # Matryoshka: the first values, normalized again
        vectors = [pooler.shorten(v, body.dimensions) for v in vectors]

    def build() -> dict:
        data = []
        for i, vector in enumerate(vectors):
            if body.encoding_format == "base64":
                vector = base64.b64encode(array("f", vector).tobytes()).decode()  # little-endian float32
            data.append({"object": "embedding", "index": i, "embedding": vector})
        num_tokens = sum(len(ids) for ids in inputs)
        return {"object": "list", "data": data, "model": model,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
    return await reply(build, sum(map(len, vectors)) >= LARGE_REPLY_FLOATS)


async def embed(state: ServerState, request: Request, model: str, inputs: list[list[int]],
                params: str | list[str]) -> list[list[float]]:
    """The embedding of each input, in order (`params`: the request field they came from, or
    each one's), checked off the event loop when they are many ids; their requests are aborted
    if the client goes."""
    engine = state.engine
    params = [params] * len(inputs) if isinstance(params, str) else params
    base = f"{request_id('embd', request)}-{uuid.uuid4().hex[:8]}"
    ids = [f"{base}-{i}" for i in range(len(inputs))]
    engine.check_accepting(len(inputs), params[-1])  # before the checks, which may take a while
    checked = await off_loop_if(sum(map(len, inputs)) > LONG_TEXT, lambda: [
        engine.check_embedding_request(tokens, param) for tokens, param in zip(inputs, params)])
    stream = engine.new_stream(len(inputs), params[-1])  # checked again: nothing awaits from here to the queue
    try:
        for rid, one in zip(ids, checked):
            engine.add_checked(stream, rid, one, lora=state.adapters.get(model))
        outs = await until_disconnected(request, collect(stream))
    finally:
        stream.abort()
    return [outs[rid].embedding for rid in ids]
