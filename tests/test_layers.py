"""Layers point one way: app -> runtime -> (grammar, sampling, triton_kernels). Checked on
every import statement of the source, those inside functions included."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
BELOW = {"grammar": {"runtime", "app"}, "sampling": {"runtime", "app"}, "triton_kernels": {"runtime", "app"},
         "runtime": {"app"}}


PACKAGES = ("app", "runtime", "grammar", "sampling", "triton_kernels", "loadtest")


def _imported_packages(path: Path, package: str) -> set[tuple[str, int]]:
    """Project packages imported by a file, with the line, however written (`pageserve.x` is
    reported as `x`; `x` alone as `bare:x`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's own package
                parts = [package] + list(path.relative_to(ROOT / package).parent.parts)
                base = parts[:len(parts) - node.level + 1]
                names = [".".join(base + ([node.module] if node.module else []))]
            else:
                names = [node.module or ""]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "pageserve" and len(parts) > 1:
                found.add((parts[1], node.lineno))
            elif parts[0] in PACKAGES:  # resolved from a relative import, or written bare
                found.add((parts[0] if node.level else f"bare:{parts[0]}", node.lineno))
    return found


@pytest.mark.parametrize("package", sorted(BELOW))
def test_no_import_points_up(package):
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {top}"
             for path in sorted((ROOT / package).rglob("*.py"))
             for top, line in _imported_packages(path, package) if top in BELOW[package]]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("folder", [*PACKAGES, "tests"])
def test_every_import_goes_through_the_pageserve_package(folder):
    """`from pageserve.runtime...`, never `from runtime...`: installed, the folders exist only
    as pageserve's subpackages, and in the tree a module imported both ways would load twice."""
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {top[5:]} without pageserve."
             for path in sorted((ROOT / folder).rglob("*.py")) if "node_modules" not in path.parts
             for top, line in _imported_packages(path, folder) if top.startswith("bare:")]
    assert not wrong, "\n".join(wrong)


def test_importing_the_packages_loads_no_torch(tmp_path):
    """pageserve, its engine package, grammar and the sampling parameters import without torch
    (from anywhere: not only from the repository); torch comes with LLM when it is touched."""
    code = ("import sys, pageserve, pageserve.runtime, pageserve.grammar.compiler, "
            "pageserve.grammar.vocabulary, pageserve.app.tools; "
            "from pageserve import SamplingParams; "
            "assert 'torch' not in sys.modules, 'torch was imported'; "
            "from pageserve import LLM; assert 'torch' in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True)


def test_the_app_asks_the_engine_instead_of_walking_into_it():
    """app/ reads the engine through AsyncEngine's methods and its stats() snapshot."""
    reach = (".engine.engine", "engine.scheduler", "engine.kv", "engine.runner")
    wrong = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
             for path in sorted((ROOT / "app").rglob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1) if any(r in line for r in reach)]
    assert not wrong, "\n".join(wrong)
