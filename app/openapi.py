"""The OpenAPI 3.1 document of every route, its request body schemas drawn from the protocol
models (fuzzers such as schemathesis read it)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from pydantic.json_schema import models_json_schema

from app.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                          EmbeddingRequest, TokenizeRequest)

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}

# path -> (method, summary, request body model or None)
ROUTES = {
    "/v1/chat/completions": ("post", "Chat completion, whole or streamed (SSE)", ChatCompletionRequest),
    "/v1/completions": ("post", "Text completion, whole or streamed (SSE)", CompletionRequest),
    "/v1/embeddings": ("post", "Embeddings (mean-pooled last hidden states)", EmbeddingRequest),
    "/v1/models": ("get", "The served models", None),
    "/tokenize": ("post", "Text or messages to token ids", TokenizeRequest),
    "/detokenize": ("post", "Token ids to text", DetokenizeRequest),
    "/health": ("get", "200 while the engine runs, 503 once it has stopped", None),
    "/version": ("get", "The server's version", None),
    "/metrics": ("get", "Prometheus metrics", None),
    "/openapi.json": ("get", "This document", None),
}


def package_version() -> str:
    try:
        return version("pageserve")
    except PackageNotFoundError:
        return "0.0.0"


def openapi_document() -> dict:
    models = [v[2] for v in ROUTES.values() if v[2] is not None]
    _, top = models_json_schema([(m, "validation") for m in models],
                                ref_template="#/components/schemas/{model}")
    schemas = dict(top.get("$defs", {}))
    schemas["Error"] = _ERROR
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    paths = {}
    for path, (method, summary, model) in ROUTES.items():
        op = {"summary": summary, "responses": {"200": {"description": "OK"}}}
        if model is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            op["responses"].update({"400": {"description": "Bad request", **error},
                                    "413": {"description": "Body too large", **error}})
        if path.startswith("/v1/"):
            op["responses"]["401"] = {"description": "Missing or wrong API key", **error}
            op["security"] = [{"bearer": []}, {}]
        paths[path] = {method: op}
    return {
        "openapi": "3.1.0",
        "info": {"title": "pageserve", "version": package_version(),
                 "description": "OpenAI-compatible LLM inference server"},
        "paths": paths,
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
