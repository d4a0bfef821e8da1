"""POST /v1/responses (OpenAI's Responses API) on the chat path: input items become chat
messages through the model's template, the answer comes back as output items (reasoning,
message, function calls), whole or as the documented stream of events. GET and DELETE
/v1/responses/{id} read the in-memory store that `previous_response_id` continues from."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from starlette.requests import Request
from starlette.responses import Response

from pageserve.app.chat import chat_prompt
from pageserve.app.errors import APIError, bad_request
from pageserve.app.generation import (cached_tokens, collect, error_event, failure, sampling_params,
                                      sse_response, start)
from pageserve.app.http import api_route, json_response, many_logprobs, owner, read_json, reply, until_disconnected
from pageserve.app.json_out import dumps
from pageserve.app.logprobs import chat_logprobs
from pageserve.app.protocol import (ChatMessage, ChatTool, FunctionCall, FunctionDefinition, FunctionName,
                                    NamedToolChoice, ToolCall)
from pageserve.app.reasoning import ReasoningStream, ThinkingTokens
from pageserve.app.response_output import ResponseOutput, item_id
from pageserve.app.response_store import ChainTooLong, StoredResponse, check_chain, find_items
from pageserve.app.responses_protocol import ResponsesRequest
from pageserve.app.state import ServerState
from pageserve.app.tools import ToolFormat, plan_tools, tool_format
from pageserve.sampling.params import StructuredOutputsParams

LOGPROBS_INCLUDE = "message.output_text.logprobs"


# ---- input ----

async def _input_items(state: ServerState, who: str, body: ResponsesRequest) -> list[dict]:
    """The request's input as item dicts, each with an id; item references resolved among the
    caller's own stored responses (read off the event loop)."""
    if isinstance(body.input, str):
        return [{"id": item_id("msg"), "type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": body.input}]}]
    items: list = []
    places, references = [], []
    for i, item in enumerate(body.input):
        if item.type == "item_reference":
            holder = state.responses.holder(who, item.id)
            if holder is None:
                raise bad_request(f"item_reference {item.id!r} names no item of a stored response", f"input.{i}.id")
            places.append(len(items))
            references.append((holder, item.id))
            items.append(None)
            continue
        d = item.model_dump(exclude_none=True)
        if isinstance(d.get("content"), str):
            d["content"] = [{"type": "input_text" if d.get("role") != "assistant" else "output_text",
                             "text": d["content"]}]
        d.pop("encrypted_content", None)  # never rendered: not worth its room in the store
        d.setdefault("id", item_id({"message": "msg", "function_call": "fc", "reasoning": "rs"}.get(item.type, "item")))
        items.append(d)
    if references:
        for place, found in zip(places, await asyncio.to_thread(find_items, references)):
            items[place] = found
    return items


def _text(parts) -> str:
    return parts if isinstance(parts, str) else "".join(p.get("text", "") for p in parts)


def _content(parts) -> str | list[dict]:
    """A message item's content for a chat message: its text, or its parts where it has images."""
    if isinstance(parts, str) or not any(p.get("type") == "input_image" for p in parts):
        return _text(parts)
    return [{"type": "image_url", "image_url": {"url": p["image_url"]}} if p.get("type") == "input_image"
            else {"type": "text", "text": p.get("text", "")} for p in parts]


def chat_messages(instructions: str | None, items: list[dict]) -> list[ChatMessage]:
    """Items -> chat messages: function calls join the assistant message before them (or make
    one), their outputs become tool messages, a reasoning item becomes the next assistant
    message's reasoning_content (for templates that show past thinking)."""
    messages: list[ChatMessage] = []
    if instructions:
        messages.append(ChatMessage(role="system", content=instructions))
    names: dict[str, str] = {}
    thought = None
    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            thought = "".join(p["text"] for p in item.get("content") or item.get("summary") or ())
        elif kind == "message":
            messages.append(ChatMessage(role=item["role"], content=_content(item["content"])))
        elif kind == "function_call":
            call = ToolCall(id=item["call_id"], function=FunctionCall(name=item["name"], arguments=item["arguments"]))
            names[item["call_id"]] = item["name"]
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            messages.append(ChatMessage(role="tool", content=_text(item["output"]), tool_call_id=item["call_id"],
                                        name=names.get(item["call_id"])))
        if kind != "reasoning":  # a thought belongs to the assistant turn right after it
            if thought and messages[-1].role == "assistant":
                messages[-1].reasoning_content = thought
            thought = None
    if not messages:
        raise bad_request("the input has no message to answer", "input")
    return messages


