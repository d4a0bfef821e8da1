"""What a client can make the server hold before a route sees its request: a head (request line
and headers) is bounded in bytes, lines and time (431, 408), a body that stops coming is cut
off (408), and the bodies being read at once share a budget (503 past it). The real server, over
raw sockets; after each refusal it still serves."""

from __future__ import annotations

import socket
import time

import httpx
import orjson
import pytest

from pageserve.runtime.engine_args import EngineArgs
from tests.live_server import InProcessServer

pytestmark = pytest.mark.server

LIMITS = dict(max_bytes=16 << 10, max_headers=32, timeout=1.0)


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from pageserve.app.http_protocol import HeadLimits

    s = InProcessServer(EngineArgs(model=str(tiny_model_dir), dtype="float32", kv_cache_memory=0.01,
                                   max_model_len=256), head_limits=HeadLimits(**LIMITS),
                        max_request_body_bytes=4 << 20)
    yield s
    s.stop()


def _connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _answer(sock: socket.socket, closes: bool = True) -> tuple[int, dict]:
    """The status and JSON body of the response; `closes`: the server then closes the connection
    (it reads no more of the request)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    size = int(next(line for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")).split()[1])
    while len(body) < size:
        body += sock.recv(65536)
    if closes:
        assert b"connection: close" in head.lower(), head
        assert sock.recv(1) == b""
    return int(head.split(b" ", 2)[1]), orjson.loads(body)


def _serves(server) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text


def test_a_head_within_the_bounds_is_served(server):
    headers = {f"x-pad-{i}": "v" * 300 for i in range(LIMITS["max_headers"] - 8)}  # ~7 KB, 24 lines
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=headers)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("head", [
    pytest.param(b"".join(b"x-h%d: v\r\n" % i for i in range(LIMITS["max_headers"] + 1)), id="too-many-lines"),
    pytest.param(b"x-big: " + b"v" * (LIMITS["max_bytes"] + 1) + b"\r\n", id="one-header-too-large"),
    pytest.param(b"".join(b"x-h%d: %s\r\n" % (i, b"v" * 1000) for i in range(20)), id="headers-too-large"),
])
def test_a_head_over_its_bounds_gets_a_431(server, head):
    with _connect(server) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: localhost\r\n" + head + b"\r\n")
        status, body = _answer(sock)
    assert status == 431 and body["error"]["code"] == "request_header_fields_too_large", body
    _serves(server)


def test_a_header_that_never_ends_is_cut_off_at_the_bound(server):
    """httptools holds an unfinished header whole: it is counted as its bytes come, and the
    connection is refused once they pass the bound, without waiting for its end."""
    with _connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: localhost\r\nx-endless: ")
        sent = 0
        with pytest.raises(OSError):  # the server closes while the header still comes
            for _ in range(64):
                sock.sendall(b"v" * 4096)
                sent += 4096
                time.sleep(0.01)
        assert sent <= LIMITS["max_bytes"] + 64 * 1024, sent
    _serves(server)


def test_a_head_too_slow_gets_a_408(server):
    with _connect(server) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: local")  # and nothing more
        status, body = _answer(sock)
    assert status == 408 and body["error"]["type"] == "timeout_error", body
    assert LIMITS["timeout"] <= time.monotonic() - started < LIMITS["timeout"] + 5
    _serves(server)


def test_a_connection_that_sends_nothing_is_closed(server):
    started = time.monotonic()  # before connecting: the server's timer starts when it accepts
    with _connect(server) as sock:
        assert sock.recv(1) == b""  # closed, with no answer
    assert LIMITS["timeout"] <= time.monotonic() - started < LIMITS["timeout"] + 5
    _serves(server)


def test_a_keep_alive_connection_serves_requests_after_the_head_timeout(server):
    """The timer runs from each request's first byte: one connection, two requests apart."""
    with httpx.Client(timeout=30) as client:
        for _ in range(2):
            assert client.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
            time.sleep(LIMITS["timeout"] / 2)


def _upload(server, declared: int, sent: int) -> socket.socket:
    """A JSON body of `declared` bytes, of which `sent` are sent."""
    sock = _connect(server)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n" % declared + b'{"prompt": "' + b"a" * (sent - 12))
    return sock


def test_a_body_that_stops_coming_gets_a_408(server, monkeypatch):
    from pageserve.app import http

    monkeypatch.setattr(http, "BODY_IDLE_TIMEOUT", 0.5)
    with _upload(server, 100_000, 50_000) as sock:
        status, body = _answer(sock)
    assert status == 408 and "stopped coming" in body["error"]["message"], body
    _serves(server)


def test_bodies_read_at_once_share_a_budget(server):
    """Past the budget (each body's first megabyte aside), a body gets a 503 with Retry-After;
    small requests still pass, and the budget is whole again once the bodies are gone."""
    from pageserve.app.http import BODY_FREE_BYTES, BodyBudget

    app = server.server.config.app
    saved, app.state.body_budget = app.state.body_budget, BodyBudget(3 << 20)
    budget = app.state.body_budget
    try:
        first = _upload(server, 4 << 20, BODY_FREE_BYTES + (5 << 19))  # 2.5 MB of the budget
        deadline = time.monotonic() + 10
        while budget.used < 5 << 19 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert budget.used == 5 << 19
        with _upload(server, 4 << 20, BODY_FREE_BYTES + (1 << 20)) as second:  # 1 MB more: over
            status, body = _answer(second, closes=False)  # the rest of its body is read and dropped
        assert status == 503 and body["error"]["code"] == "server_overloaded", body
        _serves(server)
        first.close()
        deadline = time.monotonic() + 10
        while budget.used and time.monotonic() < deadline:
            time.sleep(0.01)
        assert budget.used == 0
    finally:
        app.state.body_budget = saved
    _serves(server)


def test_a_body_being_parsed_keeps_its_share_after_its_request_is_gone():
    """A request cancelled while a worker thread parses its body: the thread holds the bytes, so
    the budget counts them until it ends."""
    import asyncio
    import threading

    from pageserve.app.http import BODY_FREE_BYTES, BodyBudget

    async def cancelled_mid_parse() -> None:
        budget, parsed = BodyBudget(10 << 20), threading.Event()
        with budget.reading() as reading:
            reading.grow(BODY_FREE_BYTES + 1000)
            parsing = asyncio.ensure_future(asyncio.to_thread(parsed.wait))
            reading.hold_until(parsing)
        assert budget.used == 1000
        parsed.set()
        await parsing
        await asyncio.sleep(0)
        assert budget.used == 0
        with budget.reading() as reading:  # the usual path: given back on exit
            reading.grow(BODY_FREE_BYTES + 10)
            assert budget.used == 10
        assert budget.used == 0
    asyncio.run(cancelled_mid_parse())
