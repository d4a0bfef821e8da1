"""POST /v1/chat/completions: messages through the model's chat template, answered whole or
streamed as chat.completion.chunk events."""

from __future__ import annotations

import asyncio
import time

import orjson
from starlette.requests import Request
from starlette.responses import Response

from pageserve.app.errors import bad_request
from pageserve.app.generation import (cached_tokens, collect, request_id, sampling_params, sse_response, start,
                                      stream_usage, usage)
from pageserve.app.http import (api_route, many_entries, many_logprobs, off_loop_if, owner, read_json, reply,
                                until_disconnected)
from pageserve.app.logprobs import chat_logprobs
from pageserve.app.protocol import ChatCompletionRequest, ChatMessage
from pageserve.app.reasoning import ReasoningStream, ThinkingTokens
from pageserve.app.state import LONG_TEXT, ServerState
from pageserve.app.structured import structured_outputs
from pageserve.app.tools import ToolFormat, plan_tools, tool_format


# chat_template_kwargs that would overwrite what render_chat passes itself
_RESERVED = {"conversation", "messages", "tools", "tokenize", "add_generation_prompt",
             "continue_final_message", "return_dict", "chat_template"}


def render_chat(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True,
                continue_final_message: bool = False, tools: list | None = None,
                template_kwargs: dict | None = None, tool_parser: ToolFormat | None = None,
                image_placeholder: str = "") -> str:
    """`tool_parser`: the tool-call format the prompt describes tools and earlier calls in
    (hermes when None), for a template that does not render them itself. Each image part is
    written as `image_placeholder` (which the model's processor expands into its tokens)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise bad_request("this model has no chat template: start the server with --chat-template "
                          "(a Jinja file or string), or use /v1/completions", "messages")
    if continue_final_message and messages[-1].role != "assistant":
        raise bad_request("continue_final_message needs an assistant message last", "messages")
    dicts, template_tools = (tool_parser or tool_format(None)).chat_dicts(
        messages, tools, template if isinstance(template, str) else "", image_placeholder)
    try:
        return tokenizer.apply_chat_template(
            dicts, tools=template_tools, tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            **{k: v for k, v in (template_kwargs or {}).items() if k not in _RESERVED})
    except Exception as e:  # the template's own raise_exception, or a jinja error
        raise bad_request(f"the chat template could not render these messages: {e}", "messages") from None


def template_kwargs(body) -> dict | None:
    """The chat template's extra variables: a request's reasoning effort as vLLM passes it
    (`reasoning_effort`, and `enable_thinking`: false for "none", true for any other) and its
    `documents`, under the request's own chat_template_kwargs, which win."""
    kwargs, effort = getattr(body, "chat_template_kwargs", None), getattr(body, "reasoning_effort", None)
    documents = getattr(body, "documents", None)
    if effort is None and documents is None:
        return kwargs
    given = {} if effort is None else {"reasoning_effort": effort, "enable_thinking": effort != "none"}
    return {**given, **({} if documents is None else {"documents": documents}), **(kwargs or {})}


def _text_size(body) -> int:
    """About how many characters the template will write: every message's text, thinking and
    tool calls, and the tools' descriptions and schemas."""
    size = 0
    for m in body.messages:
        size += len(m.text()) + len(m.reasoning_content or "") + len(m.reasoning or "")
        for call in m.tool_calls or ():
            size += len(call.function.name) + len(call.function.arguments)
    for tool in getattr(body, "tools", None) or ():
        size += len(tool.function.description or "") + len(orjson.dumps(tool.function.parameters))
    return size + len(orjson.dumps(getattr(body, "chat_template_kwargs", None))) + len(
        orjson.dumps(getattr(body, "documents", None)))


