"""Small pieces the benchmarks share."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx


def distinct_prompts(vocab_size: int, num: int, length: int) -> list[list[int]]:
    """`num` prompts of `length` token ids, no two alike (so no prefix-cache hits between
    them), away from the first ten ids (where special tokens usually sit)."""
    return [[(7 * i + j) % (vocab_size - 10) + 10 for j in range(length)] for i in range(num)]


def provenance() -> dict:
    """Where a result comes from: the commit (with a mark when the tree had changes), the CPU
    and its vector units, the core count and the date."""
    import os
    import platform

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                                  cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "HEAD")
    # results written by earlier runs of a sweep are no change to the code that measured
    if commit and git("status", "--porcelain", "--untracked-files=no", "--", ":(top)",
                      ":(top,exclude)loadtest/results"):
        commit += "+changes"
    cpu, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not cpu:
                    cpu = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    cpu = cpu or platform.processor()
    units = [u for u in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if u in flags]
    return {"commit": commit or None, "cpu": cpu or None, "vector_units": units,
            "cpu_count": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}


def save_json(result: dict, path: str | None) -> dict:
    """Write the result where --output-json says (nowhere without it), with its provenance;
    returns it."""
    if path:
        with open(path, "w") as f:
            json.dump({**result, "provenance": provenance()}, f, indent=2)
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
