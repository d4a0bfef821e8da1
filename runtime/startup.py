"""A start-up that Ctrl-C (or SIGTERM) cuts short. The model loads on the engine's own thread,
which a signal does not reach: the main thread calls `cancel()`, which stops the processes
start-up runs (a C compiler) and has the load raise StartupCancelled at its next phase."""

from __future__ import annotations

import logging
import os
import signal
import threading
from concurrent.futures import Future
from pathlib import Path

logger = logging.getLogger(__name__)
_cancelled = threading.Event()
STOP_S = 10.0  # how long an interrupted start-up may take to reach its next phase


class StartupCancelled(KeyboardInterrupt):
    """Raised on the engine's thread where start-up checks for a cancel."""


def check() -> None:
    """Between the phases of start-up (kernel build, weights, planning, warm-up steps)."""
    if _cancelled.is_set():
        raise StartupCancelled("start-up was interrupted")


def cancel() -> None:
    """Stop start-up: its next check raises, and every process under this one is killed (a
    compiler driver and what it runs, grammar compilers, worker ranks), but multiprocessing's
    resource tracker."""
    _cancelled.set()
    for pid in descendants(os.getpid()):
        try:
            if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes():  # multiprocessing's own
                os.kill(pid, signal.SIGKILL)
        except OSError:  # gone meanwhile
            pass


def result(loading: Future):
    """The load's result (it runs on another thread). On Ctrl-C or SIGTERM (KeyboardInterrupt
    here): cancel it, wait up to STOP_S for it to stop, and raise; exit at once on a second
    interrupt, or if it does not stop."""
    try:
        return loading.result()
    except KeyboardInterrupt:
        cancel()
        try:
            loading.exception(timeout=STOP_S)  # its end, whatever it was
        except BaseException:  # noqa: BLE001 - a second Ctrl-C, or a phase that runs on
            logger.warning("start-up did not stop within %g s; exiting at once", STOP_S)
            logging.shutdown()
            os._exit(130)
        raise


def reset() -> None:
    """For a later start-up in the same process (tests, the offline API)."""
    _cancelled.clear()


def descendants(pid: int) -> list[int]:
    """The processes under `pid`, children first (Linux's /proc; none elsewhere)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after the name, which may hold spaces
        parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        out += children
        todo += children
    return out
