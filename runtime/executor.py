"""Between the engine and the model: the engine hands each step's SchedulerOutput to an
executor and gets the sampled tokens back.

- UniProcExecutor (one rank): today's ModelRunner in this process; every call passes straight
  through.
- MultiprocExecutor (tensor or pipeline parallelism, --distributed-executor-backend mp): one
  worker process per rank of this node (runtime/worker.py), started together so that they load
  their parts and warm up in parallel. Each step is encoded once (runtime/wire.py: a fixed
  format, never pickle) and the same bytes are written
  to every worker's pipe; rank 0 (the last stage's first) answers with the StepResult.
  A step is submitted, and its result collected later: with a pipeline, the engine submits the
  next steps before the first one's result is in (answers come back in order, one per rank and
  message). Block swaps and copies are in the step (or a
  message of their own) and so run on every rank. A worker that dies, raises or does not
  answer in time stops them all, and the engine gets an ExecutorDeadError (it cannot go on:
  the ranks would be out of step); no worker outlives the executor or the engine process.
- run_headless_node (--nnodes above 1, on nodes 1..): that node's ranks and nothing else.
  They join the same process group and get every message from rank 0, which relays the
  pipe's bytes to them over torch.distributed (runtime/worker.py's Relay). A node exits when
  its ranks do: cleanly when the engine stops them, non-zero when one fails or the engine's
  node goes away."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import time
import weakref

import torch

from pageserve.runtime import wire, worker
from pageserve.runtime.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pageserve.runtime.engine_args import EngineArgs
from pageserve.runtime.lora import LoRAError, LoRARequest
from pageserve.runtime.model_runner import ModelRunner, StepResult
from pageserve.runtime.models.loader import read_config, resolve_model
from pageserve.runtime.ports import free_port
from pageserve.runtime.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

# as vLLM's VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS: a step no rank answers in this long is a hang
EXECUTE_TIMEOUT_S = float(os.environ.get("PAGESERVE_EXECUTE_TIMEOUT_S", "300"))
START_TIMEOUT_S = float(os.environ.get("PAGESERVE_WORKER_START_TIMEOUT_S", "1800"))  # load, profile, compile


class ExecutorDeadError(RuntimeError):
    """A worker (a rank of tensor or pipeline parallelism) died, failed or hung; every worker
    has been stopped and the engine cannot run another step."""


class UniProcExecutor:
    """One rank, in this process: the runner itself."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def execute(self, out: SchedulerOutput) -> StepResult:
        return self.runner.execute(out).resolve()

    def submit(self, out: SchedulerOutput) -> StepResult:
        """The step, launched now (on a GPU it may still run); its result is the handle that
        `collect` gives back once the host has its tokens."""
        return self.runner.execute(out)

    def collect(self, handle: StepResult) -> StepResult:
        return handle.resolve()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.runner.copy_blocks(pairs)

    def allocate_kv_cache(self, cache: CacheConfig) -> None:
        self.runner.allocate_kv_cache(cache)

    def warm_up(self, max_num_seqs: int) -> None:
        self.runner.warm_up_kernels()
        self.runner.capture_cuda_graphs(max_num_seqs)

    def add_lora(self, lora: LoRARequest, pin: bool = False) -> None:
        self.runner.lora.load(lora, pin)

    def unpin_lora(self, lora_int_id: int) -> None:
        self.runner.lora.unpin(lora_int_id)

    def remove_lora(self, lora_int_id: int) -> None:
        self.runner.lora.remove(lora_int_id)

    def shutdown(self) -> None:
        pass