def _tool_plan(state: ServerState, body: ResponsesRequest):
    tools = [ChatTool(function=FunctionDefinition(name=t.name, description=t.description, parameters=t.parameters,
                                                  strict=t.strict)) for t in body.tools or ()]
    choice = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = NamedToolChoice(function=FunctionName(name=choice.name))
    return tools or None, plan_tools(tools, choice, body.parallel_tool_calls, state.settings.enable_auto_tool_choice,
                                     tool_format(state.settings.tool_call_parser))


def _text_format(body: ResponsesRequest) -> StructuredOutputsParams | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True, source="text.format")
    if fmt.schema_ is None:
        raise bad_request("text.format of type json_schema needs a schema", "text.format.schema")
    try:
        return StructuredOutputsParams(json=fmt.schema_, source="text.format")
    except ValueError as e:
        raise bad_request(str(e), "text.format") from None


# ---- the route ----

@api_route
async def create_response(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await read_json(request, ResponsesRequest, state.settings.max_request_body_bytes)
    model = state.check_model(body.model)
    if body.background:
        raise bad_request("background responses are not supported: leave background unset", "background")
    if body.truncation == "auto":
        raise bad_request("truncation auto is not supported: a conversation longer than the model's context "
                          "is a 400", "truncation")
    who = owner(request)
    previous = None
    if body.previous_response_id is not None:
        previous = _stored(state, who, body.previous_response_id)
    items = await _input_items(state, who, body)
    if previous is None:
        messages = chat_messages(body.instructions, items)
    else:
        try:
            check_chain(previous.turns + 1, previous.items + len(items))
        except ChainTooLong as e:
            raise bad_request(str(e), "previous_response_id") from None
        # a chain of many turns is many JSON documents to read: off the event loop
        messages = await asyncio.to_thread(lambda: chat_messages(body.instructions,
                                                                 [*previous.conversation(), *items]))
    tools, plan = _tool_plan(state, body)
    grammar = _text_format(body)
    if plan is not None and plan.grammar is not None:
        if grammar is not None:
            raise bad_request("function tools and a text.format cannot be combined; use tool_choice none",
                              "text.format")
        grammar = plan.grammar
    parse_tools = plan.format if plan is not None and plan.parse else None
    view = SimpleNamespace(messages=messages, add_generation_prompt=True, continue_final_message=False,
                           tools=tools, chat_template_kwargs=body.chat_template_kwargs,
                           reasoning_effort=body.reasoning.effort if body.reasoning else None)
    prompt_text, prompt_ids, images = await chat_prompt(state, view, "input")
    thinking = None
    if state.reasoning is not None:  # the parser reads where the template left the think block
        grammar = state.reasoning.after_reasoning(grammar, prompt_text)
        thinking = state.reasoning.stream(prompt_text)
    want_logprobs = body.top_logprobs is not None or LOGPROBS_INCLUDE in (body.include or ())
    params = sampling_params(body, body.max_output_tokens, (body.top_logprobs or 0) if want_logprobs else None,
                             structured=grammar, defaults=state.sampling_defaults)
    rid = item_id("resp")  # never the client's X-Request-Id: a stored response's id must be unique
    stream, _ = await start(state, rid, [prompt_ids], params, body.cache_salt, "input", images, model,
                            body.priority, owner=who)
    answer = _Answer(state, body, rid, model, params.temperature, params.top_p, len(prompt_ids), parse_tools,
                     want_logprobs, thinking, previous, items, who)
    if body.stream:
        return sse_response(answer.events(stream), stream, named=True)
    try:
        outs = await until_disconnected(request, collect(stream))
    finally:
        stream.abort()
    out = next(iter(outs.values()))

    def build() -> dict:
        answer.feed(out)
        return answer.finish(out.outputs[0].finish_reason)
    return await reply(build, many_logprobs(len(out.outputs[0].token_ids), params.logprobs))


class _Answer:
    """One response as it is written: the output builder, the tool-call parsing, the response
    object and, once finished, its place in the store."""

    def __init__(self, state: ServerState, body: ResponsesRequest, rid: str, model: str, temperature: float,
                 top_p: float, num_prompt: int, parse_tools: ToolFormat | None, want_logprobs: bool,
                 thinking: ReasoningStream | None, previous: StoredResponse | None, items: list[dict], who: str):
        self.state, self.body, self.rid, self.model = state, body, rid, model
        self.temperature, self.top_p = temperature, top_p
        self.num_prompt, self.num_output, self.cached = num_prompt, 0, 0
        self.want_logprobs = want_logprobs
        self.created = int(time.time())
        self.output = ResponseOutput()
        self.tools = parse_tools.stream_parser() if parse_tools else None
        self.thinking = thinking  # the reasoning parser's split of this answer, when one is on
        self.thought = ThinkingTokens(state.reasoning.end_token_ids) if thinking is not None else None
        self.previous, self.items, self.owner = previous, items, who
        self.held_logprobs: list[dict] = []  # of tokens whose text the tool parser holds back

    def feed(self, out) -> None:
        """One engine output (a delta when streaming, the whole answer otherwise)."""
        self.cached = max(self.cached, cached_tokens(out))
        c = out.outputs[0]
        self.num_output += len(c.token_ids)
        logprobs = chat_logprobs(c.logprobs, self.state.token_text)["content"] if self.want_logprobs and c.logprobs \
            else None
        text = c.text
        if self.thinking is not None:
            reasoning, text = self.thinking.feed(c.text, last=c.finish_reason is not None)
            self.output.reasoning(reasoning)
            thought = self._track_reasoning(c.token_ids)
            if logprobs:  # output_text carries the logprobs of the answer's tokens only
                logprobs = logprobs[thought:] or None
        if self.tools is None:
            self.output.text(text, logprobs)
            return
        deltas = self.tools.feed(text)
        if c.finish_reason is not None:
            deltas += self.tools.finish(c.finish_reason == "length")
        self.output.failed_calls.update(self.tools.failed_calls)
        if logprobs and not deltas:  # text the parser holds back: its logprobs go with what follows,
            self.held_logprobs += logprobs
            if c.finish_reason is not None and self.output.writing_text:  # or with the text before it
                self.output.text("", self.held_logprobs)
            return
        logprobs, self.held_logprobs = (self.held_logprobs + (logprobs or [])) or None, []
        for i, delta in enumerate(deltas):
            self._delta(delta, logprobs if i == 0 else None)

    def _track_reasoning(self, token_ids) -> int:
        """Adds a delta's tokens; how many of them are thinking (the end marker included)."""
        before = len(self.thought.token_ids)
        self.thought.add(token_ids)
        return max(0, self.thought.count(self.thinking.reasoned) - before)

    def _delta(self, delta: dict, logprobs) -> None:
        if "content" in delta:
            self.output.text(delta["content"], logprobs)
            return
        for call in delta["tool_calls"]:
            if "id" in call:
                self.output.call(call["id"], call["function"]["name"])
            self.output.arguments(call["function"].get("arguments", ""))

    def response(self, status: str, output: list[dict], usage: dict | None = None, incomplete: str | None = None,
                 error: dict | None = None) -> dict:
        b = self.body
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else {"type": "text"}
        return {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "max_tool_calls": None,
            "model": self.model, "output": output, "parallel_tool_calls": b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": b.reasoning.effort if b.reasoning else None, "summary": None},
            "service_tier": "default", "store": b.store, "temperature": self.temperature,
            "text": {"format": fmt}, "tool_choice": _dump(b.tool_choice) or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or ()], "top_logprobs": b.top_logprobs or 0,
            "top_p": self.top_p, "truncation": b.truncation, "usage": usage, "user": b.user,
            "metadata": b.metadata or {},
        }

    def usage(self) -> dict:
        return {"input_tokens": self.num_prompt, "input_tokens_details": {"cached_tokens": self.cached},
                "output_tokens": self.num_output, "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens()},
                "total_tokens": self.num_prompt + self.num_output}

    def _reasoning_tokens(self) -> int:
        """Output tokens up to the end of the thinking (its end marker included), all of them
        while it has not ended; 0 without thinking."""
        return 0 if self.thinking is None else self.thought.count(self.thinking.reasoned)

    def finish(self, finish_reason: str | None) -> dict:
        """Close the output; the finished response object, stored when the request asks."""
        cut = finish_reason == "length"
        self.output.close("incomplete" if cut else "completed")
        status = "incomplete" if cut else "completed"
        resp = self.response(status, self.output.items, self.usage(), "max_output_tokens" if cut else None)
        if self.body.store:
            self.state.responses.put(self.owner, self.rid, StoredResponse.build(resp, tuple(self.items), self.previous))
        return resp

    async def events(self, stream):
        """The streamed events, numbered; a failure after the start ends with `error` and
        `response.failed`."""
        seq = 0

        def numbered(event: dict) -> dict:
            nonlocal seq
            event["sequence_number"] = seq
            seq += 1
            return event

        yield numbered({"type": "response.created", "response": self.response("in_progress", [])})
        yield numbered({"type": "response.in_progress", "response": self.response("in_progress", [])})
        finish_reason = None
        try:
            async for out in stream:
                self.feed(out)
                finish_reason = out.outputs[0].finish_reason or finish_reason
                for event in self.output.drain():
                    yield numbered(event)
        except Exception as e:
            error = failure(e)
            yield numbered(error_event(error))
            failed = self.response("failed", self.output.snapshot(), self.usage(),
                                   error={"code": error.code or "server_error", "message": error.message})
            yield numbered({"type": "response.failed", "response": failed})
            return
        resp = self.finish(finish_reason)
        for event in self.output.drain():
            yield numbered(event)
        kind = "response.incomplete" if resp["status"] == "incomplete" else "response.completed"
        yield numbered({"type": kind, "response": resp})


