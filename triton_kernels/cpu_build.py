"""Building and trusting the CPU kernels' library: the C sources compiled once per machine and
CPU model with the system's compiler (`cc -O3 -march=native -fopenmp`) into a cache folder, built
aside and renamed into place; a compiled file is loaded only when no other user could have
written it. cpu_kernels.load calls these."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

# a child of cpu_kernels' logger: the CPU kernels' messages under one name
logger = logging.getLogger("pageserve.triton_kernels.cpu_kernels.build")

SOURCES = [Path(__file__).with_name(name) for name in ("cpu_linear.c", "cpu_linear_bf16.c", "cpu_kernels.c",
                                                             "cpu_attention.c", "cpu_attention_bf16.c",
                                                             "cpu_attention_fp8.c")]
HEADERS = [Path(__file__).with_name(name) for name in ("cpu_kernels.h", "cpu_weights.h")]
# -ffp-contract=off: no fused a * b + c that the source does not write (GCC fused a scalar
# tail in one inlining and not another: one rounding, whatever the inlining)
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]


def source_files() -> dict[str, bytes]:
    """The sources and headers as they are now, read once: a build compiles these bytes and its
    key hashes the same ones, so a file changed in between cannot give a key another build."""
    return {path.name: path.read_bytes() for path in (*SOURCES, *HEADERS)}


def build_key(flags: list[str], files: dict[str, bytes] | None = None) -> str:
    """What names a build: the sources (`files`, default: as they are now), the flags, and the
    machine and CPU model they target."""
    h = hashlib.sha256()
    for text in (files or source_files()).values():
        h.update(text)
    h.update(" ".join(flags).encode())
    h.update(platform.machine().encode())
    try:  # -march=native: a different CPU model needs its own build
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
        h.update(flags.encode())
    except (OSError, StopIteration):
        pass
    return h.hexdigest()[:16]


def untrusted(path: Path) -> str | None:
    """Why a compiled file may not be loaded: code that another user could have written (the
    file, or its folder, owned by someone else or writable by others). A folder of this user's
    that others may write to (a umask of 002) is closed first: a file they put there is theirs,
    which the file's own check refuses."""
    folder = path.parent
    st = folder.stat()
    if st.st_uid == os.getuid() and st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        with contextlib.suppress(OSError):
            folder.chmod(stat.S_IMODE(st.st_mode) & ~0o022)
            logger.warning("%s was writable by other users: closed it (mode %o)", folder,
                           stat.S_IMODE(st.st_mode) & ~0o022)
    for p in (path, folder):
        st = p.stat()
        if st.st_uid not in (os.getuid(), 0):
            return f"{p} belongs to another user (uid {st.st_uid})"
        if st.st_mode & 0o022 and not (p.is_dir() and st.st_mode & stat.S_ISVTX and st.st_uid == os.getuid()):
            return f"{p} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def build(cache_dir: Path, path: Path, flags: list[str], files: dict[str, bytes] | None = None) -> bool:
    """Compile the library (`files`, default: the sources as they are now) to `path`; False
    (logged) where there is no compiler or it fails."""
    compiler = shlex.split(os.environ.get("CC", "")) or [c for c in (shutil.which("cc") or shutil.which("gcc"),) if c]
    if not compiler:
        logger.info("no C compiler: the CPU path keeps torch's ops")
        return False
    tmp = None
    try:
        cache_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
        fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".so")  # built aside, then renamed: no torn file
        os.close(fd)
        with tempfile.TemporaryDirectory() as src:
            for name, text in (files or source_files()).items():
                (Path(src) / name).write_bytes(text)
            subprocess.run([*compiler, *flags, *(str(Path(src) / p.name) for p in SOURCES), "-o", tmp, "-lm"],
                           check=True, capture_output=True, text=True, timeout=120)
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would keep other users of a shared cache out
        os.replace(tmp, path)
        return True
    except (OSError, subprocess.SubprocessError) as e:
        detail = (getattr(e, "stderr", "") or str(e)).strip()
        logger.warning("building the CPU kernels with %s failed; keeping torch's ops: %s", " ".join(compiler),
                       detail.splitlines()[-1] if detail else e)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        return False
