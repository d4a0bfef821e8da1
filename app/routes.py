"""The route table: every route once, with its handler, its OpenAPI summary and body model, and
whether it is open without an API key. The router, the OpenAPI document and the API-key check
are all derived from it. Also the handlers too small for a module of their own."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from pageserve.app.chat import chat_completions, chat_prompt
from pageserve.app.completions import completions
from pageserve.app.embeddings import embeddings
from pageserve.app.errors import APIError
from pageserve.app.frontend import chat_page
from pageserve.app.http import api_route, json_response, read_json
from pageserve.app.anthropic_protocol import CountTokensRequest, MessagesRequest
from pageserve.app.lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, load_lora_adapter, unload_lora_adapter
from pageserve.app.messages import count_tokens, create_message
from pageserve.app.openapi import package_version
from pageserve.app.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                    EmbeddingRequest, TokenizeRequest)
from pageserve.app.responses import create_response, delete_response, get_response, list_input_items
from pageserve.app.responses_protocol import ResponsesRequest
from pageserve.app.score import RerankRequest, ScoreRequest, rerank, score
from pageserve.app.state import ServerSettings, ServerState


@dataclass(frozen=True, slots=True)
class RouteSpec:
    path: str
    method: str  # lower case, as OpenAPI writes it
    endpoint: Callable[[Request], Awaitable[Response]]
    summary: str
    body: type[BaseModel] | None = None  # the JSON body's model
    open: bool = False  # served without an API key: what a load balancer or a fuzzer needs
    page: bool = False  # an HTML page for people (the chat page), off with --disable-frontend
    lora_admin: bool = False  # changes the served adapters: only with --allow-runtime-lora-updating


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.server
    if state.engine.is_running:
        return Response(status_code=200)
    return APIError(503, "the engine has stopped", code="engine_dead").response()


async def version(request: Request) -> Response:
    return json_response({"version": package_version()})


async def models(request: Request) -> Response:
    state: ServerState = request.app.state.server
    def card(name: str, root: str, parent: str | None) -> dict:
        return {"id": name, "object": "model", "created": state.created, "owned_by": "pageserve",
                "root": root, "parent": parent, "max_model_len": state.max_model_len}
    return json_response({"object": "list", "data": [
        *(card(name, state.settings.model_path, None) for name in state.settings.served_model_names),
        *(card(a.lora_name, a.lora_path, a.base_model_name or state.model_name) for a in state.adapters)]})


@api_route
async def tokenize(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await read_json(request, TokenizeRequest, state.settings.max_request_body_bytes)
    state.check_model(body.model)
    if body.messages is not None:
        _, ids, _ = await chat_prompt(state, body, bounded=False)
    else:
        ids = await state.tokenize(body.prompt, body.add_special_tokens)
    return json_response({"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids})


@api_route
async def detokenize(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = await read_json(request, DetokenizeRequest, state.settings.max_request_body_bytes)
    state.check_model(body.model)
    return json_response({"prompt": await state.detokenize_checked(body.tokens, "tokens")})


async def openapi(request: Request) -> Response:
    return json_response(request.app.state.openapi)


async def metrics(request: Request) -> Response:
    return await request.app.state.metrics.endpoint(request)


ROUTES = (
    RouteSpec("/v1/chat/completions", "post", chat_completions, "Chat completion, whole or streamed (SSE)",
              ChatCompletionRequest),
    RouteSpec("/v1/completions", "post", completions, "Text completion, whole or streamed (SSE)",
              CompletionRequest),
    RouteSpec("/v1/responses", "post", create_response,
              "A response (OpenAI's Responses API), whole or streamed as typed events (SSE)", ResponsesRequest),
    RouteSpec("/v1/responses/{response_id}", "get", get_response, "A stored response"),
    RouteSpec("/v1/responses/{response_id}", "delete", delete_response, "Delete a stored response"),
    RouteSpec("/v1/responses/{response_id}/input_items", "get", list_input_items,
              "The input items of a stored response"),
    RouteSpec("/v1/messages", "post", create_message,
              "A message (Anthropic's Messages API), whole or streamed as its named events (SSE)", MessagesRequest),
    RouteSpec("/v1/messages/count_tokens", "post", count_tokens,
              "The prompt tokens of a Messages API conversation", CountTokensRequest),
    RouteSpec("/v1/embeddings", "post", embeddings, "Embeddings (the last hidden states pooled as the model says)",
              EmbeddingRequest),
    *(RouteSpec(path, "post", score, "Scores of text pairs: their embeddings' cosine similarity (vLLM's)",
                ScoreRequest) for path in ("/score", "/v1/score")),
    *(RouteSpec(path, "post", rerank, "Documents ordered by their embeddings' cosine similarity to a query "
                "(vLLM's, in the Jina and Cohere shape)", RerankRequest)
      for path in ("/rerank", "/v1/rerank", "/v2/rerank")),
    RouteSpec("/v1/models", "get", models, "The served models and LoRA adapters"),
    RouteSpec("/v1/load_lora_adapter", "post", load_lora_adapter, "Load a LoRA adapter (PEFT directory) to serve",
              LoadLoRAAdapterRequest, lora_admin=True),
    RouteSpec("/v1/unload_lora_adapter", "post", unload_lora_adapter, "Stop serving a LoRA adapter",
              UnloadLoRAAdapterRequest, lora_admin=True),
    RouteSpec("/tokenize", "post", tokenize, "Text or messages to token ids", TokenizeRequest),
    RouteSpec("/detokenize", "post", detokenize, "Token ids to text", DetokenizeRequest),
    RouteSpec("/health", "get", health, "200 while the engine runs, 503 once it has stopped", open=True),
    RouteSpec("/version", "get", version, "The server's version", open=True),
    RouteSpec("/metrics", "get", metrics, "Prometheus metrics", open=True),
    RouteSpec("/openapi.json", "get", openapi, "This document", open=True),
    # the page is open; the API calls it makes carry the key it asks for
    RouteSpec("/", "get", chat_page, "The chat page (HTML); off with --disable-frontend",
              open=True, page=True),
)


def served_routes(settings: ServerSettings) -> tuple[RouteSpec, ...]:
    """The routes this server serves (and documents): all, less the page when it is off and
    the adapter loading routes unless run-time updates are allowed."""
    return tuple(r for r in ROUTES if (settings.enable_frontend or not r.page)
                 and (settings.allow_runtime_lora_updating or not r.lora_admin))
