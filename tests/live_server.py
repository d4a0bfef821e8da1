"""Real servers for the end-to-end tests, bound to a free loopback port.

`InProcessServer` runs uvicorn in a thread of the test process, so tests can look inside the
engine (pool, requests) after talking to it over HTTP. `SubprocessServer` runs the
`pageserve serve` command itself."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from pageserve.loadtest.common import wait_healthy
from pageserve.runtime.ports import port_socket

ROOT = Path(__file__).resolve().parent.parent


class InProcessServer:
    """`head_limits`: app/http_protocol.py's HeadLimits (the defaults when None)."""

    def __init__(self, engine_args, shutdown_timeout: float = 5.0, head_limits=None, **settings):
        import uvicorn

        from pageserve.app.http_protocol import HeadLimits, protocol_class
        from pageserve.app.serve import GracefulServer
        from pageserve.app.server import build_app
        from pageserve.app.state import ServerSettings, ServerState
        from pageserve.runtime.async_engine import AsyncEngine

        settings.setdefault("served_model_names", ("test-model",))
        settings.setdefault("model_path", str(engine_args.model))
        self.settings = ServerSettings(**settings)
        async_engine = AsyncEngine.build(engine_args, self.settings.max_num_queued_reqs)
        self.engine = async_engine.engine
        self.state = ServerState(async_engine, self.engine.tokenizer, self.settings,
                                 self.engine.config.model.max_model_len)
        self.sock = port_socket()
        self.url = "http://127.0.0.1:%d" % self.sock.getsockname()[1]
        config = uvicorn.Config(build_app(self.state), loop="asyncio",
                                http=protocol_class(head_limits or HeadLimits()), log_level="warning", access_log=False)
        self.server = GracefulServer(config, async_engine, shutdown_timeout)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                       daemon=True)
        self.thread.start()
        wait_healthy(self.url, 60)

    @property
    def model(self) -> str:
        return self.settings.served_model_names[0]

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until the engine holds no request and every KV block is back in the pool."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.engine.requests and not self.state.engine._streams and not self.engine.kv.req_blocks:
                return
            time.sleep(0.02)
        raise AssertionError(f"still busy after {timeout} s: requests {list(self.engine.requests)}")

    def call(self, coro_fn, timeout: float = 10.0):
        """Run `coro_fn()` on the server's event loop and return its result."""
        loop = self.state.engine._task.get_loop()
        return asyncio.run_coroutine_threadsafe(coro_fn(), loop).result(timeout)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


class SubprocessServer:
    """`pageserve serve --port PORT ARGS...` from this checkout; or `command` (a `pageserve` program
    installed elsewhere) run in `cwd` with `base_env` (default: this process's environment)
    updated by `env`. `verify`: httpx's, for a server that serves HTTPS (--ssl-certfile)."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, command: list[str] | None = None,
                 cwd: Path = ROOT, base_env: dict[str, str] | None = None, startup_timeout: float = 120,
                 verify=None):
        sock = port_socket()
        port = sock.getsockname()[1]
        sock.close()
        self.url = f"{'http' if verify is None else 'https'}://127.0.0.1:{port}"
        self.log_path = ROOT / ".cache" / f"server-{port}.log"
        self.log_path.parent.mkdir(exist_ok=True)
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [*(command or [sys.executable, "-m", "pageserve.app.cli"]), "serve", "--port", str(port), *args],
            cwd=cwd, stdout=self.log, stderr=subprocess.STDOUT,
            env={**(os.environ if base_env is None else base_env), **(env or {})})
        try:
            wait_healthy(self.url, startup_timeout, self.proc.poll, verify=True if verify is None else verify)
        except BaseException:
            self.stop()
            raise

    def output(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
