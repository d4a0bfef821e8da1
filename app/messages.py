"""POST /v1/messages (Anthropic's Messages API, as vLLM and SGLang serve it) on the chat path: the
messages' content blocks become chat messages through the model's template; the answer comes
back as content blocks (thinking, text, tool_use), whole or as Anthropic's stream of named events.
POST /v1/messages/count_tokens counts a conversation's prompt tokens. Errors take Anthropic's
shape: {"type": "error", "error": {"type", "message"}}."""

from __future__ import annotations

import functools
import json
import uuid
from types import SimpleNamespace

import orjson
from starlette.requests import Request
from starlette.responses import Response

from pageserve.app.anthropic_protocol import Conversation, CountTokensRequest, MessagesRequest, ToolChoice
from pageserve.app.chat import chat_prompt
from pageserve.app.errors import APIError, bad_request
from pageserve.app.generation import cached_tokens, collect, sampling_params, sse_response, start
from pageserve.app.http import api_route, json_response, owner, read_json, until_disconnected
from pageserve.app.protocol import (ChatMessage, ChatTool, ContentPart, FunctionCall, FunctionDefinition,
                                    FunctionName, ImageURL, NamedToolChoice, ToolCall)
from pageserve.app.state import ServerState
from pageserve.sampling.params import StructuredOutputsParams
from pageserve.app.tools import ToolFormat, plan_tools, tool_format

# Anthropic's error types by status (the others: invalid_request_error for a 4xx, else api_error)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error"}


def anthropic_error(error: APIError) -> dict:
    kind = _ERROR_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def _anthropic_route(handler):
    """api_route's mapping of failures to statuses, with the body in Anthropic's shape."""
    inner = api_route(handler)

    @functools.wraps(handler)
    async def route(request: Request) -> Response:
        response = await inner(request)
        if response.status_code >= 400 and response.media_type == "application/json":
            envelope = orjson.loads(response.body)["error"]
            where = envelope.get("param")  # Anthropic's errors name the field in the message
            message = envelope["message"] if not where or envelope["message"].startswith(where) else \
                f"{where}: {envelope['message']}"
            error = APIError(response.status_code, message)
            headers = {k: v for k, v in response.headers.items() if k.lower() == "retry-after"}
            return json_response(anthropic_error(error), response.status_code, headers or None)
        return response
    return route


# ---- input ----

def chat_messages(body: Conversation) -> list[ChatMessage]:
    """Content blocks -> chat messages: an assistant turn's text, thinking and tool_use blocks make
    one assistant message (its tool calls, its reasoning_content); a user turn's tool_result
    blocks become tool messages, ahead of its text and images (a tool result's images among them)."""
    messages: list[ChatMessage] = []
    if (system := body.system_text()) is not None:
        messages.append(ChatMessage(role="system", content=system))
    names: dict[str, str] = {}
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            messages.append(ChatMessage(role=m.role, content=m.content))
            continue
        parts: list[ContentPart] = []
        calls: list[ToolCall] = []
        thinking = []
        for j, block in enumerate(m.content):
            where = f"messages.{i}.content.{j}"
            if block.type == "text":
                parts.append(ContentPart(type="text", text=block.text))
            elif block.type == "image":
                if m.role == "assistant":
                    raise bad_request("an assistant message cannot hold an image", where)
                parts.append(_image_part(block, where))
            elif block.type == "tool_use":
                if m.role != "assistant":
                    raise bad_request("tool_use blocks belong to assistant messages", where)
                names[block.id] = block.name
                calls.append(ToolCall(id=block.id, function=FunctionCall(
                    name=block.name, arguments=orjson.dumps(block.input).decode())))
            elif block.type == "tool_result":
                if m.role != "user":
                    raise bad_request("tool_result blocks belong to user messages", where)
                text = ("Error: " if block.is_error else "") + block.text()
                messages.append(ChatMessage(role="tool", content=text, tool_call_id=block.tool_use_id,
                                            name=names.get(block.tool_use_id)))
                parts += [_image_part(image, f"{where}.content.{k}") for k, image in block.images()]
            elif block.type == "thinking":
                thinking.append(block.thinking)
            # redacted_thinking: nothing a template can show
        if not (parts or calls or thinking):
            continue
        content: str | list[ContentPart] | None
        if any(p.type == "image_url" for p in parts):
            content = parts
        else:
            content = "\n".join(p.text for p in parts) if parts or not calls else None
        messages.append(ChatMessage(role=m.role, content=content, tool_calls=calls or None,
                                    reasoning_content="".join(thinking) or None))
    if not any(m.role != "system" for m in messages):
        raise bad_request("the messages hold nothing to answer", "messages")
    return messages


