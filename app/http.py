"""Request plumbing shared by the routes: bounded body reading, JSON in and out with orjson,
validation into the protocol models, error mapping, and noticing a client that went away."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from pageserve.app.body_check import MANY_VALUES, BodyChecker, BodyError, parse
from pageserve.app.errors import APIError, bad_request, from_validation_error
from pageserve.app.json_out import dumps
from pageserve.grammar.compiler import CompilerBusy
from pageserve.runtime.async_engine import (EngineDeadError, ImagesHeldError, QueueFullError, RequestFailedError,
                                            RequestTimeoutError, ShuttingDownError)

logger = logging.getLogger(__name__)

Body = TypeVar("Body", bound=BaseModel)
T = TypeVar("T")

# where the API-key check leaves who is calling (app/server.py): a hash of the key, never the key
OWNER = "pageserve.owner"


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


def owner(request: Request) -> str:
    """Who made this request, for what it may see of stored state: a short hash of its API key,
    "" when the server takes no key (everyone is the same owner then)."""
    return request.scope.get(OWNER, "")


def json_response(content, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(content), status_code=status, media_type="application/json",
                    headers=headers)


# what makes a reply large enough to be built in a worker thread: logprob entries (a token, or
# one of its alternatives) take about 4 us each to build and write (a chat reply of 1.3 million
# held the event loop 5.8 s); embedding values about 30 ns (2,048 of 576 took 60 ms)
LARGE_REPLY_ENTRIES = 10_000
LARGE_REPLY_FLOATS = 1_000_000
# choices (a dict each: 128,000 of one token each held it 0.3 s) and tokens written as text or ids
LARGE_REPLY_CHOICES = 1_000
LARGE_REPLY_TOKENS = 200_000


def many_logprobs(num_tokens: int, top: int | None) -> bool:
    """Whether `num_tokens` tokens' logprobs with `top` alternatives each (None: no logprobs)
    make a large reply."""
    return top is not None and num_tokens * (1 + top) >= LARGE_REPLY_ENTRIES


def many_choices(num_choices: int, num_tokens: int) -> bool:
    """Whether `num_choices` choices holding `num_tokens` tokens (as text or ids, echoed
    prompts included) make a large reply."""
    return num_choices >= LARGE_REPLY_CHOICES or num_tokens >= LARGE_REPLY_TOKENS


def many_entries(entries) -> bool:
    """Whether a sequence's TokenLogprobs (None: none asked for; a prompt's start with None)
    make a large piece of a reply: an unread stream's backlog comes as one piece (128 of 8,000
    tokens with 20 alternatives held the event loop 5.5 s)."""
    first = next((e for e in entries or () if e is not None), None)
    return first is not None and many_logprobs(len(entries), first.num_top)


async def off_loop_if(large: bool, work: Callable[[], T]) -> T:
    """work(), in a worker thread when `large` (the event loop goes on serving meanwhile)."""
    return await asyncio.to_thread(work) if large else work()


async def reply(build: Callable[[], dict], large: bool) -> Response:
    """The dict `build` makes, as JSON. A value of the dict may be an iterator (of choices).
    When `large`, the dict is made off the event loop and written in pieces (see json_pieces):
    a fault while making the first piece is still an error reply, one in a later piece cuts the
    reply short (the status is sent by then)."""
    if large:
        pieces = json_pieces(await asyncio.to_thread(build))
        first = await asyncio.to_thread(next, pieces)
        return StreamingResponse(_off_loop(first, pieces), media_type="application/json")
    return json_response({k: list(v) if isinstance(v, Iterator) else v for k, v in build().items()})


# a large reply is written in pieces of about this many bytes
REPLY_PIECE_BYTES = 1 << 20


def json_pieces(value: dict) -> Iterator[bytes]:
    """`value` as JSON in pieces of about REPLY_PIECE_BYTES, its lists (choices, data, output)
    an item at a time. One orjson call holds the GIL throughout (an 81 MB reply written at once
    held the event loop 0.66 s); a reply made whole is copied whole again on its way out; and
    an iterator's items are made as they are written and let go of once written (the dicts of
    128 choices of 8,000 tokens with 20 logprobs each, made whole, took 2 GB)."""
    parts, size = [b"{"], 1
    for i, (key, v) in enumerate(value.items()):
        parts.append(b"," + dumps(key) + b":" if i else dumps(key) + b":")
        if not isinstance(v, (list, Iterator)):
            parts.append(dumps(v))
            continue
        parts.append(b"[")
        for j, item in enumerate(v):
            written = dumps(item)
            parts.append(b"," + written if j else written)
            size += len(written)
            if size >= REPLY_PIECE_BYTES:
                yield b"".join(parts)
                parts, size = [], 0
        parts.append(b"]")
    parts.append(b"}")
    yield b"".join(parts)


async def _off_loop(first: bytes, pieces: Iterator[bytes]) -> AsyncIterator[bytes]:
    """`first`, then each piece made in a worker thread and written, so that a slow reader holds
    one piece."""
    piece: bytes | None = first
    while piece is not None:
        yield piece
        piece = await asyncio.to_thread(next, pieces, None)


# a body whose next bytes take longer than this to come is cut off with a 408 (as nginx's)
BODY_IDLE_TIMEOUT = 60.0
# each body's first bytes are its own; beyond them, the bodies being read at once share a budget
BODY_FREE_BYTES = 1 << 20


class BodyBudget:
    """The bytes of request bodies held at once while they are read and parsed, beyond each
    one's first BODY_FREE_BYTES: past `max_bytes`, a request gets a 503 with Retry-After rather
    than the server running out of memory (300 uploads of 30 MB stalled part-way held 9.3 GB)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.used = 0

    @contextlib.contextmanager
    def reading(self) -> Iterator["BodyReading"]:
        """The body's share; what it took is given back on exit (or, after `hold_until`, when
        that future is done)."""
        reading = BodyReading(self)
        try:
            yield reading
        finally:
            if not reading.held:
                reading.release()


