"""A body of many JSON values (a prompt of millions of token ids, say) takes the parser a
while, and the parser holds the interpreter while it runs: on the event loop, or in a thread,
every other stream would wait. Such a body is parsed first in a child process, which refuses
what the server would refuse anyway (not JSON, nested too deep, a token list longer than the
model's context) before the server spends its own time on it.

The child is `python -m pageserve.app.body_check`: a fresh interpreter that imports only
orjson. Each message is a length-prefixed frame: (the token limit, the body) in, a JSON verdict
out ({} when the body may go on, else {"message", "param"})."""

from __future__ import annotations

import asyncio
import struct
import subprocess
import sys
import threading
from typing import BinaryIO

import orjson

# Deepest nesting of objects and arrays a body may have. A JSON schema in `response_format` or a
# tool's `parameters` nests two levels per schema level, so this leaves room for 30 of them.
MAX_JSON_DEPTH = 64
# a body with more commas than this may hold as many values: parsed in the child first (a
# hundred thousand small values take the parser about 5 ms)
MANY_VALUES = 100_000
# /detokenize's token ids a request: about 4 MB of text, not tied to the model's context (a
# long text's /tokenize may come back)
MAX_DETOKENIZE = 1_000_000

_FRAME = struct.Struct("<QQ")


class BodyError(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def parse(raw: bytes, max_tokens: int) -> dict:
    """The body as a dict; BodyError for what no route takes: not JSON, not an object, nested
    deeper than MAX_JSON_DEPTH, a token list longer than `max_tokens`."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BodyError(f"the body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise BodyError(f"the body must be a JSON object, not {type(obj).__name__}")
    _check_token_lists(obj, max_tokens)
    if too_deep(obj, MAX_JSON_DEPTH):
        raise BodyError(f"the body nests objects and arrays deeper than {MAX_JSON_DEPTH} levels")
    return obj


def _check_token_lists(obj: dict, max_tokens: int) -> None:
    """Token-id lists longer than any route takes: a prompt (`prompt`, `input`: a list of ids
    or a list of such lists) beyond the context, /detokenize's `tokens` beyond MAX_DETOKENIZE."""
    for name in ("prompt", "input"):
        value = obj.get(name)
        if not isinstance(value, list) or not value:
            continue
        for ids in value if isinstance(value[0], list) else [value]:
            if isinstance(ids, list) and len(ids) > max_tokens and isinstance(ids[0], int):
                raise BodyError(f"This model's maximum context length is {max_tokens} tokens. However, your "
                                f"request has {len(ids)} input tokens. Please reduce the length of the input.",
                                name)
    tokens = obj.get("tokens")
    if isinstance(tokens, list) and len(tokens) > MAX_DETOKENIZE:
        raise BodyError(f"/detokenize takes at most {MAX_DETOKENIZE} token ids a request; this one has "
                        f"{len(tokens)}", "tokens")


def too_deep(obj: dict, limit: int) -> bool:
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1))
    return False


def _read_exact(stream: BinaryIO, size: int) -> bytes:
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return data


def _serve(stdin: BinaryIO, stdout: BinaryIO) -> None:
    while True:
        try:
            max_tokens, size = _FRAME.unpack(_read_exact(stdin, _FRAME.size))
            raw = _read_exact(stdin, size)
        except EOFError:
            return
        try:
            parse(raw, max_tokens)
            verdict = {}
        except BodyError as e:
            verdict = {"message": str(e), "param": e.param}
        except MemoryError:
            verdict = {"message": "the body holds more JSON values than the server can parse"}
        del raw
        reply = orjson.dumps(verdict)
        stdout.write(_FRAME.pack(0, len(reply)) + reply)
        stdout.flush()


class BodyChecker:
    """The server's end: one child, started on first use and again after it dies, one body at a
    time (the others wait their turn, off the event loop)."""

    command = [sys.executable, "-m", "pageserve.app.body_check"]

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._proc: subprocess.Popen | None = None
        self._lock = asyncio.Lock()
        self._closed = threading.Event()

    async def check(self, raw: bytes) -> None:
        """BodyError for a body the child refuses (or could not read)."""
        async with self._lock:
            verdict = await asyncio.to_thread(self._ask, raw)
        if verdict.get("message"):
            raise BodyError(verdict["message"], verdict.get("param"))

    def _ask(self, raw: bytes) -> dict:
        if self._closed.is_set():
            raise BodyError("the server is shutting down")
        proc = self._proc
        if proc is None or proc.poll() is not None:
            proc = self._proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            proc.stdin.write(_FRAME.pack(self.max_tokens, len(raw)))
            proc.stdin.write(raw)
            proc.stdin.flush()
            _, size = _FRAME.unpack(_read_exact(proc.stdout, _FRAME.size))
            return orjson.loads(_read_exact(proc.stdout, size))
        except (EOFError, OSError, ValueError):
            proc.kill()
            proc.wait()
            return {"message": "the body could not be parsed within the server's limits"}

    def close(self) -> None:
        self._closed.set()
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    _serve(sys.stdin.buffer, sys.stdout.buffer)
