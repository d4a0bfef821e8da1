"""The Starlette application: routes, API-key check, CORS and the refusal of other sites'
pages, error envelopes, and the engine task started and stopped with the app."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import logging

from sse_starlette.sse import AppStatus
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pageserve.app.body_check import BodyChecker
from pageserve.app.errors import APIError
from pageserve.app.http import OWNER, BodyBudget, json_response
from pageserve.app.messages import anthropic_error
from pageserve.app.metrics import Metrics
from pageserve.app.openapi import openapi_document
from pageserve.app.routes import ROUTES, served_routes
from pageserve.app.state import ServerState

logger = logging.getLogger(__name__)

_OPEN_PATHS = frozenset(r.path for r in ROUTES if r.open)
# the request bodies of the largest size (--max-request-body-mb) the server reads at once
BODIES_AT_ONCE = 8


class CrossSiteMiddleware:
    """A browser's request from another site that changes state (any method but GET, HEAD and
    OPTIONS) is refused unless its origin is allowed (--allowed-origins): a form or a text/plain
    fetch from any web page would otherwise reach a server on localhost with no CORS preflight.
    Browsers name the request's site in Sec-Fetch-Site; other clients send none."""

    def __init__(self, app, allowed_origins: tuple[str, ...]):
        self.app = app
        self.allowed = set(allowed_origins)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] not in ("GET", "HEAD", "OPTIONS"):
            headers = dict(scope["headers"])
            origin = headers.get(b"origin", b"").decode("latin-1")
            if headers.get(b"sec-fetch-site") in (b"cross-site", b"same-site") \
                    and "*" not in self.allowed and origin not in self.allowed:
                err = APIError(403, f"a request from the web page at {origin or 'another site'} is refused: start "
                                    "the server with --allowed-origins naming it to allow it", code="origin_not_allowed")
                await _refusal(scope, err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def is_loopback(host: str) -> bool:
    """Whether a bind address or Host name is this machine's own: localhost (and its
    subdomains) or a loopback IP address."""
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name of a Host header, without its port (an IPv6 literal keeps its brackets off)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


class HostMiddleware:
    """DNS rebinding: a web page of another site whose name the attacker points at 127.0.0.1 is,
    to the browser, its own origin, so it may read what a server on localhost answers. Its
    requests carry that name in Host: a request whose Host is a name (not an IP address) other
    than localhost's and those of --allowed-hosts is refused. In place where the server binds a
    loopback address, or --allowed-hosts is given; a request without Host (HTTP/1.0) passes."""

    def __init__(self, app, allowed_hosts: tuple[str, ...]):
        self.app = app
        self.allowed = set(allowed_hosts)

    def allows(self, name: str) -> bool:
        if "*" in self.allowed or name in self.allowed or is_loopback(name):
            return True
        try:
            ipaddress.ip_address(name)
            return True  # an address is no DNS name: the browser's origin would be that address
        except ValueError:
            return False

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            header = dict(scope["headers"]).get(b"host")
            name = None if header is None else host_name(header.decode("latin-1"))
            if name is not None and not self.allows(name):
                err = APIError(403, f"a request for host {name!r} is refused: this server answers to localhost and "
                                    "IP addresses; start it with --allowed-hosts naming the host to allow it",
                               code="host_not_allowed")
                await _refusal(scope, err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _refusal(scope, err: APIError) -> Response:
    """The error in the shape the route's clients read: Anthropic's on /v1/messages."""
    if scope["path"].startswith("/v1/messages"):
        return json_response(anthropic_error(err), err.status, err.headers)
    return err.response()


class APIKeyMiddleware:
    """`Authorization: Bearer <key>`, or Anthropic's `x-api-key: <key>`, on every route but the
    open ones of the route table, compared in constant time against every key. The request's scope then names its owner (a
    hash of the key) for what it may see of stored state."""

    def __init__(self, app, api_keys: tuple[str, ...]):
        self.app = app
        self.keys = [(k.encode(), key_owner(k)) for k in api_keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in _OPEN_PATHS and scope["method"] != "OPTIONS":
            who = self._owner(scope)
            if who is None:
                err = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' "
                                    "(or 'x-api-key: <key>').",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await _refusal(scope, err)(scope, receive, send)
                return
            scope[OWNER] = who
        await self.app(scope, receive, send)

    def _owner(self, scope) -> str | None:
        header = x_api_key = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value
            elif name == b"x-api-key":
                x_api_key = value
        given = header[7:] if header[:7].lower() == b"bearer " else x_api_key
        who = None
        for key, tag in self.keys:  # no early exit: the time does not tell which key came close
            if hmac.compare_digest(given, key):
                who = tag
        return who


def key_owner(key: str) -> str:
    """The owner tag of an API key: enough of its SHA-256 to tell keys apart, not to recover one."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class RequestIdMiddleware:
    """Echo the client's X-Request-Id on the response."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        given = None
        if scope["type"] == "http":
            given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        if given is None or len(given) > 256:
            await self.app(scope, receive, send)
            return

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", given)]}
            await send(message)
        await self.app(scope, receive, send_with_id)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    return APIError(exc.status_code, exc.detail or "error", headers=exc.headers).response()


async def _server_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s", request.url.path)
    return APIError(500, "internal server error").response()


def build_app(state: ServerState) -> Starlette:
    # sse-starlette would cut every stream the moment shutdown starts; the engine's drain
    # (--shutdown-timeout) ends them instead, each with its last tokens or an error event
    AppStatus.disable_automatic_graceful_drain()
    served = served_routes(state.settings)
    routes = [Route(r.path, r.endpoint, methods=[r.method.upper()]) for r in served]
    middleware = [Middleware(RequestIdMiddleware)]
    if state.settings.allowed_hosts is not None:
        middleware.append(Middleware(HostMiddleware, allowed_hosts=state.settings.allowed_hosts))
    if state.settings.allowed_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(state.settings.allowed_origins),
                                     allow_methods=["*"], allow_headers=["*"],
                                     expose_headers=["Retry-After", "X-Request-Id"]))
    middleware.append(Middleware(CrossSiteMiddleware, allowed_origins=state.settings.allowed_origins))
    if state.settings.api_keys:
        middleware.append(Middleware(APIKeyMiddleware, api_keys=state.settings.api_keys))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        state.engine.start()
        try:
            yield
        finally:
            await state.engine.stop()
            app.state.body_checker.close()

    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_error, Exception: _server_error})
    app.state.server = state
    app.state.body_checker = BodyChecker(state.max_model_len)  # bodies of many values, parsed aside first
    app.state.body_budget = BodyBudget(BODIES_AT_ONCE * state.settings.max_request_body_bytes)
    app.state.metrics = Metrics(state.engine, state.model_name, state.settings.log_requests,
                                state.settings.log_prompts, state.detokenize)
    app.state.openapi = openapi_document(served)
    return app