async def chat_prompt(state: ServerState, body, param: str = "messages",
                      bounded: bool = True) -> tuple[str, list[int], tuple]:
    """The rendered conversation (what a reasoning parser reads), its token ids (each image's
    tokens in place) and its images (runtime.multimodal.ImageItem). `param`: the request field
    the messages came from, for errors. `bounded`: a text far longer than the context is refused
    (not for /tokenize, which counts any)."""
    with state.media.holding() as take:  # the decoded images, until the prompt is made of them
        images = await load_images(state, body.messages, param, take)
        placeholder = state.engine.image_placeholder if images else ""
        args = (state.tokenizer, body.messages, body.add_generation_prompt, body.continue_final_message,
                getattr(body, "tools", None), template_kwargs(body),
                tool_format(state.settings.tool_call_parser), placeholder)
        # a big conversation renders off the loop, so that streams go on meanwhile
        if len(body.messages) > 64 or _text_size(body) > LONG_TEXT:
            text = await asyncio.to_thread(render_chat, *args)
        else:
            text = render_chat(*args)
        keep = state.truncation(body)
        if images:  # the template wrote the special tokens
            ids, items = await asyncio.to_thread(state.engine.process_images, text, images, param, False, bounded)
            if keep is not None and len(ids) > keep:
                raise bad_request(f"truncate_prompt_tokens ({keep}) would cut this conversation's images out of "
                                  f"its {len(ids)} tokens", "truncate_prompt_tokens")
            return text, ids, items
    return text, await state.tokenize(text, add_special_tokens=False, param=param if bounded else None,
                                      keep_last=keep), ()


async def load_images(state: ServerState, messages: list[ChatMessage], param: str, take) -> list:
    """The messages' images in order, decoded and checked (a 400 names the part; the Responses
    API's, its `input`: its items are not these messages one for one). `take`: the request's
    MediaLoader.holding()."""
    parts = [(source or (f"{param}.{i}.content.{j}" if param == "messages" else param), url)
             for i, m in enumerate(messages) for j, url, source in m.image_urls()]
    if not parts:
        return []
    if state.engine.image_placeholder is None:
        raise bad_request(f"the model {state.model_name} takes no images", parts[0][0])
    limit = state.engine.max_images
    if len(parts) > limit:
        raise bad_request(f"{len(parts)} images in one prompt; this server takes at most {limit} "
                          "(--limit-mm-per-prompt)", parts[limit][0])
    return [await state.media.load(url, where, take) for where, url in parts]


@api_route
async def chat_completions(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await read_json(request, ChatCompletionRequest, state.settings.max_request_body_bytes)
    model = state.check_model(body.model)
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    if body.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs is served by /v1/completions", "prompt_logprobs")
    plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls,
                      state.settings.enable_auto_tool_choice, tool_format(state.settings.tool_call_parser))
    grammar, source = structured_outputs(body)
    if plan is not None and plan.grammar is not None:
        if grammar is not None:
            raise bad_request(f"tool calls and {source} cannot be combined; use tool_choice none", source)
        grammar = plan.grammar
    tool_parser = plan.format if plan is not None and plan.parse else None
    calls_finish = plan.finish if plan is not None else "tool_calls"
    prompt_text, prompt_ids, images = await chat_prompt(state, body)
    thinking = state.reasoning
    if thinking is not None:
        grammar = thinking.after_reasoning(grammar, prompt_text)
    budget = None
    if body.thinking_token_budget is not None:
        if thinking is None:
            raise bad_request("thinking_token_budget bounds a reasoning model's thinking: the server has no "
                              "--reasoning-parser", "thinking_token_budget")
        budget = thinking.budget(body.thinking_token_budget, prompt_text)
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None,
                             structured=grammar, defaults=state.sampling_defaults, thinking=budget)
    rid = request_id("chatcmpl", request)
    stream, _ = await start(state, rid, [prompt_ids], params, body.cache_salt, "messages", images, model,
                            body.priority, owner=owner(request))
    created = int(time.time())
    head = {"id": rid, "created": created, "model": model}
    labels, with_ids = state.token_labels(body), bool(body.return_token_ids)
    if body.stream:
        streams = [thinking.stream(prompt_text) for _ in range(body.n)] if thinking is not None else None
        return sse_response(_chunks(state, stream, head, body.n, prompt_ids, stream_usage(body), tool_parser,
                                    calls_finish, streams, labels, with_ids), stream)
    try:
        outs = await until_disconnected(request, collect(stream))
    finally:
        stream.abort()
    out = next(iter(outs.values()))
    num_generated = sum(len(c.token_ids) for c in out.outputs)
    thought = None if thinking is None else sum(
        _thinking_tokens(state, c.token_ids, thinking.extract(c.text, prompt_text)[0] is not None) for c in out.outputs)

    def choice(c) -> dict:
        message = {"role": "assistant"}
        text = c.text
        if thinking is not None:  # vLLM's field and its newer name
            reasoning, text = thinking.extract(c.text, prompt_text)
            message.update(reasoning_content=reasoning, reasoning=reasoning)
        content, calls = tool_parser.parse(text or "", c.finish_reason == "length") if tool_parser else (text, [])
        message.update(content=content, tool_calls=calls)
        return {"index": c.index, "message": message,
                "logprobs": chat_logprobs(c.logprobs, labels) if c.logprobs is not None else None,
                "finish_reason": calls_finish if calls and c.finish_reason == "stop" else c.finish_reason,
                "stop_reason": c.stop_reason, **({"token_ids": list(c.token_ids)} if with_ids else {})}

    def build() -> dict:  # each choice made as it is written
        return {"object": "chat.completion", **head, "choices": map(choice, out.outputs),
                "usage": usage(len(prompt_ids), num_generated, cached_tokens(out), thought),
                **({"prompt_token_ids": prompt_ids} if with_ids else {})}
    return await reply(build, many_logprobs(num_generated, params.logprobs))


