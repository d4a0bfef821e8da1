"""One rank in its own process: joins torch.distributed, loads its part of the model (its
heads under tensor parallelism, its stage's layers under pipeline parallelism) into a
ModelRunner, sizes its KV pool over them, then runs what the executor sends
(runtime/executor.py) until told to stop or until the process that started it is gone.

Messages are (method, args) tuples in runtime/wire.py's format, never pickle. The ranks of the
engine's node read them from their pipes and answer each with ("ok", value) or ("error",
traceback); only rank 0's value carries anything (its sampled tokens: rank 0 is the last
stage's first rank), the others answer None, which tells the executor they are alive and in
step. With more than one node, rank 0 relays every message's bytes to the ranks of the other
nodes by a broadcast over a gloo group of its own (`Relay`); those ranks answer nothing: one
that fails exits, and the collectives or sends it leaves fail the engine's ranks. Every
relayed message is signed with the nodes' shared secret and numbered: a rank decodes only
what rank 0 signed for that place in the sequence, and exits on anything else."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import hashlib
import hmac
import logging
import os
import queue
import socket
import threading
import time
import traceback

import torch
import torch.distributed as dist

from pageserve.runtime.config import (SECRET_ENV, CacheConfig, DeviceConfig, ModelConfig, ParallelConfig,
                                      SchedulerConfig)
from pageserve.runtime import wire
from pageserve.runtime.cpu_env import bound_onednn_cache, keep_freed_memory
from pageserve.runtime.engine_args import CPU_KV_CACHE_GIB, GiB, EngineArgs
from pageserve.runtime.lora import LoRAError, LoRARequest
from pageserve.runtime.model_runner import ModelRunner, StepResult
from pageserve.runtime.ports import bound_socket, is_loopback
from pageserve.runtime.models import parallel as parallel_layers
from pageserve.runtime.pipeline import StageLink
from pageserve.runtime.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

_PARENT_POLL_S = 0.5
_ENGINE_GONE = wire.encode(("engine_gone", ()))
_SHUTDOWN = wire.encode(("shutdown", ()))  # the pipe closed without a "shutdown": the engine died
# the relay's receivers wait between steps for as long as the server idles: no timeout there
# (a dead head still ends the wait, as gloo's connection to it closes)
_RELAY_TIMEOUT = datetime.timedelta(days=365)
_MAX_MESSAGE = 1 << 32  # bytes: a step is far smaller; a size above it is not rank 0's


class NotAuthentic(Exception):
    """A relayed message that the shared secret did not sign (or not for its place)."""


def seal(key: bytes, seq: int, payload: bytes) -> bytes:
    """payload behind its HMAC-SHA256 over (seq, payload): the number makes a reordered message
    fail; the key (Relay's, of this run) one recorded in another run."""
    return hmac.digest(key, seq.to_bytes(8, "little") + payload, hashlib.sha256) + payload


def unseal(key: bytes, seq: int, data) -> memoryview:
    """The payload of a sealed message (any bytes-like `data`), read in place: a message is not
    copied before its signature is checked."""
    view = memoryview(data).cast("B")
    mac = hmac.new(key, seq.to_bytes(8, "little"), hashlib.sha256)
    mac.update(view[32:])
    if len(view) < 32 or not hmac.compare_digest(view[:32], mac.digest()):
        raise NotAuthentic(f"relayed message {seq} is not signed with this node's secret "
                           f"(--distributed-secret / ${SECRET_ENV}): refused")
    return view[32:]


class Relay:
    """Rank 0 -> the ranks of the other nodes: each message as bytes, sealed with a key of this
    run, broadcast (its length, then the bytes) over a gloo group of rank 0 and those ranks,
    so that a message crosses machines through torch.distributed whatever the device backend
    (NCCL included)."""

    def __init__(self, parallel: ParallelConfig):
        remote = range(parallel.ranks_per_node, parallel.world_size)  # every rank makes the group
        self.group = dist.new_group([0, *remote], backend="gloo", timeout=_RELAY_TIMEOUT)
        self.key, self.seq = self._run_key(parallel.secret), 0

    def _run_key(self, secret: bytes) -> bytes:
        """The shared secret bound to this run: each rank of the group adds 16 random bytes, and
        messages are signed with HMAC(secret, all of them), so that one recorded in an earlier
        run (with the same secret) fails here."""
        mine = torch.frombuffer(bytearray(os.urandom(16)), dtype=torch.uint8)
        parts = [torch.empty(16, dtype=torch.uint8) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, mine, group=self.group)
        return hmac.digest(secret, b"".join(p.numpy().tobytes() for p in parts), hashlib.sha256)

    def send(self, payload: bytes) -> None:
        self.seq += 1
        data = seal(self.key, self.seq, payload)
        dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=0, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=self.group)

    def recv(self) -> memoryview:
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.group)
        if not 0 <= int(size) <= _MAX_MESSAGE:
            raise NotAuthentic(f"a relayed message of {int(size)} bytes: refused")
        data = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.group)
        self.seq += 1
        return unseal(self.key, self.seq, data.numpy())

    def min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t)