def _image_part(block, where: str) -> ContentPart:
    """An image block as a chat image part that names, in errors, where the client put it."""
    part = ContentPart(type="image_url", image_url=ImageURL(url=block.source.as_url()))
    part._source = where
    return part


def _tools(state: ServerState, body: Conversation, plan: bool = True):
    """The tools as chat tools, and (with `plan`) the plan for their calls."""
    for i, t in enumerate(body.tools or ()):
        if t.type not in (None, "custom"):
            raise bad_request(f"server tools ({t.type}) are not supported: only tools the client runs", f"tools.{i}.type")
    tools = [ChatTool(function=FunctionDefinition(name=t.name, description=t.description, parameters=t.input_schema))
             for t in body.tools or ()]
    if not plan:
        return tools or None, None
    choice: ToolChoice | None = body.tool_choice
    if choice is None:
        named = None
    elif choice.type == "tool":
        named = NamedToolChoice(function=FunctionName(name=choice.name))
    else:
        named = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    parallel = not (choice is not None and choice.disable_parallel_tool_use)
    plan = plan_tools(tools, named, parallel, state.settings.enable_auto_tool_choice,
                      tool_format(state.settings.tool_call_parser))
    return tools or None, plan


def _effort(body: Conversation) -> str | None:
    """output_config.effort: the template's reasoning_effort (thinking.type still decides
    enable_thinking where given)"""
    config = getattr(body, "output_config", None)
    return config.effort if config is not None else None


async def _prompt(state: ServerState, body: Conversation, plan: bool = True):
    tools, tool_plan = _tools(state, body, plan)
    kwargs = {"enable_thinking": body.thinking.type != "disabled"} if body.thinking is not None else None
    messages = chat_messages(body)
    prefill = messages[-1].role == "assistant" and bool(messages[-1].content)  # the answer goes on from it
    view = SimpleNamespace(messages=messages, add_generation_prompt=not prefill, continue_final_message=prefill,
                           tools=tools, chat_template_kwargs=kwargs, reasoning_effort=_effort(body))
    return (*await chat_prompt(state, view), tool_plan)


# ---- the routes ----

