"""The OpenAPI 3.1 document of the route table, its request body schemas drawn from the
protocol models (fuzzers such as schemathesis read it)."""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version

from pydantic.json_schema import models_json_schema


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

def package_version() -> str:
    try:
        return version("pageserve")
    except PackageNotFoundError:
        return "0.0.0"


def openapi_document(routes) -> dict:
    """`routes`: the route table (app.routes.ROUTES)."""
    models = [r.body for r in routes if r.body is not None]
    _, top = models_json_schema([(m, "validation") for m in models],
                                ref_template="#/components/schemas/{model}")
    schemas = dict(top.get("$defs", {}))
    schemas["Error"] = _ERROR
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    paths: dict[str, dict] = {}
    for r in routes:
        op = {"summary": r.summary, "responses": {"200": {"description": "OK"}}}
        names = re.findall(r"\{(\w+)\}", r.path)
        if names:
            op["parameters"] = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                                for n in names]
            op["responses"]["404"] = {"description": "No such item", **error}
        if r.page:
            op["responses"]["200"]["content"] = {"text/html": {"schema": {"type": "string"}}}
        if r.body is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{r.body.__name__}"}}}}
            op["responses"].update({"400": {"description": "Bad request", **error},
                                    "413": {"description": "Body too large", **error}})
        if not r.open:
            op["responses"]["401"] = {"description": "Missing or wrong API key", **error}
            op["security"] = [{"bearer": []}, {}]
        paths.setdefault(r.path, {})[r.method] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "pageserve", "version": package_version(),
                 "description": "OpenAI-compatible LLM inference server"},
        "paths": paths,
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
