"""Small pieces the benchmarks share."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Callable

import httpx

from pageserve.runtime.ports import free_port


TOPICS = ["the sun", "a cat", "rain", "music", "a river", "bread", "a computer", "winter", "the moon",
          "a tree", "coffee", "a bicycle", "the ocean", "a library", "snow", "a bridge", "a volcano",
          "chess", "a garden", "the wind", "a violin", "a desert", "honey", "a lighthouse", "paper",
          "a train", "clouds", "a museum", "salt", "a mountain", "glass", "a clock"]


def conversations(n: int) -> list[list[dict]]:
    """`n` one-message chats, each a different question."""
    return [[{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]} (#{i})."}]
            for i in range(n)]


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


def wait_healthy(url: str, timeout: float, exit_code: Callable[[], int | None] = lambda: None,
                 verify=True) -> None:
    """Until `url`/health answers 200; `exit_code` says whether the server's process has ended;
    `verify`: httpx's (a CA file or an SSL context for an HTTPS server)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (code := exit_code()) is not None:
            raise RuntimeError(f"the server exited with {code}")
        try:
            if httpx.get(f"{url}/health", timeout=2, verify=verify).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the server at {url} did not become healthy in {timeout} s")


def start_server(flags: list[str], timeout: float = 300) -> tuple[subprocess.Popen, str]:
    """`pageserve serve` with `flags` on a free loopback port, once it answers /health."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pageserve.app.cli", "serve", "--port", str(port),
                             "--uvicorn-log-level", "warning", *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout, proc.poll)
    except BaseException:
        proc.kill()
        raise
    return proc, url