@_anthropic_route
async def count_tokens(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await read_json(request, CountTokensRequest, state.settings.max_request_body_bytes)
    state.check_model(body.model)
    _, ids, _, _ = await _prompt(state, body, plan=False)  # (no grammar to compile for a count)
    return json_response({"input_tokens": len(ids)})


@_anthropic_route
async def create_message(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await read_json(request, MessagesRequest, state.settings.max_request_body_bytes)
    model = state.check_model(body.model)
    prompt_text, prompt_ids, images, plan = await _prompt(state, body)
    grammar = plan.grammar if plan is not None else None
    fmt = body.output_config.format if body.output_config is not None else None
    if fmt is not None:
        if grammar is not None:
            raise bad_request("output_config.format cannot be combined with tool calls (each is a grammar); "
                              "send the tools with tool_choice none, or leave them out", "output_config.format")
        try:
            grammar = StructuredOutputsParams(json=fmt.schema_, source="output_config.format")
        except ValueError as e:
            raise bad_request(str(e), "output_config.format") from None
    tool_parser = plan.format if plan is not None and plan.parse else None
    thinking = state.reasoning
    budget = None
    if thinking is not None:
        grammar = thinking.after_reasoning(grammar, prompt_text)
        if body.thinking is not None and body.thinking.type == "enabled" and body.thinking.budget_tokens is not None:
            budget = thinking.budget(body.thinking.budget_tokens, prompt_text)
    view = SimpleNamespace(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=None,
                           repetition_penalty=None, presence_penalty=0.0, frequency_penalty=0.0,
                           stop=body.stop_sequences, ignore_eos=False, seed=None, stream=body.stream)
    params = sampling_params(view, body.max_tokens, None, structured=grammar, defaults=state.sampling_defaults,
                             thinking=budget)
    rid = f"msg_{uuid.uuid4().hex[:24]}"
    stream, _ = await start(state, rid, [prompt_ids], params, None, "messages", images, model, body.priority,
                            owner=owner(request))
    head = {"id": rid, "type": "message", "role": "assistant", "model": model}
    if body.stream:
        reasoning = thinking.stream(prompt_text) if thinking is not None else None
        events = _events(stream, head, len(prompt_ids), tool_parser, reasoning)
        return sse_response(events, stream, named=True, on_error=anthropic_error)
    try:
        outs = await until_disconnected(request, collect(stream))
    finally:
        stream.abort()
    out = next(iter(outs.values()))
    c = out.outputs[0]
    blocks = []
    text = c.text
    if thinking is not None:
        reasoning, text = thinking.extract(c.text, prompt_text)
        if reasoning:
            blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    content, calls = tool_parser.parse(text or "", c.finish_reason == "length") if tool_parser else (text, [])
    if content:
        blocks.append({"type": "text", "text": content})
    blocks += [_tool_use(call["id"], call["function"]["name"], call["function"]["arguments"]) for call in calls]
    return json_response({**head, "content": blocks, **_stop(c, bool(calls)),
                          "usage": _usage(len(prompt_ids), len(c.token_ids), cached_tokens(out))})


def _tool_use(call_id: str, name: str, arguments: str) -> dict:
    """`input` is the call's own JSON text where it is an object: read back, a number past a
    double's range would fail and an integer past 64 bits lose digits (the stream sends it as
    written, too)."""
    arguments = arguments or "{}"
    try:
        args = json.loads(arguments, parse_constant=_no_constant)
    except (ValueError, RecursionError):  # (the parsers hand out valid calls only)
        args = None
    return {"type": "tool_use", "id": call_id, "name": name,
            "input": orjson.Fragment(arguments.encode()) if isinstance(args, dict) else {}}


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _stop(c, called: bool) -> dict:
    """stop_reason and stop_sequence of a finished sequence."""
    if c.finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if called:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if isinstance(c.stop_reason, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": c.stop_reason}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def _usage(num_prompt: int, num_output: int, cached: int) -> dict:
    """Anthropic counts the prompt tokens read from the cache apart from the others."""
    return {"input_tokens": num_prompt - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": num_output}


class _Blocks:
    """The content blocks of a streamed message: each piece of thinking, text or a tool call's
    input goes into the open block of its kind, or closes it and opens the next."""

    def __init__(self):
        self.index = -1
        self.kind: str | None = None

    def open(self, block: dict) -> list[dict]:
        events = self.close()
        self.index += 1
        self.kind = block["type"]
        return events + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def close(self) -> list[dict]:
        if self.kind is None:
            return []
        # a thinking block's signature comes last, as Anthropic streams it (clients such as the
        # AI SDK learn it there, and send the thinking back on the next turn only with it)
        signed = [{"type": "content_block_delta", "index": self.index,
                   "delta": {"type": "signature_delta", "signature": ""}}] if self.kind == "thinking" else []
        self.kind = None
        return signed + [{"type": "content_block_stop", "index": self.index}]

    def delta(self, kind: str, delta: dict) -> list[dict]:
        events = []
        if self.kind != kind:
            events = self.open({"thinking": {"type": "thinking", "thinking": "", "signature": ""},
                                "text": {"type": "text", "text": ""}}[kind])
        return events + [{"type": "content_block_delta", "index": self.index, "delta": delta}]


async def _events(stream, head: dict, num_prompt: int, tool_parser: ToolFormat | None, thinking):
    yield {"type": "message_start", "message": {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                                                 "usage": _usage(num_prompt, 0, 0)}}
    blocks = _Blocks()
    parser = tool_parser.stream_parser() if tool_parser is not None else None
    num_output = cached = 0
    async for out in stream:
        cached = max(cached, cached_tokens(out))
        c = out.outputs[0]
        num_output += len(c.token_ids)
        text, last = c.text, c.finish_reason is not None
        if thinking is not None:
            reasoning, text = thinking.feed(c.text, last=last)
            if reasoning:
                for event in blocks.delta("thinking", {"type": "thinking_delta", "thinking": reasoning}):
                    yield event
        deltas = [{"content": text}] if parser is None else parser.feed(text)
        if parser is not None and last:
            deltas += parser.finish(c.finish_reason == "length")
        for delta in deltas:
            for event in _block_events(blocks, delta):
                yield event
        if last:
            for event in blocks.close():
                yield event
            called = parser is not None and parser.num_calls > len(parser.failed_calls)
            yield {"type": "message_delta", "delta": _stop(c, called), "usage": _usage(num_prompt, num_output, cached)}
            yield {"type": "message_stop"}


def _block_events(blocks: _Blocks, delta: dict) -> list[dict]:
    """A chat delta (app/tool_parsers/stream.py: content, or a tool call's first piece or
    arguments) as Anthropic's block events."""
    if "content" in delta:
        return blocks.delta("text", {"type": "text_delta", "text": delta["content"]}) if delta["content"] else []
    call = delta["tool_calls"][0]
    events = []
    if "id" in call:
        events = blocks.open({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}})
    if call["function"]["arguments"]:
        events.append({"type": "content_block_delta", "index": blocks.index,
                       "delta": {"type": "input_json_delta", "partial_json": call["function"]["arguments"]}})
    return events
