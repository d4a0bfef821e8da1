"""POST /v1/completions: one or several prompts (text or token ids), one choice each."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from pageserve.app.errors import bad_request
from pageserve.app.generation import (cached_tokens, collect, request_id, sampling_params, sse_response, start,
                                      stream_usage, usage)
from pageserve.app.http import (api_route, many_choices, many_entries, many_logprobs, off_loop_if, owner, read_json,
                                reply, until_disconnected)
from pageserve.app.logprobs import completion_logprobs, prompt_logprobs
from pageserve.app.protocol import CompletionRequest
from pageserve.app.state import LONG_TEXT, ServerState
from pageserve.app.structured import structured_outputs


def split_prompts(prompt) -> list[str | list[int]]:
    """A string, a list of strings, token ids, or a list of token-id lists -> a list of prompts."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


async def prompt_token_ids(state: ServerState, prompts: list[str | list[int]],
                           param: str | list[str], keep_last: int | None = None) -> list[list[int]]:
    """Texts tokenized; token ids as they are (the engine checks them as it takes them).
    `param`: the request field they came from, or each one's. `keep_last`: each prompt's last
    tokens only (ServerState.truncation)."""
    fields = [param] * len(prompts) if isinstance(param, str) else param
    texts = iter(await state.tokenize_all([p for p in prompts if isinstance(p, str)],
                                          [f for p, f in zip(prompts, fields) if isinstance(p, str)], keep_last))
    return [next(texts) if isinstance(p, str) else p if keep_last is None else p[-keep_last:] for p in prompts]


@api_route
async def completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await read_json(request, CompletionRequest, state.settings.max_request_body_bytes)
    model = state.check_model(body.model)
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    prompts = split_prompts(body.prompt)
    keep = state.truncation(body)
    ids = await prompt_token_ids(state, prompts, "prompt", keep)
    if keep is not None:  # what is echoed is what the model read, less the BOS a text was given
        head = state.engine.tokenize("")
        prompts = [q[len(head):] if isinstance(p, str) and q[:len(head)] == head else q for p, q in zip(prompts, ids)]
    echo_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    params = sampling_params(body, body.max_tokens, body.logprobs,
                             body.prompt_logprobs if body.prompt_logprobs is not None else echo_logprobs,
                             structured=structured_outputs(body)[0], defaults=state.sampling_defaults)
    rid = request_id("cmpl", request)
    stream, index = await start(state, rid, ids, params, body.cache_salt, "prompt", model=model,
                                priority=body.priority, owner=owner(request))
    try:  # after start(), which checked the token ids
        echo = None if not body.echo else await off_loop_if(
            sum(len(p) for p in prompts if not isinstance(p, str)) > LONG_TEXT,
            lambda: [p if isinstance(p, str) else state.detokenize(p) for p in prompts])
    except BaseException:
        stream.abort()
        raise
    created = int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": model}
    num_prompt = sum(len(p) for p in ids)
    job = _Job(state, index, ids, body.n, echo, echo_logprobs is not None, body.prompt_logprobs is not None, body)
    if body.stream:
        return sse_response(_chunks(job, stream, head, num_prompt, stream_usage(body)), stream)
    try:
        outs = await until_disconnected(request, collect(stream))
    finally:
        stream.abort()

    num_generated = sum(len(c.token_ids) for r in index for c in outs[r].outputs)

    def build() -> dict:  # the choices in index order, each made as it is written
        order = sorted(((r, c) for r in index for c in outs[r].outputs),
                       key=lambda pair: index[pair[0]] * body.n + pair[1].index)
        return {**head, "choices": (job.choice(outs[r], c, first=True, final=True) for r, c in order),
                "usage": usage(num_prompt, num_generated, sum(cached_tokens(outs[r]) for r in index))}
    echoed = num_prompt * body.n * (body.echo + job.token_ids)  # each choice repeats its prompt
    large = many_logprobs(num_generated, body.logprobs) or many_logprobs(num_prompt, params.prompt_logprobs) \
        or many_choices(len(index) * body.n, num_generated + echoed)
    return await reply(build, large)


class _Job:
    """One completions request's prompts and how its choices are numbered and echoed."""

    def __init__(self, state: ServerState, index: dict[str, int], prompt_ids: list[list[int]], n: int,
                 echo: list[str] | None, echo_logprobs: bool, prompt_logprobs: bool = False, body=None):
        """prompt_logprobs: vLLM's field asked for, given on each choice's first piece. `body`: the
        request, for how its logprobs name tokens and whether it asks for token ids."""
        self.state, self.index, self.prompt_ids, self.n = state, index, prompt_ids, n
        self.echo, self.echo_logprobs, self.prompt_logprobs = echo, echo_logprobs, prompt_logprobs
        self.labels = state.token_labels(body)
        self.token_ids = bool(getattr(body, "return_token_ids", None))
        self.offsets: dict[int, int] = {}  # choice -> characters streamed so far (text_offset)

    def choice(self, out, c, first: bool, final: bool) -> dict:
        """`first`: this choice's first piece (gets the echo); `final`: a whole answer."""
        p = self.index[out.request_id]
        i = p * self.n + c.index
        echo = self.echo[p] if self.echo and first else ""
        logprobs = None
        if c.logprobs is not None:
            prompt_lps = out.prompt_logprobs if first and self.echo_logprobs else None
            logprobs = completion_logprobs(c.logprobs, self.labels, prompt_lps, self.prompt_ids[p],
                                           self.offsets.get(i, 0))
            if not final:
                self.offsets[i] = self.offsets.get(i, 0) + len(echo) + len(c.text)
        choice = {"index": i, "text": echo + c.text, "logprobs": logprobs,
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if first and self.prompt_logprobs and out.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs(out.prompt_logprobs, self.prompt_ids[p], self.labels)
        if self.token_ids:  # vLLM's places: the prompt's on each choice's first piece, the piece's own
            if first:
                choice["prompt_token_ids"] = self.prompt_ids[p]
            choice["token_ids"] = list(c.token_ids)
        return choice


async def _chunks(job: _Job, stream, head: dict, num_prompt: int, usage_mode: tuple[bool, bool]):
    include_usage, continuous = usage_mode
    num_generated = 0
    cached: dict[str, int] = {}  # by prompt's request

    def chunk(choice: dict) -> dict:
        if choice["finish_reason"] is None:
            del choice["stop_reason"]
        c = {**head, "choices": [choice]}
        if include_usage:
            c["usage"] = usage(num_prompt, num_generated, sum(cached.values())) if continuous else None
        return c

    started: set[int] = set()
    async for out in stream:
        cached[out.request_id] = max(cached.get(out.request_id, 0), cached_tokens(out))
        for c in out.outputs:
            num_generated += len(c.token_ids)
            i = job.index[out.request_id] * job.n + c.index
            first = i not in started  # (the first piece also carries the prompt's logprobs)
            large = many_entries(c.logprobs) or first and many_entries(out.prompt_logprobs)
            choice = await off_loop_if(large, lambda c=c, first=first: job.choice(out, c, first=first, final=False))
            if choice["text"] or choice["logprobs"] or c.finish_reason is not None or "prompt_logprobs" in choice \
                    or choice.get("token_ids"):
                started.add(i)  # (a piece held back, by a stop string, is no first piece)
                yield chunk(choice)
    if include_usage:
        yield {**head, "choices": [], "usage": usage(num_prompt, num_generated, sum(cached.values()))}
