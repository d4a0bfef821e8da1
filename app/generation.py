"""What chat and completions share: request fields -> SamplingParams, adding prompts to the
engine, and the SSE response."""

from __future__ import annotations

import functools
import logging
import re
import uuid
from collections.abc import AsyncIterator, Callable

from sse_starlette import EventSourceResponse
from starlette.requests import Request

from pageserve.app.errors import APIError, bad_request
from pageserve.app.http import engine_error, off_loop_if
from pageserve.app.json_out import dumps
from pageserve.app.state import LONG_TEXT, ServerState
from pageserve.runtime.async_engine import RequestFailedError
from pageserve.runtime.outputs import RequestOutput
from pageserve.runtime.request_stream import RequestStream
from pageserve.sampling.params import RequestOutputKind, SamplingParams, StructuredOutputsParams, ThinkingBudget

logger = logging.getLogger(__name__)

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def request_id(prefix: str, request: Request) -> str:
    """The client's X-Request-Id when it sends a sane one (as vLLM does), else a random id."""
    given = request.headers.get("x-request-id", "")
    return f"{prefix}-{given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex}"


def sampling_params(body, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None,
                    structured: StructuredOutputsParams | None = None,
                    defaults: dict | None = None, thinking: ThinkingBudget | None = None) -> SamplingParams:
    """`body`: a chat, completions or responses request (a field a body lacks takes
    SamplingParams' default). `defaults`: the model's (generation_config.json) for the fields a
    request leaves unset. `thinking`: the reasoning parser's budget for the request's thinking."""
    given = {k: getattr(body, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
    d = {**(defaults or {}), **{k: v for k, v in given.items() if v is not None}}
    field = functools.partial(getattr, body)
    try:
        return SamplingParams(
            n=field("n", 1),
            temperature=d.get("temperature", 1.0),
            top_p=d.get("top_p", 1.0),
            top_k=d.get("top_k", -1),
            min_p=d.get("min_p", 0.0),
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=d.get("repetition_penalty", 1.0),
            logit_bias=field("logit_bias", None) or {},
            allowed_token_ids=field("allowed_token_ids", None),
            bad_words=field("bad_words", None) or [],
            max_tokens=max_tokens,
            min_tokens=field("min_tokens", 0),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else field("prompt_logprobs", None),
            stop=body.stop or [],
            stop_token_ids=field("stop_token_ids", None) or [],
            include_stop_str_in_output=field("include_stop_str_in_output", False),
            ignore_eos=body.ignore_eos,
            skip_special_tokens=field("skip_special_tokens", True),
            seed=body.seed,
            output_kind=RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=structured,
            thinking_budget=thinking,
        )
    except ValueError as e:
        raise bad_request(str(e), str(e).split(" ", 1)[0]) from None


async def start(state: ServerState, base_id: str, prompts: list[list[int]], params: SamplingParams,
                cache_salt: str | None, param: str, images: tuple = (),
                model: str | None = None, priority: int = 0, *, owner: str) -> tuple[RequestStream, dict[str, int]]:
    """Hand every prompt to the engine; returns the stream and engine request id -> prompt
    index (an output's choice index is prompt index x n + its own index). `images`: the one
    prompt's images (runtime.multimodal.ImageItem). `model`: the checked name the request
    gave, whose LoRA adapter it runs under where it names one. Engine ids add a
    random suffix to the response id, so a client that reuses its X-Request-Id never meets
    its earlier request. Each is checked as the engine takes it (an error names `param` for
    the prompt), in a worker thread when they hold many token ids (1,000 prompts of 8,000 held
    the event loop 0.95 s); nothing is left running if one of them is refused. `owner` (http.owner: the
    API key's tag, "" without keys) salts the prefix cache, so that a key's prompts hit only
    blocks its own requests wrote: another key's cached tokens, counted in `usage`, would tell
    it what that key had sent; and its grammars compile in its own turn, beside other keys'."""
    limit = state.settings.max_prompt_logprobs_tokens
    if params.prompt_logprobs is not None and (total := sum(map(len, prompts))) > limit:
        raise bad_request(f"prompt logprobs (echo with logprobs, or prompt_logprobs) were asked for {total} "
                          f"prompt tokens; the server's limit is {limit} a request (--max-prompt-logprobs-tokens)",
                          "prompt_logprobs")
    engine = state.engine
    lora = state.adapters.get(model)
    index: dict[str, int] = {}
    suffix = uuid.uuid4().hex[:8]
    if owner:  # the tag has a fixed length: no two (owner, salt) pairs give one string
        cache_salt = f"{owner}:{cache_salt or ''}"
    engine.check_accepting(len(prompts), param, params.n)  # before the checks, which may take a while
    checked = await off_loop_if(sum(map(len, prompts)) > LONG_TEXT, lambda: [
        engine.check_request(ids, params, cache_salt, param, images, priority) for ids in prompts])
    stream = engine.new_stream(len(prompts), param, params.n)  # checked again: nothing awaits from here to the queue
    try:
        for i, request in enumerate(checked):
            rid = f"{base_id}-{suffix}" if len(prompts) == 1 else f"{base_id}-{suffix}-{i}"
            engine.add_checked(stream, rid, request, lora, owner)
            index[rid] = i
    except BaseException:
        stream.abort()
        raise
    return stream, index


async def collect(stream: RequestStream) -> dict[str, RequestOutput]:
    """The final output of each request (the stream asks for final outputs only)."""
    return {out.request_id: out async for out in stream}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
          reasoning_tokens: int | None = None) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens the prefix cache served;
    reasoning_tokens: the thinking's share of the completion (with a reasoning parser, as vLLM)."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached_tokens}}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def stream_usage(body) -> tuple[bool, bool]:
    """stream_options: (a usage chunk at the end, usage on every chunk as well), as vLLM."""
    opts = body.stream_options
    include = opts is not None and opts.include_usage
    return include, include and opts.continuous_usage_stats


def cached_tokens(out) -> int:
    return out.metrics.num_cached_tokens if out.metrics is not None else 0


def sse_response(events: AsyncIterator[dict], stream: RequestStream, named: bool = False,
                 on_error: Callable[[APIError], dict] | None = None) -> EventSourceResponse:
    """Each event is `data: <json>\n\n`; the stream ends with `data: [DONE]`. An error after
    the 200 becomes an error event. A client that goes away aborts the engine requests.
    `named` (the Responses and Messages APIs): each event also has an `event: <its type>` line,
    there is no [DONE], and an error is an `error` event: `on_error`'s (default: error_event's)."""
    async def frames():
        # each event's bytes as sse-starlette would write them (orjson's JSON has no newline)
        try:
            async for event in events:
                data = dumps(event)
                yield b"event: %s\ndata: %s\n\n" % (event["type"].encode(), data) if named else b"data: %s\n\n" % data
        except Exception as e:  # the engine failed, died, timed out or is shutting down: tell the client
            error = failure(e)
            if named:
                yield b"event: error\ndata: %s\n\n" % dumps((on_error or error_event)(error))
            else:
                yield b"data: %s\n\n" % dumps(error.envelope())
        finally:
            stream.abort()
        if not named:
            yield b"data: [DONE]\n\n"
    return _AbortingEventSource(stream, frames(), sep="\n", ping=15)


def failure(e: Exception) -> APIError:
    """What to tell a client whose stream failed after its 200 (logged when it is our fault)."""
    error = engine_error(e) or APIError(500, "internal error", code="internal_error")
    if error.status == 500 and not isinstance(e, RequestFailedError):
        logger.exception("a stream failed")
    return error


def error_event(error: APIError, sequence_number: int | None = None) -> dict:
    """The Responses API's `error` event."""
    event = {"type": "error", "code": error.code or error.envelope()["error"]["type"],
             "message": error.message, "param": error.param}
    if sequence_number is not None:
        event["sequence_number"] = sequence_number
    return event


class _AbortingEventSource(EventSourceResponse):
    """Aborts the engine requests however the response ends, even when it is cancelled
    before its body generator has started."""

    def __init__(self, stream: RequestStream, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.abort()

    async def _send_with_timeout(self, send, message) -> None:
        """With no send timeout (ours), each event's send without the cancel scope that
        sse-starlette opens for a timeout anyway: a tenth of a streamed token's cost."""
        if self.send_timeout is not None:
            return await super()._send_with_timeout(send, message)
        try:
            await send(message)
        except BaseException:
            self._send_interrupted = True  # as the base class marks a send that never completed
            raise