class MultiprocExecutor:
    """N ranks, one worker process each. `num_blocks` is the smallest KV pool any rank can
    hold, so that one block table fits every rank."""
    runner = None  # no model in this process

    def __init__(self, args: EngineArgs, parallel: ParallelConfig, model_cfg: ModelConfig,
                 device_cfg: DeviceConfig, sched_cfg: SchedulerConfig):
        if parallel.node_rank != 0:
            raise ValueError(f"--node-rank {parallel.node_rank} runs only workers: start that node with "
                             "`pageserve serve --headless` (node 0 runs the engine)")
        self.vocab_size = model_cfg.vocab_size
        port = parallel.master_port or free_port(parallel.master_addr)
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._dead = False
        self.execute_timeout = EXECUTE_TIMEOUT_S
        self._sent: dict[str, int] = {}  # request id -> how many of its tokens the workers hold
        self._next_ticket = self._oldest = 0  # messages sent; the first one not answered yet
        self._answered: dict[int, list] = {}  # ticket -> every rank's answer, until it is asked for
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._conns)
        try:
            start = time.perf_counter()
            spawn_ranks(parallel, port, args, model_cfg, device_cfg, sched_cfg, self._procs, self._conns)
            blocks = self._collect(START_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks = min(blocks)  # rank 0's answer is already the least of the other nodes' too
        logger.info("%d workers on this node (pids %s; %d ranks, TP %d x PP %d, over %d node(s)) ready in %.1f s, "
                    "rendezvous %s:%d; KV blocks per rank %s", len(self._procs),
                    ", ".join(str(p.pid) for p in self._procs), parallel.world_size, parallel.tensor_parallel_size,
                    parallel.pipeline_parallel_size, parallel.nnodes,
                    time.perf_counter() - start, parallel.master_addr, port, blocks)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def execute(self, out: SchedulerOutput) -> StepResult:
        return self.collect(self.submit(out))

    def submit(self, out: SchedulerOutput) -> int:
        """Send the step to every rank; returns the ticket its result is collected with."""
        return self._send("execute", self._for_workers(out))

    def collect(self, ticket: int) -> StepResult:
        return self._answers(ticket, self.execute_timeout)[0]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self._call("copy_blocks", pairs)

    def allocate_kv_cache(self, cache: CacheConfig) -> None:
        self._call("allocate_kv_cache", cache, timeout=START_TIMEOUT_S)

    def warm_up(self, max_num_seqs: int) -> None:
        self._call("warm_up", max_num_seqs, timeout=START_TIMEOUT_S)

    def add_lora(self, lora: LoRARequest, pin: bool = False) -> None:
        """Every rank reads its part of the adapter (LoRAError with the first rank's reason)."""
        errors = [e for e in self._call("add_lora", lora, pin, every=True) if e]
        if errors:
            if pin:
                self._call("unpin_lora", lora.lora_int_id)
            self._call("remove_lora", lora.lora_int_id)
            raise LoRAError(errors[0])

    def unpin_lora(self, lora_int_id: int) -> None:
        self._call("unpin_lora", lora_int_id)

    def remove_lora(self, lora_int_id: int) -> None:
        self._call("remove_lora", lora_int_id)

    def shutdown(self) -> None:
        self._dead = True
        self._finalizer()

    def _for_workers(self, out: SchedulerOutput) -> SchedulerOutput:
        """The step as the workers get it: of each request's tokens only those they do not hold
        yet (a request's tokens only grow; the workers keep them until it finishes), grammar
        matchers replaced by their bitmask rows."""
        for rid in out.finished_ids:
            self._sent.pop(rid, None)
        requests = []
        for r in out.requests:
            held = self._sent.get(r.request_id, 0)
            self._sent[r.request_id] = len(r.request_tokens)
            mask = None if r.matcher is None else wire.MaskRow.of(r.matcher, self.vocab_size, r.draft_tokens)
            requests.append(dataclasses.replace(r, request_tokens=r.request_tokens[held:], matcher=mask))
        return dataclasses.replace(out, requests=requests)

    def _call(self, method: str, *call_args, timeout: float | None = None, every: bool = False):
        """Rank 0's answer (every rank's, with `every`), after those of the steps in flight."""
        answers = self._answers(self._send(method, *call_args), timeout or self.execute_timeout)
        return answers if every else answers[0]

    def _send(self, method: str, *call_args) -> int:
        if self._dead:
            raise ExecutorDeadError("the workers have been stopped")
        payload = wire.encode((method, call_args))  # once, for every rank
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(payload)
            except OSError as e:
                self._fail(f"worker rank {rank} (pid {self._procs[rank].pid}) is gone "
                           f"({e!r}, exit code {self._procs[rank].exitcode})")
        self._next_ticket += 1
        return self._next_ticket - 1

    def _answers(self, ticket: int, timeout: float) -> list:
        """Every rank's answers to message `ticket`, reading those of earlier messages first
        (kept until they are asked for)."""
        while ticket not in self._answered:
            self._answered[self._oldest] = self._collect(timeout)
            self._oldest += 1
        return self._answered.pop(ticket)

    def _collect(self, timeout: float) -> list:
        """Every rank's answer to the last message; a rank that raised, died or stayed silent
        for `timeout` seconds stops them all."""
        answers: list = [None] * len(self._conns)
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            sentinels = {self._procs[rank].sentinel: rank for rank in pending.values()}
            ready = multiprocessing.connection.wait([*pending, *sentinels], max(0.0, left))
            if not ready:
                ranks = sorted(pending.values())
                self._fail(f"worker rank(s) {ranks} did not answer within {timeout:g} s "
                           f"(hung; PAGESERVE_EXECUTE_TIMEOUT_S sets the limit)")
            for conn in [c for c in ready if c in pending]:  # answers before deaths: a last word counts
                rank = pending.pop(conn)
                try:
                    status, value = wire.decode(conn.recv_bytes())
                except (EOFError, OSError):
                    self._fail(self._death(rank))
                if status == "error":
                    dead = self._dead_peer(rank)
                    self._fail(f"worker rank {rank} failed:\n{value}" if dead is None else
                               f"{self._death(dead)}; rank {rank} failed with it: {(value.strip().splitlines() or [''])[-1]}")
                answers[rank] = value
            for s in ready:
                if s in sentinels and sentinels[s] in pending.values():
                    self._fail(self._death(sentinels[s]))
        return answers

    def _dead_peer(self, rank: int, wait: float = 1.0) -> int | None:
        """A rank whose collective lost a peer fails too, often before the peer's exit is seen:
        the rank, other than `rank`, that has died within `wait` seconds (the cause to report)."""
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs) if r != rank}
        ready = multiprocessing.connection.wait(list(sentinels), wait) if sentinels else []
        return sentinels[ready[0]] if ready else None

    def _death(self, rank: int) -> str:
        proc = self._procs[rank]
        proc.join(1.0)
        return f"worker rank {rank} (pid {proc.pid}) died (exit code {proc.exitcode})"

    def _fail(self, message: str):
        logger.error("%s; stopping every worker", message)
        for proc in self._procs:  # the others may be blocked in a collective with the lost rank, or stopped
            if proc.is_alive():
                proc.kill()
        self.shutdown()
        raise ExecutorDeadError(message)


