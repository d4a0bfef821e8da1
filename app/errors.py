"""The OpenAI error envelope, and the mapping of every failure to a status code: 4xx for what
the client got wrong, 503 when the server cannot take the request now."""

from __future__ import annotations

import orjson
from pydantic import ValidationError
from starlette.responses import Response

from pageserve.app.json_out import dumps

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
          499: "invalid_request_error",
          503: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def envelope(self) -> dict:
        kind = _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind,
                          "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(dumps(self.envelope()), status_code=self.status,
                        media_type="application/json", headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def _rank(error: dict) -> int:
    """Of the errors pydantic gives for the members of a union, the telling one: our own
    checks first, then broken limits (too long, too large), then wrong types."""
    if error["type"] == "value_error":
        return 0
    return 2 if error["type"].endswith("_type") or error["type"] == "literal_error" else 1


def _param(loc: tuple) -> str | None:
    # pydantic also names the union member it tried (`str`, `list[int]`, `constrained-str`)
    parts = [str(p) for p in loc
             if isinstance(p, int) or (p.isidentifier() and p not in ("str", "int", "float", "bool"))]
    return ".".join(parts) or None


def from_validation_error(err: ValidationError) -> APIError:
    """The most telling problem pydantic found, with its location as `param` (`messages.0.role`)."""
    first = min(err.errors(include_url=False), key=_rank)
    param = _param(first["loc"])
    msg = first["msg"]
    if first["type"] == "missing":
        message = f"'{param}' is a required field"
    elif first["type"] == "value_error":
        message = msg.removeprefix("Value error, ")
        message = f"{param}: {message}" if param else message
    else:
        message = f"{param}: {msg}" if param else msg
        if "input" in first and first["type"] not in ("model_type", "dict_type"):
            message += f" (got {_short(first['input'])})"
    return APIError(400, message, param)


def _short(value) -> str:
    try:
        text = orjson.dumps(value, default=str).decode() if not isinstance(value, str) else repr(value)
    except (TypeError, orjson.JSONEncodeError):  # nested deeper than orjson writes
        return f"a {type(value).__name__}"
    return text if len(text) <= 60 else text[:57] + "..."
