"""The wheel: every folder installs under the one `pageserve` package, so a project with its
own `app` or `runtime` package can install pageserve beside it."""

from __future__ import annotations

import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_installs_beside_a_dummy_app_package(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(ROOT)], check=True)
    (wheel,) = (tmp_path / "dist").glob("pageserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"pageserve"}, tops
    assert "pageserve/runtime/models/llama.py" in names and "pageserve/__init__.py" in names
    from pageserve.triton_kernels.cpu_build import HEADERS, SOURCES
    # built on the user's machine at first use
    assert {f"pageserve/triton_kernels/{p.name}" for p in (*SOURCES, *HEADERS)} <= set(names)
    assert not any(n.startswith("pageserve/tests/") for n in names)

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    for own in ("app", "runtime"):  # the user's own top-level packages
        (site / own).mkdir()
        (site / own / "__init__.py").write_text(f"OWNER = 'user {own}'\n")
    check = (
        "import importlib.util, app, runtime, pageserve\n"
        "from pageserve import SamplingParams\n"
        "assert app.OWNER == 'user app' and runtime.OWNER == 'user runtime'\n"
        "for sub in ('app', 'runtime', 'grammar', 'sampling', 'triton_kernels'):\n"
        "    spec = importlib.util.find_spec('pageserve.' + sub)\n"
        "    assert spec.origin.endswith(f'pageserve/{sub}/__init__.py'), spec.origin\n"
        "assert SamplingParams(temperature=0).greedy\n")
    subprocess.run([python, "-c", check], cwd=tmp_path, check=True)
    scripts = (env_dir / "bin" / "pageserve").read_text()
    assert "from pageserve.app.cli import main" in scripts