def spawn_ranks(parallel: ParallelConfig, port: int, args: EngineArgs, model_cfg: ModelConfig,
                device_cfg: DeviceConfig, sched_cfg: SchedulerConfig, procs: list, conns: list | None) -> None:
    """Start this node's ranks (appended to `procs` as they start, so that a failure part way
    leaves them to the caller's cleanup), with a pipe each into `conns` on the engine's node,
    none (None) on the others."""
    local = parallel.ranks_per_node
    if device_cfg.device.type == "cuda" and local > torch.cuda.device_count():
        raise ValueError(f"--tensor-parallel-size {parallel.tensor_parallel_size} needs {local} GPUs "
                         f"{'on each node ' if parallel.nnodes > 1 else ''}(one per rank); this machine has "
                         f"{torch.cuda.device_count()}")
    if device_cfg.device.type == "cpu" and args.num_threads is None:  # the ranks share the cores
        device_cfg = dataclasses.replace(device_cfg, num_threads=max(1, device_cfg.num_threads // local))
    ctx = multiprocessing.get_context("spawn")
    for rank in parallel.node_ranks:
        parent, child = ctx.Pipe() if conns is not None else (None, None)
        proc = ctx.Process(target=worker.run_worker, name=f"pageserve-tp{rank}", daemon=True,
                           args=(rank, parallel, port, args, model_cfg, device_cfg, sched_cfg, child, os.getpid()))
        proc.start()
        procs.append(proc)
        if conns is not None:
            child.close()
            conns.append(parent)


def run_headless_node(args: EngineArgs) -> int:
    """`pageserve serve --headless`: run this node's ranks (node_rank above 0) and no engine,
    until they end: 0 when every one exits cleanly (the engine stopped them), 1 as soon as one
    fails (the others are stopped). The model and engine flags must be those node 0 was given."""
    parallel = args.parallel_config()
    if parallel.node_rank == 0:
        raise ValueError("--headless runs the workers of a node other than the engine's: give --node-rank "
                         f"1..{parallel.nnodes - 1}")
    device_cfg = args.resolve_device()
    path = resolve_model(args.model, args.revision, args.download_dir)
    model_cfg = args.model_config(path, read_config(path), args.load_tokenizer(path), device_cfg.device)
    sched_cfg = args.scheduler_config(model_cfg.max_model_len, device_cfg.device)
    procs: list[multiprocessing.process.BaseProcess] = []
    try:
        spawn_ranks(parallel, parallel.master_port, args, model_cfg, device_cfg, sched_cfg, procs, None)
        logger.info("node %d of %d: ranks %d..%d (pids %s) joining %s:%d", parallel.node_rank, parallel.nnodes,
                    parallel.node_ranks[0], parallel.node_ranks[-1], ", ".join(str(p.pid) for p in procs),
                    parallel.master_addr, parallel.master_port)
        alive = list(procs)
        while alive:
            multiprocessing.connection.wait([p.sentinel for p in alive])
            for proc in [p for p in alive if not p.is_alive()]:
                alive.remove(proc)
                if proc.exitcode != 0:
                    logger.error("%s (pid %d) exited with code %s (a failure here, or the engine's node is "
                                 "gone); stopping this node", proc.name, proc.pid, proc.exitcode)
                    return 1
        logger.info("node %d: every rank has stopped", parallel.node_rank)
        return 0
    finally:
        _stop(procs, [])


def _stop(procs: list, conns: list) -> None:
    """Ask every worker to exit, then terminate and kill what is left (a rank blocked in a
    collective whose peer died does not read its pipe)."""
    for conn in conns:
        try:
            conn.send_bytes(wire.encode(("shutdown", ())))
        except OSError:
            pass
    deadline = time.monotonic() + 5.0
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()
