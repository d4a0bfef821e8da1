"""The compiled CPU kernels' cache: a library another user could have written is never loaded,
one that does not load (torn, foreign, missing a kernel) is built again, CC is split as a shell
would, and the log names the kernels that run. The builds here are fast stand-ins: a "compiler"
script that copies the real library into place."""

from __future__ import annotations

import logging
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pageserve.runtime.models.loader import cache_root
from pageserve.triton_kernels import cpu_build, cpu_kernels

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def real_library() -> Path:
    lib = cpu_kernels.load(cache_root() / "kernels")
    if lib is None:
        pytest.skip("no C compiler here: nothing to cache")
    return Path(lib._lib._name)


@pytest.fixture
def cache(tmp_path, real_library, monkeypatch):
    """A private cache folder, the name the library would have there, and CC set to a two-word
    command that copies the real library to its -o argument (and counts its runs)."""
    folder = tmp_path / "kernels"
    folder.mkdir(mode=0o755)
    script = tmp_path / "fake cc.py"
    script.write_text("import shutil, sys\n"
                      f"open({str(tmp_path / 'runs')!r}, 'a').write('x')\n"
                      f"shutil.copy({str(real_library)!r}, sys.argv[sys.argv.index('-o') + 1])\n")
    monkeypatch.setenv("CC", f"{sys.executable} '{script}'")
    monkeypatch.setattr(cpu_kernels, "_announced", set())
    name = folder / f"cpu_kernels-{cpu_build.build_key(cpu_kernels.FLAGS)}.so"
    return folder, name, tmp_path / "runs"


def _runs(counter: Path) -> int:
    return len(counter.read_text()) if counter.exists() else 0


def test_a_first_load_builds_with_a_cc_of_several_words_and_says_which_kernels_run(cache, caplog):
    folder, name, runs = cache
    with caplog.at_level(logging.INFO, logger=cpu_kernels.__name__):
        lib = cpu_kernels.load(folder)
    assert lib is not None and name.is_file() and _runs(runs) == 1
    assert f"CPU kernels: {lib.isa}, from {name}" in caplog.text
    assert stat.S_IMODE(name.stat().st_mode) == 0o755


@pytest.mark.parametrize("damage", ["torn", "missing a kernel"])
def test_a_library_that_does_not_load_is_built_again(cache, tmp_path, caplog, damage):
    folder, name, runs = cache
    if damage == "torn":
        name.write_bytes(b"\x7fELF" + bytes(100))
    else:  # a real shared object without pageserve's symbols
        src = tmp_path / "other.c"
        src.write_text("int other(void) { return 1; }\n")
        cc = shutil.which("cc") or shutil.which("gcc")
        subprocess.run([cc, "-shared", "-fPIC", str(src), "-o", str(name)], check=True)
    name.chmod(0o755)
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        lib = cpu_kernels.load(folder)
    assert lib is not None and _runs(runs) == 1
    assert "do not load" in caplog.text and "building them again" in caplog.text


def test_a_library_others_can_write_is_refused(cache, caplog):
    folder, name, runs = cache
    assert cpu_kernels.load(folder) is not None  # built, private: loads
    name.chmod(0o757)
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.load(folder) is None
    assert "writable by other users" in caplog.text and "keeping torch's ops" in caplog.text
    assert _runs(runs) == 1  # refused, not rebuilt over


def test_a_folder_of_ours_that_others_can_write_is_closed_first(cache, caplog):
    folder, name, runs = cache
    folder.chmod(0o777)  # a umask of 000 (002 gives 775: the same)
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.load(folder) is not None
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755 and "closed it" in caplog.text


def test_a_library_of_another_user_is_refused(cache, caplog):
    import os

    folder, name, runs = cache
    assert cpu_kernels.load(folder) is not None
    try:
        os.chown(name, 65534, -1)  # nobody's: only root can give a file away
    except PermissionError:
        pytest.skip("not root: no file of another user can be made here")
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.load(folder) is None
    assert "belongs to another user (uid 65534)" in caplog.text


def test_a_failed_build_names_the_compiler_and_keeps_torch(cache, monkeypatch, caplog):
    folder, name, runs = cache
    monkeypatch.setenv("CC", f"{sys.executable} -c 'import sys; sys.exit(\"no such compiler\")'")
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.load(folder) is None
    assert "building the CPU kernels with" in caplog.text and "no such compiler" in caplog.text
    assert not name.exists() and not list(folder.glob("*.so"))


def test_the_build_compiles_the_bytes_its_key_names(cache, tmp_path, monkeypatch):
    """A source changed on disk between naming a build and compiling it (an upgrade, an edit)
    cannot put one version's library under another's name: the compiler is given the bytes the
    key hashed, not the files as they are by then."""
    folder, _, runs = cache
    files = cpu_build.source_files()
    files["cpu_kernels.c"] += b"\n/* the version this key names */\n"
    seen = tmp_path / "compiled.c"
    script = tmp_path / "recording cc.py"
    script.write_text("import shutil, sys\n"
                      "src = next(a for a in sys.argv if a.endswith('cpu_kernels.c'))\n"
                      f"shutil.copy(src, {str(seen)!r})\n"
                      f"shutil.copy({str(cpu_kernels.load(cache_root() / 'kernels')._lib._name)!r}, "
                      "sys.argv[sys.argv.index('-o') + 1])\n")
    monkeypatch.setenv("CC", f"{sys.executable} '{script}'")
    monkeypatch.setattr(cpu_kernels, "source_files", lambda: files)
    assert cpu_kernels.load(folder) is not None
    assert seen.read_bytes() == files["cpu_kernels.c"]
    assert (folder / f"cpu_kernels-{cpu_build.build_key(cpu_kernels.FLAGS, files)}.so").is_file()
