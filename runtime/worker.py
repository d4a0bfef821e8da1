"""One tensor-parallel rank in its own process: joins torch.distributed, loads its part of the
model into a ModelRunner, sizes its KV pool over its own heads, then runs what the executor
sends (runtime/executor.py) until told to stop or until the engine process is gone.

Messages on the pipe are pickled (method, args) tuples; every rank answers each one with
("ok", value) or ("error", traceback), and only rank 0's value carries anything (its sampled
tokens); the others answer None, which tells the executor they are alive and in step."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import pickle
import threading
import time
import traceback

import torch
import torch.distributed as dist

from pageserve.runtime.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig
from pageserve.runtime.cpu_env import bound_onednn_cache, keep_freed_memory
from pageserve.runtime.engine_args import CPU_KV_CACHE_GIB, GiB, EngineArgs
from pageserve.runtime.model_runner import ModelRunner, StepResult, kv_block_bytes
from pageserve.runtime.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

_PARENT_POLL_S = 0.5


def kv_pool_blocks(runner: ModelRunner, args: EngineArgs, sched: SchedulerConfig) -> int:
    """Blocks of this process's KV pool: on CUDA what the memory profile leaves of
    --gpu-memory-utilization (capped by --kv-cache-memory), on CPU --kv-cache-memory GiB. With
    tensor parallelism both are per rank, over the rank's KV heads."""
    block_bytes = kv_block_bytes(runner.model_cfg, runner.block_size)
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


def run_worker(rank: int, world_size: int, master_addr: str, master_port: int, args: EngineArgs,
               model_cfg: ModelConfig, device_cfg: DeviceConfig, sched_cfg: SchedulerConfig,
               conn, parent_pid: int) -> None:
    """The process's entry point (multiprocessing, spawned)."""
    _exit_with_parent(parent_pid)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    try:
        runner = _start(rank, world_size, master_addr, master_port, args, model_cfg, device_cfg, sched_cfg)
        conn.send_bytes(pickle.dumps(("ok", kv_pool_blocks(runner, args, sched_cfg))))
    except BaseException:  # noqa: BLE001 - reported to the engine, which stops every rank
        _report(conn)
    _serve(rank, runner, conn)
    dist.destroy_process_group()


def _start(rank, world_size, master_addr, master_port, args, model_cfg, device_cfg, sched_cfg) -> ModelRunner:
    device = device_cfg.device
    if device.type == "cuda":
        local = rank % torch.cuda.device_count()  # one process per GPU of this machine
        torch.cuda.set_device(local)
        device_cfg = dataclasses.replace(device_cfg, device=torch.device("cuda", local))
    else:
        torch.set_num_threads(device_cfg.num_threads)
        keep_freed_memory()
        bound_onednn_cache()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(minutes=30))
    cfg = dataclasses.replace(model_cfg, tp_rank=rank)
    return ModelRunner(cfg, device_cfg, args.block_size, args.seed)


def _serve(rank: int, runner: ModelRunner, conn) -> None:
    tokens: dict[str, list[int]] = {}  # each unfinished request's tokens, grown by what each step adds

    def execute(out: SchedulerOutput) -> StepResult:
        for rid in out.finished_ids:
            tokens.pop(rid, None)
        for r in out.requests:
            held = tokens.setdefault(r.request_id, [])
            held.extend(r.request_tokens)
            r.request_tokens = held
        return runner.execute(out)

    def allocate(cache: CacheConfig) -> None:
        runner.allocate_kv_cache(cache)

    def warm_up(max_num_seqs: int) -> None:
        runner.warm_up_kernels()
        runner.capture_cuda_graphs(max_num_seqs)

    methods = {"execute": execute, "copy_blocks": runner.copy_blocks,
               "allocate_kv_cache": allocate, "warm_up": warm_up}
    while True:
        try:
            method, call_args = pickle.loads(conn.recv_bytes())
        except EOFError:  # the engine closed its end
            return
        if method == "shutdown":
            return
        try:
            value = methods[method](*call_args)
            conn.send_bytes(pickle.dumps(("ok", value if rank == 0 else None), pickle.HIGHEST_PROTOCOL))
        except BaseException:  # noqa: BLE001 - the ranks are out of step now: the engine stops them all
            _report(conn)


def _report(conn) -> None:
    """Send the exception being handled to the engine, then exit (the engine stops the others)."""
    with contextlib.suppress(OSError):
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    os._exit(1)