class BodyReading:
    def __init__(self, budget: BodyBudget):
        self.budget, self.taken, self.held = budget, 0, False

    def grow(self, size: int) -> None:
        """The body is `size` bytes so far (a 503 when that passes the budget)."""
        budget = self.budget
        more = size - BODY_FREE_BYTES - self.taken
        if more <= 0:
            return
        if budget.used + more > budget.max_bytes:
            raise APIError(503, f"the server is reading {budget.used >> 20} MB of other request bodies, its "
                                "most at once: retry", code="server_overloaded", headers={"Retry-After": "1"})
        budget.used += more
        self.taken += more

    def hold_until(self, future: asyncio.Future) -> None:
        """The bytes stay taken until `future` (a thread parsing them) is done, even when the
        request is gone before: its error, if any, is its request's, or nobody's."""
        self.held = True

        def done(f: asyncio.Future) -> None:
            if not f.cancelled():
                f.exception()  # retrieved: no "never retrieved" log for a request that is gone
            self.release()
        future.add_done_callback(done)

    def release(self) -> None:
        self.budget.used -= self.taken
        self.taken = 0


async def read_body(request: Request, max_bytes: int, grow: Callable[[int], None] = lambda size: None) -> bytes:
    """The body, at most `max_bytes` (a 413), its bytes coming no more than BODY_IDLE_TIMEOUT
    apart (a 408); `grow` is told its size as it comes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    stream = request.stream()
    while True:
        try:
            async with asyncio.timeout(BODY_IDLE_TIMEOUT):
                chunk = await anext(stream)
        except StopAsyncIteration:
            return b"".join(chunks)
        except TimeoutError:
            raise APIError(408, f"the request body stopped coming for {BODY_IDLE_TIMEOUT:g} s", code="request_timeout",
                           headers={"Connection": "close"}) from None
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        grow(size)
        chunks.append(chunk)


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the request body is larger than the server's limit of {max_bytes} bytes "
                         f"(--max-request-body-mb)", code="request_too_large")


async def read_json(request: Request, model: type[Body], max_bytes: int) -> Body:
    """The body, parsed and validated into `model`. A body of many values is checked first by
    the app's BodyChecker, in its own process, and then parsed in a worker thread: the event
    loop never holds still for it."""
    _check_json_media(request)
    budget: BodyBudget = getattr(request.app.state, "body_budget", None) or BodyBudget(sys.maxsize)
    with budget.reading() as reading:
        raw = await read_body(request, max_bytes, reading.grow)
        checker: BodyChecker | None = getattr(request.app.state, "body_checker", None)
        max_tokens = checker.max_tokens if checker is not None else sys.maxsize
        try:
            if checker is None or raw.count(b",") <= MANY_VALUES:
                return _validate(model, parse(raw, max_tokens))
            await checker.check(raw)
            parsing = asyncio.ensure_future(asyncio.to_thread(lambda: _validate(model, parse(raw, max_tokens))))
            reading.hold_until(parsing)  # a cancelled request's thread parses on, holding the bytes
            return await asyncio.shield(parsing)
        except BodyError as e:
            raise bad_request(str(e), e.param) from None


def _check_json_media(request: Request) -> None:
    """A body is JSON, named so or not named (a form's or text/plain, which a web page may send
    anywhere unasked, is refused as vLLM refuses it)."""
    declared = request.headers.get("content-type")
    if declared is None:
        return
    media = declared.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise APIError(415, f"the body must be JSON (Content-Type: application/json), not {media or declared!r}",
                       code="unsupported_media_type")


def _validate(model: type[Body], obj: dict) -> Body:
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise from_validation_error(e) from None


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
    if isinstance(e, RecursionError):  # JSON text inside a field (a schema, a call's arguments) nested deeper
        # than the body's own MAX_JSON_DEPTH allows; logged whole, in case it was our own recursion
        logger.warning("a request's RecursionError, answered with a 400", exc_info=e)
        return bad_request("the request nests JSON too deeply")
    if isinstance(e, (QueueFullError, ImagesHeldError, CompilerBusy)):
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
