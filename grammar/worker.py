"""Grammar automata are compiled in a child process, so that one hostile regex or schema (an
automaton that grows exponentially, say `[ab]*a[ab]{30}`) can neither run the server out of
memory nor hold the compiler forever: the child has a memory limit, and a compile that runs
past its time limit is ended by killing the child, which is started again for the next one.

The child is `python -m pageserve.grammar.worker`: a fresh interpreter that imports only
outlines-core and pageserve's light package modules (no torch, no OpenMP state, nothing of the
parent's main module). Messages on its stdin and
stdout are length-prefixed pickles; compiled Index objects come back pickled."""

from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import BinaryIO

from outlines_core import Index, Vocabulary

# the compiler process's niceness above the server's, so that a compile does not take a whole
# core from the model's threads (docs/performance.md, "Start-up and the first request")
NICE = 5

_HEADER = struct.Struct("<Q")


class CompileError(ValueError):
    pass


class CompilerStopped(CompileError):
    """The compile was cut short by close() (the server is shutting down): says nothing about
    the grammar."""


class CompileTimeout(CompileError):
    """The compile ran past its time limit (the child is ended)."""


class CompilerLost(CompileError):
    """The child died of something that need not be the grammar's doing (killed from outside,
    or by the machine running out of memory): the request fails, a later one compiles anew."""


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    index: Index
    # the states where the grammar is complete and allows nothing but EOS: a request that
    # reaches one is done. Found once here, so the engine's per-token check is a set lookup
    terminal_states: frozenset[int]


def _terminal_states(index: Index, eos: int) -> frozenset[int]:
    return frozenset(s for s in index.get_final_states()
                     if all(t == eos for t in index.get_allowed_tokens(s)))


def _send(stream: BinaryIO, obj) -> None:
    data = pickle.dumps(obj)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _recv(stream: BinaryIO):
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return pickle.loads(data)


def anchored_index(regex: str, vocab: Vocabulary) -> Index:
    """Anchored with `$`: without it, outlines-core (0.2.x) builds the automaton so that a state
    where the regex could end loses the transitions that would go on (`ab(xab)?` would never
    write the x), which breaks optional tails, repeated tool calls and free text alike."""
    return Index(f"(?:{regex})$", vocab)


def _serve(stdin: BinaryIO, stdout: BinaryIO) -> None:
    import resource

    eos, tokens, memory_bytes = _recv(stdin)
    if memory_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    vocab = Vocabulary(eos, tokens)
    del tokens
    while True:
        try:
            regex = _recv(stdin)
        except EOFError:
            return
        try:
            index = anchored_index(regex, vocab)
            # a plain tuple: this module is __main__ here, its classes do not unpickle elsewhere
            reply = ("ok", (index, _terminal_states(index, eos)))
        except MemoryError:
            reply = ("error", "the grammar needs more memory than the compiler may use; simplify it")
        except Exception as e:  # noqa: BLE001 - a regex the automaton library refuses
            reply = ("error", f"the grammar cannot be compiled: {str(e).splitlines()[0]}")
        _send(stdout, reply)


class CompileWorker:
    """The parent's end. Used from one thread at a time (the compiler's worker thread); close()
    may come from another one."""

    command = [sys.executable, "-m", "pageserve.grammar.worker"]

    def __init__(self, eos: int, tokens: dict[bytes, list[int]], timeout: float, memory_bytes: int):
        self.eos, self.tokens = eos, tokens
        self.timeout, self.memory_bytes = timeout, memory_bytes
        self._proc: subprocess.Popen | None = None
        self._stopped = False
        self._spawn_lock = threading.Lock()  # close() never misses a child started beside it

    def compile(self, regex: str, timeout: float | None = None) -> CompiledGrammar:
        """`timeout`: this compile's limit, when less than the worker's."""
        timeout = self.timeout if timeout is None else min(timeout, self.timeout)
        with self._spawn_lock:
            if self._stopped:
                raise CompilerStopped("the grammar compiler is stopped: the server is shutting down")
            proc = self._proc
            fresh = proc is None or proc.poll() is not None
            if fresh:
                try:
                    proc = self._proc = subprocess.Popen(self.command, stdin=subprocess.PIPE,
                                                         stdout=subprocess.PIPE)
                except OSError as e:  # no process could be made (file descriptors, memory)
                    raise CompileError(f"the grammar compiler process could not start: {e}") from None
                try:  # below the engine: a compile beside serving must not pause the model's threads
                    os.setpriority(os.PRIO_PROCESS, proc.pid, os.getpriority(os.PRIO_PROCESS, 0) + NICE)
                except OSError:
                    pass
        try:
            if fresh:
                _send(proc.stdin, (self.eos, self.tokens, self.memory_bytes))
            _send(proc.stdin, regex)
            ready, _, _ = select.select([proc.stdout], [], [], timeout)
            status, payload = _recv(proc.stdout) if ready else (None, None)
        except (EOFError, OSError, ValueError):  # ValueError: a pipe that close() shut meanwhile
            raise self._death(proc) from None
        if not ready:
            self._end()
            raise CompileTimeout(f"the grammar took longer than {timeout:g} s to compile; "
                                 f"simplify the schema or regex")
        if status != "ok":
            raise CompileError(payload)
        return CompiledGrammar(*payload)

    def _death(self, proc: subprocess.Popen) -> CompileError:
        """Why the child went away mid-compile. Only a death its own memory limit explains (an
        allocation failure aborts it) blames the grammar; a SIGKILL may be the kernel's OOM
        killer on a machine short of memory for other reasons, or an operator's kill."""
        if self._stopped:
            return CompilerStopped("the grammar compile was cut short: the server is shutting down")
        try:
            code = proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        self._end()
        if code == -signal.SIGABRT:
            return CompileError("the grammar compiler ran out of memory on this grammar; simplify the "
                                "schema or regex")
        if code == -signal.SIGKILL:
            return CompilerLost("the grammar compiler was killed while compiling this grammar (the machine "
                                "ran out of memory, or it was stopped from outside); try again, or simplify "
                                "the schema or regex")
        if code is None:
            how = "it did not exit"
        elif code < 0:
            how = f"ended by signal {-code}" + (f" ({signal.Signals(-code).name})" if -code in signal.valid_signals() else "")
        else:
            how = f"exited with code {code}"
        return CompileError(f"the grammar compiler process failed ({how}) while compiling this grammar")

    def close(self) -> None:
        """Stop for good (shutdown): a compile in progress ends with CompilerStopped."""
        with self._spawn_lock:
            self._stopped = True
        self._end()

    def _end(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait(5)
            proc.stdin.close()
            proc.stdout.close()


if __name__ == "__main__":
    _serve(sys.stdin.buffer, sys.stdout.buffer)
