"""Request plumbing shared by the routes: bounded body reading, JSON in and out with orjson,
validation into the protocol models, error mapping, and noticing a client that went away."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from pageserve.app.errors import APIError, bad_request, from_validation_error
from pageserve.app.json_out import dumps
from pageserve.runtime.async_engine import (EngineDeadError, QueueFullError, RequestFailedError,
                                            RequestTimeoutError, ShuttingDownError)

logger = logging.getLogger(__name__)

Body = TypeVar("Body", bound=BaseModel)

# Deepest nesting of objects and arrays a body may have. A JSON schema in `response_format` or a
# tool's `parameters` nests two levels per schema level, so this leaves room for 30 of them.
MAX_JSON_DEPTH = 64


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


def json_response(content, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(content), status_code=status, media_type="application/json",
                    headers=headers)


async def read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the request body is larger than the server's limit of {max_bytes} bytes "
                         f"(--max-request-body-mb)", code="request_too_large")


async def read_json(request: Request, model: type[Body], max_bytes: int) -> Body:
    raw = await read_body(request, max_bytes)
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"the body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise bad_request(f"the body must be a JSON object, not {type(obj).__name__}")
    if _too_deep(obj, MAX_JSON_DEPTH):
        raise bad_request(f"the body nests objects and arrays deeper than {MAX_JSON_DEPTH} levels")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise from_validation_error(e) from None


def _too_deep(obj: dict, limit: int) -> bool:
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False


def api_route(handler: Callable[[Request], Awaitable[Response]]):
    """Turns every failure a client can cause into its 4xx envelope, and the server's own
    overload or death into a 503."""
    @functools.wraps(handler)
    async def route(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as e:
            return e.response()
        except (ClientGone, ClientDisconnect):
            return Response(status_code=499)  # nobody is listening
        except Exception as e:
            error = engine_error(e)
            if error is None:
                raise
            return error.response()
    return route


def engine_error(e: Exception) -> APIError | None:
    """The envelope for what the engine raised: its own checks of a request (400), a timeout
    (408), a failed step (500, the server's fault), overload, shutdown or death (503). None for
    anything else, which is a bug."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):  # the input processor's InvalidRequest names the field
        return bad_request(str(e), getattr(e, "param", None))
    if isinstance(e, QueueFullError):
        return APIError(503, str(e), code="server_overloaded", headers={"Retry-After": "1"})
    if isinstance(e, ShuttingDownError):
        return APIError(503, str(e), code="server_shutting_down")
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), code="engine_dead")
    if isinstance(e, RequestTimeoutError):
        return APIError(408, str(e), code="request_timeout")
    if isinstance(e, RequestFailedError):
        return APIError(500, str(e), code="engine_error")
    return None


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(request: Request, work: Awaitable):
    """Await `work`, unless the client disconnects first: then cancel it and raise ClientGone.
    The body must have been read already."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():  # the client went first
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientGone()
    return task.result()