def kv_pool_blocks(runner: ModelRunner, args: EngineArgs, sched: SchedulerConfig) -> int:
    """Blocks of this process's KV pool: on CUDA what the memory profile leaves of
    --gpu-memory-utilization (capped by --kv-cache-memory), on CPU --kv-cache-memory GiB. With
    tensor parallelism both are per rank, over the rank's KV heads."""
    block_bytes = runner.block_bytes()
    if runner.device.type == "cuda":
        num_blocks = runner.profile_num_blocks(args.gpu_memory_utilization, sched.max_num_batched_tokens,
                                               sched.max_num_seqs)
        if args.kv_cache_memory is not None:
            num_blocks = min(num_blocks, int(args.kv_cache_memory * GiB // block_bytes))
        return num_blocks
    return int((args.kv_cache_memory or CPU_KV_CACHE_GIB) * GiB // block_bytes)


def _exit_with_parent(parent_pid: int) -> None:
    """A worker never outlives the engine process: if it is gone (killed, crashed), exit, even
    while the main thread is blocked in a collective."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        os._exit(1)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def run_worker(rank: int, parallel: ParallelConfig, master_port: int, args: EngineArgs,
               model_cfg: ModelConfig, device_cfg: DeviceConfig, sched_cfg: SchedulerConfig,
               conn, parent_pid: int) -> None:
    """The process's entry point (multiprocessing, spawned). `conn`: the pipe to the engine on
    node 0; None on the other nodes, whose ranks follow rank 0's relay."""
    _exit_with_parent(parent_pid)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    relay = None
    try:
        runner, relay = _start(rank, parallel, master_port, args, model_cfg, device_cfg, sched_cfg)
        blocks = kv_pool_blocks(runner, args, sched_cfg)
        if relay is not None and (rank == 0 or conn is None):  # rank 0 answers for the other nodes too
            blocks = relay.min(blocks)
        if conn is not None:
            conn.send_bytes(wire.encode(("ok", blocks)))
    except BaseException:  # noqa: BLE001 - reported to the engine, which stops every rank
        _report(conn)
    _serve(rank, runner, conn, relay)
    dist.destroy_process_group()


def _start(rank, parallel, master_port, args, model_cfg, device_cfg, sched_cfg) -> tuple[ModelRunner, Relay | None]:
    device = device_cfg.device
    if device.type == "cuda":
        local = rank % parallel.ranks_per_node  # one process per GPU of its machine
        torch.cuda.set_device(local)
        device_cfg = dataclasses.replace(device_cfg, device=torch.device("cuda", local))
    else:
        torch.set_num_threads(device_cfg.num_threads)
        keep_freed_memory()
        bound_onednn_cache()
    if parallel.nnodes == 1 and is_loopback(parallel.master_addr) and "lo" in dict(socket.if_nameindex()).values():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # else gloo listens where the host name resolves
    timeout = datetime.timedelta(minutes=30)
    store = dist.PrefixStore("default_pg", _store(rank, parallel, master_port, timeout))  # as a tcp:// init's
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=parallel.world_size, timeout=timeout)
    relay = Relay(parallel) if parallel.nnodes > 1 else None
    pp, stage = parallel.pipeline_parallel_size, parallel.stage_of(rank)
    tp_rank = rank % parallel.tensor_parallel_size
    link = None
    if pp > 1:  # every rank makes every stage's group, in the same order
        for s in range(pp):
            group = dist.new_group(list(parallel.stage_ranks(s)))
            if s == stage:
                parallel_layers.set_group(group)
        link = StageLink(parallel.stage_ranks(stage - 1)[tp_rank] if stage > 0 else None,
                         parallel.stage_ranks(stage + 1)[tp_rank] if stage < pp - 1 else None,
                         model_cfg.hidden_size, model_cfg.dtype, device_cfg.device)
    cfg = dataclasses.replace(model_cfg, tp_rank=tp_rank, pp_rank=stage)
    return ModelRunner(cfg, device_cfg, args.block_size, args.seed, lora=args.lora_config(), link=link), relay


def _store(rank: int, parallel: ParallelConfig, port: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """torch.distributed's rendezvous store; rank 0 serves it on a socket it binds to the master
    address itself, as torch binds its own on every interface (where the address is not this
    machine's, as behind NAT, on every interface still, as before)."""
    if rank != 0:
        return dist.TCPStore(parallel.master_addr, port, parallel.world_size, False, timeout)
    host = parallel.master_addr
    if parallel.nnodes > 1 and not is_loopback(host) and is_loopback(
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0]):
        host = ""  # a name that is 127.0.1.1 here (Debian's way) and node 0's address to the others
    try:
        sock = bound_socket(host, port)
    except OSError as e:
        if e.errno != errno.EADDRNOTAVAIL:
            raise
        host = ""
        sock = bound_socket(host, port)
    if not host:
        logger.warning("the master address %s is not one the other nodes reach on this machine: the "
                       "rendezvous listens on every interface", parallel.master_addr)
    sock.listen(128)
    return dist.TCPStore(parallel.master_addr, port, parallel.world_size, True, timeout, master_listen_fd=sock.detach())


def _inbox(rank: int, conn, relay: Relay | None):
    """The next message, as a function: from the pipe on the engine's node, from rank 0's relay
    on the others. Rank 0 relays each message as it arrives, from a thread of its own, so that
    the other nodes' stages start a step while it still computes the one before (pipeline
    parallelism). The pipe closing without a "shutdown" means the engine died."""
    def from_pipe() -> bytes:
        try:
            return conn.recv_bytes()
        except EOFError:
            return _ENGINE_GONE

    if conn is None:
        return relay.recv
    if relay is None or rank != 0:
        return from_pipe
    received: queue.Queue = queue.Queue()

    def relay_all():
        while True:
            payload = from_pipe()
            try:
                relay.send(payload)
            except Exception:  # noqa: BLE001 - a node is gone: this rank exits, the engine stops the rest
                logger.exception("relaying a message to the other nodes failed")
                os._exit(1)
            received.put(payload)
            if payload in (_SHUTDOWN, _ENGINE_GONE):
                return
    threading.Thread(target=relay_all, name="relay", daemon=True).start()
    return received.get


def _serve(rank: int, runner: ModelRunner, conn, relay: Relay | None) -> None:
    tokens: dict[str, list[int]] = {}  # each unfinished request's tokens, grown by what each step adds

    def execute(out: SchedulerOutput) -> StepResult:
        for rid in out.finished_ids:
            tokens.pop(rid, None)
        for r in out.requests:
            held = tokens.setdefault(r.request_id, [])
            held.extend(r.request_tokens)
            r.request_tokens = held
        return runner.execute(out).resolve()

    def allocate(cache: CacheConfig) -> None:
        runner.allocate_kv_cache(cache)

    def warm_up(max_num_seqs: int) -> None:
        runner.warm_up_kernels()
        runner.capture_cuda_graphs(max_num_seqs)

    def add_lora(lora: LoRARequest, pin: bool) -> str | None:  # each rank reads its part; an error is the request's
        try:
            runner.lora.load(lora, pin)
        except LoRAError as e:
            return str(e)
        return None

    receive = _inbox(rank, conn, relay)
    methods = {"execute": execute, "copy_blocks": runner.copy_blocks,
               "allocate_kv_cache": allocate, "warm_up": warm_up, "add_lora": add_lora,
               "unpin_lora": lambda lora_int_id: runner.lora.unpin(lora_int_id),
               "remove_lora": lambda lora_int_id: runner.lora.remove(lora_int_id)}
    while True:
        try:
            method, call_args = wire.decode(receive())
            if method == "shutdown":
                return
            if method == "engine_gone":  # every rank, on every node, exits non-zero
                logger.error("the engine's process is gone; exiting")
                os._exit(1)
            value = methods[method](*call_args)
            if conn is not None:
                answer = value if rank == 0 or method == "add_lora" else None
                conn.send_bytes(wire.encode(("ok", answer)))
        except BaseException:  # noqa: BLE001 - the ranks are out of step now: the engine stops them all
            _report(conn)


def _report(conn) -> None:
    """Send the exception being handled to the engine (or, on another node than the engine's,
    write it to stderr), then exit (the engine stops the others)."""
    if conn is None:
        traceback.print_exc()
    else:
        with contextlib.suppress(OSError):
            conn.send_bytes(wire.encode(("error", traceback.format_exc())))
    os._exit(1)
