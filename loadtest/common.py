"""Small pieces the benchmarks share."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx


def save_json(result: dict, path: str | None) -> dict:
    """Write the result where --output-json says (nowhere without it); returns it."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    return result


def start_server(flags: list[str], timeout: float = 300) -> tuple[subprocess.Popen, str]:
    """`pageserve serve` with `flags` on a free loopback port, once it answers /health."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "pageserve.app.cli", "serve", "--port", str(port),
                             "--uvicorn-log-level", "warning", *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not start")