def _thinking_tokens(state: ServerState, token_ids, reasoned: bool) -> int:
    tokens = ThinkingTokens(state.reasoning.end_token_ids)
    tokens.add(token_ids)
    return tokens.count(reasoned)


async def _chunks(state: ServerState, stream, head: dict, n: int, prompt_ids: list[int],
                  usage_mode: tuple[bool, bool], tool_parser: ToolFormat | None, calls_finish: str,
                  thinking: list[ReasoningStream] | None, labels, with_ids: bool):
    """`calls_finish`: the finish_reason of a choice that calls ended (ToolPlan.finish).
    `thinking`: each choice's reasoning split, when a reasoning parser is on. `labels`: how
    logprob entries name tokens. `with_ids` (return_token_ids): the prompt's token ids on the
    first chunk, and each piece's own on the first chunk made of it."""
    include_usage, continuous = usage_mode
    num_generated = cached = 0
    num_prompt = len(prompt_ids)
    thought = [ThinkingTokens(state.reasoning.end_token_ids) for _ in range(n)] if thinking is not None else None

    def thinking_tokens() -> int | None:
        return None if thought is None else sum(t.count(s.reasoned) for t, s in zip(thought, thinking))

    def chunk(index: int, delta: dict, finish_reason=None, stop_reason=None, logprobs=None, token_ids=None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        if with_ids:
            choice["token_ids"] = token_ids or []
        c = {"object": "chat.completion.chunk", **head, "choices": [choice]}
        if include_usage:
            c["usage"] = usage(num_prompt, num_generated, cached, thinking_tokens()) if continuous else None
        return c

    for i in range(n):
        first = chunk(i, {"role": "assistant", "content": ""})
        yield {**first, "prompt_token_ids": prompt_ids} if with_ids and i == 0 else first
    parsers = [tool_parser.stream_parser() for _ in range(n)] if tool_parser else None
    async for out in stream:
        cached = max(cached, cached_tokens(out))
        for c in out.outputs:
            num_generated += len(c.token_ids)
            logprobs = None if not c.logprobs else await off_loop_if(
                many_entries(c.logprobs), lambda c=c: chat_logprobs(c.logprobs, labels))
            ids = list(c.token_ids) if with_ids else None  # on the first chunk of this piece, as logprobs
            text = c.text
            if thinking is not None:
                thought[c.index].add(c.token_ids)
                reasoning, text = thinking[c.index].feed(c.text, last=c.finish_reason is not None)
                if reasoning:
                    yield chunk(c.index, {"reasoning_content": reasoning, "reasoning": reasoning}, logprobs=logprobs,
                                token_ids=ids)
                    logprobs = ids = None
            if parsers is None:
                if text or logprobs or ids:
                    yield chunk(c.index, {"content": text}, logprobs=logprobs, token_ids=ids)
            else:
                parser = parsers[c.index]
                deltas = parser.feed(text)
                if c.finish_reason is not None:
                    deltas += parser.finish(c.finish_reason == "length")
                for delta in deltas:
                    yield chunk(c.index, delta, logprobs=logprobs, token_ids=ids)
                    logprobs = ids = None
                if (logprobs or ids) and not deltas:
                    yield chunk(c.index, {"content": ""}, logprobs=logprobs, token_ids=ids)
            if c.finish_reason is not None:
                reason = c.finish_reason
                # calls cut short (a stop string inside one) are not calls, as in the whole answer
                parser = parsers[c.index] if parsers is not None else None
                if parser is not None and parser.num_calls > len(parser.failed_calls) and reason == "stop":
                    reason = calls_finish
                yield chunk(c.index, {}, reason, c.stop_reason)
    if include_usage:
        yield {"object": "chat.completion.chunk", **head, "choices": [],
               "usage": usage(num_prompt, num_generated, cached, thinking_tokens())}
