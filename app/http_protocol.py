"""uvicorn's httptools protocol with bounds on a request's head (its request line and headers):
its bytes, its header lines and the time it takes to arrive. The head is read before any route
or the API-key check sees the request: its lines pile up until it ends (2 GB of them grew the
server by 4.4 GB), httptools holds an unfinished header whole, and a head sent a byte at a time
held its connection for ever. A head over a bound gets a 431 (its size) or a 408 (its time),
and the connection is closed. The flags keep vLLM's names (it serves with h11 there)."""

from __future__ import annotations

from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from pageserve.app.errors import APIError
from pageserve.app.json_out import dumps


@dataclass(frozen=True)
class HeadLimits:
    max_bytes: int = 4 << 20  # --h11-max-incomplete-event-size (vLLM's default)
    max_headers: int = 256  # --h11-max-header-count (vLLM's default)
    timeout: float = 60.0  # seconds from a request's first byte to the end of its headers

    def __post_init__(self):
        if self.max_bytes < 1024:
            raise ValueError("--h11-max-incomplete-event-size must be at least 1024 bytes")
        if self.max_headers < 1:
            raise ValueError("--h11-max-header-count must be at least 1")
        if self.timeout <= 0:
            raise ValueError("the head timeout must be positive")


class _Refused(Exception):
    """Raised in a parser callback: httptools then stops and uvicorn answers 400, which
    `send_400_response` turns into the refusal."""


def protocol_class(limits: HeadLimits) -> type[HttpToolsProtocol]:
    """The protocol class for uvicorn.Config(http=...) under `limits`."""
    return type("BoundedHttpToolsProtocol", (BoundedHttpToolsProtocol,), {"limits": limits})


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    limits = HeadLimits()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._in_head = False
        self._head_bytes = 0  # what the parser holds of the head, as far as data_received knows
        self._named_bytes = 0  # the request line's and the finished headers' bytes
        self._num_headers = 0
        self._head_timer = None
        self._refusal: tuple[int, str] | None = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_head and not self.transport.is_closing():
            # a header still unfinished is held whole by the parser: count it as it comes (a
            # chunk that also ended the previous request on this connection counts whole)
            self._head_bytes += len(data)
            if self._head_bytes > self.limits.max_bytes:
                self._refuse(*self._too_large())

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()  # a connection that never sends a request is closed too

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes, self._named_bytes, self._num_headers = True, 0, 0, 0
        self._arm()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._num_headers += 1
        if self._num_headers > self.limits.max_headers:
            self._refusal = (431, f"the request has more than {self.limits.max_headers} header lines "
                                  "(--h11-max-header-count)")
            raise _Refused()
        self._count(len(name) + len(value))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_timer()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        refusal, self._refusal = self._refusal, None
        if refusal is None:
            super().send_400_response(msg)
        else:
            self._refuse(*refusal)

    def _count(self, size: int) -> None:
        self._named_bytes += size
        if self._named_bytes > self.limits.max_bytes:
            self._refusal = self._too_large()
            raise _Refused()

    def _too_large(self) -> tuple[int, str]:
        return 431, (f"the request's line and headers are larger than {self.limits.max_bytes} bytes "
                     "(--h11-max-incomplete-event-size)")

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self._responding():  # a pipelined head waits while the answer before it is written
            self._arm()
        elif self._in_head:
            self._refuse(408, f"the request's headers did not arrive within {self.limits.timeout:g} s")
        elif self.cycle is None:  # nothing came since the connection was made
            self.transport.close()

    def _arm(self) -> None:
        self._cancel_timer()
        self._head_timer = self.loop.call_later(self.limits.timeout, self._head_timed_out)

    def _cancel_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _responding(self) -> bool:
        """An earlier request's answer is still being written on this connection."""
        return self.cycle is not None and not self.cycle.response_complete

    def _refuse(self, status: int, message: str) -> None:
        """The error envelope the API's clients read, then the connection closed (the rest of
        the request is not read). Behind an answer still being written (pipelining), the
        connection is only closed: bytes of ours would land inside that answer."""
        self.logger.warning("refused a request from %s: %s", self.client, message)
        self._in_head = False
        self._cancel_timer()
        if self._responding():
            self.transport.close()
            return
        code = "request_header_fields_too_large" if status == 431 else "request_timeout"
        body = dumps(APIError(status, message, code=code).envelope())
        self.transport.write(b"".join([
            STATUS_LINE[status], *(name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers),
            b"content-type: application/json\r\ncontent-length: ", str(len(body)).encode(),
            b"\r\nconnection: close\r\n\r\n", body]))
        self.transport.close()
