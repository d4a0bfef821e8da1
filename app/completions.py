"""POST /v1/completions: one or several prompts (text or token ids), one choice each."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from app.errors import bad_request
from app.generation import (check_length, collect, request_id, sampling_params, sse_response, start,
                            usage)
from app.http import api_route, json_response, read_json, until_disconnected
from app.protocol import CompletionRequest
from app.state import ServerState


def split_prompts(prompt) -> list[str | list[int]]:
    """A string, a list of strings, token ids, or a list of token-id lists -> a list of prompts."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


async def prompt_token_ids(state: ServerState, prompts: list[str | list[int]], param: str) -> list[list[int]]:
    vocab = state.engine.engine.config.model.vocab_size
    out = []
    for p in prompts:
        ids = await state.tokenize(p) if isinstance(p, str) else p
        if not ids:
            raise bad_request("a prompt is empty", param)
        if max(ids) >= vocab:
            raise bad_request(f"token id {max(ids)} is outside the vocabulary (0 to {vocab - 1})", param)
        out.append(ids)
    return out


@api_route
async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await read_json(request, CompletionRequest, state.settings.max_request_body_bytes)
    model = state.check_model(body.model)
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if body.logprobs is not None:
        raise bad_request("logprobs are not supported yet", "logprobs")
    prompts = split_prompts(body.prompt)
    ids = await prompt_token_ids(state, prompts, "prompt")
    for p in ids:
        check_length(state, len(p), body.max_tokens)
    params = sampling_params(body, body.max_tokens)
    echo = [p if isinstance(p, str) else state.detokenize(p) for p in prompts] if body.echo else None
    rid = request_id("cmpl")
    stream, index = start(state, rid, ids, params, body.cache_salt)
    created = int(time.time())
    num_prompt = sum(len(p) for p in ids)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return sse_response(_chunks(stream, index, rid, created, model, num_prompt, echo, include_usage),
                            stream)
    try:
        outs = await until_disconnected(request, collect(stream))
    finally:
        stream.abort()
    choices = []
    for r, i in sorted(index.items(), key=lambda kv: kv[1]):
        c = outs[r].outputs[0]
        choices.append({"index": i, "text": (echo[i] if echo else "") + c.text, "logprobs": None,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return json_response({
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": choices,
        "usage": usage(num_prompt, sum(len(outs[r].outputs[0].token_ids) for r in index)),
    })


async def _chunks(stream, index: dict[str, int], rid: str, created: int, model: str, num_prompt: int,
                  echo: list[str] | None, include_usage: bool):
    def chunk(i: int, text: str, finish_reason=None, stop_reason=None) -> dict:
        choice = {"index": i, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        c = {"id": rid, "object": "text_completion", "created": created, "model": model,
             "choices": [choice]}
        if include_usage:
            c["usage"] = None
        return c

    if echo:
        for i, text in enumerate(echo):
            yield chunk(i, text)
    num_generated = 0
    async for out in stream:
        i = index[out.request_id]
        c = out.outputs[0]
        num_generated += len(c.token_ids)
        if c.text or out.finished:
            yield chunk(i, c.text, c.finish_reason if out.finished else None, c.stop_reason)
    if include_usage:
        yield {"id": rid, "object": "text_completion", "created": created, "model": model,
               "choices": [], "usage": usage(num_prompt, num_generated)}