def _dump(value):
    return value.model_dump() if hasattr(value, "model_dump") else value


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param="response_id",
                    code="response_not_found")


def _stored(state: ServerState, who: str, response_id: str) -> StoredResponse:
    """`who`'s stored response of that id; 404 for another owner's, as for one that never was."""
    stored = state.responses.get(who, response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored


@api_route
async def get_response(request: Request) -> Response:
    stored = _stored(request.app.state.server, owner(request), request.path_params["response_id"])
    return Response(stored.response_bytes, media_type="application/json")


@api_route
async def delete_response(request: Request) -> Response:
    state: ServerState = request.app.state.server
    rid = request.path_params["response_id"]
    if not state.responses.delete(owner(request), rid):
        raise _not_found(rid)
    return json_response({"id": rid, "object": "response.deleted", "deleted": True})


@api_route
async def list_input_items(request: Request) -> Response:
    """A page of a stored response's input items, as OpenAI's: `order` (desc by default),
    `limit` (1 to 100, 20 by default) and `after` (an item id)."""
    stored = _stored(request.app.state.server, owner(request), request.path_params["response_id"])
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order must be asc or desc", "order")
    limit = query.get("limit", "20")
    if not (limit.isascii() and limit.isdigit() and len(limit) <= 3) or not 1 <= int(limit) <= 100:
        raise bad_request("limit must be an integer from 1 to 100", "limit")
    after = query.get("after")

    def page() -> bytes:  # a stored list may be megabytes of JSON: read off the event loop
        data = stored.input_items
        if order == "desc":
            data.reverse()
        start = 0
        if after is not None:
            start = next((i + 1 for i, item in enumerate(data) if item["id"] == after), None)
            if start is None:
                raise bad_request(f"after {after!r} is not an input item of this response", "after")
        data, more = data[start:start + int(limit)], start + int(limit) < len(data)
        return dumps({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                      "last_id": data[-1]["id"] if data else None, "has_more": more})
    return Response(await asyncio.to_thread(page), media_type="application/json")
