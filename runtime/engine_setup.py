"""From EngineArgs to what an engine runs on: the CPU's threads, the model's config and tokenizer,
the executor with the model loaded (here, or in one worker process a rank), and the KV cache
sized from the memory left after the weights and allocated on every rank."""

from __future__ import annotations

import dataclasses
import logging

import torch

from pageserve.runtime import startup
from pageserve.runtime.config import EngineConfig, SpeculativeConfig
from pageserve.runtime.cpu_env import bound_onednn_cache, keep_freed_memory
from pageserve.runtime.draft_model import draft_model_config
from pageserve.runtime.engine_args import GiB, EngineArgs
from pageserve.runtime.executor import MultiprocExecutor, UniProcExecutor
from pageserve.runtime.model_runner import ModelRunner, kv_block_bytes
from pageserve.runtime.models.loader import read_config, resolve_model
from pageserve.runtime.worker import kv_pool_blocks

logger = logging.getLogger(__name__)


def build(args: EngineArgs) -> tuple[EngineConfig, object, UniProcExecutor | MultiprocExecutor]:
    """The engine's config, the tokenizer and the executor, its KV cache allocated."""
    device = args.resolve_device()
    parallel = args.parallel_config()
    if device.device.type == "cpu" and parallel.world_size == 1:
        torch.set_num_threads(device.num_threads)
        keep_freed_memory()
        bound_onednn_cache()
    path = resolve_model(args.model, args.revision, args.download_dir)
    tokenizer = args.load_tokenizer(path)
    model_cfg = args.model_config(path, read_config(path), tokenizer, device.device)
    sched_cfg = args.scheduler_config(model_cfg.max_model_len, device.device)
    speculative = SpeculativeConfig.parse(args.speculative_config)
    draft = None if speculative is None or speculative.method != "draft_model" else \
        draft_model_config(args, speculative, model_cfg, tokenizer, device.device)
    if parallel.world_size == 1:
        runner = ModelRunner(model_cfg, device, args.block_size, args.seed, lora=args.lora_config(), draft=draft)
        executor, num_blocks = UniProcExecutor(runner), kv_pool_blocks(runner, args, sched_cfg)
    else:  # the workers load their parts and size their pools; one block table must fit them all
        executor = MultiprocExecutor(args, parallel, model_cfg, device, sched_cfg)
        num_blocks = executor.num_blocks
    try:
        # per rank (its stage's layers; the largest stage's); with a draft model's blocks beside the model's
        block_bytes = executor.runner.block_bytes() if executor.runner else \
            max(kv_block_bytes(dataclasses.replace(model_cfg, pp_rank=s), args.block_size)
                for s in range(parallel.pipeline_parallel_size))
        num_swap = int(args.swap_space_gib(device.device) * GiB // block_bytes)
        cache_cfg = args.cache_config(num_blocks, num_swap, model_cfg.max_model_len,
                                      model_cfg.sliding_window, sched_cfg.max_num_batched_tokens)
        startup.check()
        executor.allocate_kv_cache(cache_cfg)
        config = EngineConfig(model=model_cfg, cache=cache_cfg, scheduler=sched_cfg, device=device,
                              seed=args.seed, debug_checks=args.debug_checks, parallel=parallel,
                              multimodal=args.multimodal_config(model_cfg, sched_cfg.max_num_batched_tokens,
                                                                device.device),
                              lora=args.lora_config(),
                              speculative=speculative)
        logger.info("engine ready: %s, %s%s, %d KV blocks of %d tokens in %s (%.2f GiB%s)",
                    model_cfg.architecture, model_cfg.dtype, " (bfloat16 matmuls)" if model_cfg.bf16_matmuls
                    else "", num_blocks, args.block_size, str(model_cfg.kv_cache_dtype).removeprefix("torch."),
                    num_blocks * block_bytes / GiB,
                    f" per rank, TP {parallel.tensor_parallel_size} x PP {parallel.pipeline_parallel_size}, "
                    f"{parallel.batches_in_flight} batch(es) in flight" if parallel.world_size > 1 else "")
    except BaseException:
        executor.shutdown()
        raise
    return config, tokenizer, executor
