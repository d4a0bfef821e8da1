"""Owns the model and the paged KV cache; turns one SchedulerOutput into sampled tokens."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from runtime.attention import AttentionMetadata, make_backend
from runtime.config import CacheConfig, DeviceConfig, ModelConfig
from runtime.models.llama import LlamaForCausalLM, rope_cos_sin_cache
from runtime.models.loader import ModelLoadError, iter_safetensors
from runtime.scheduler import SchedulerOutput
from sampling.sampler import SamplingMetadata, sample

logger = logging.getLogger(__name__)


def kv_block_bytes(model: ModelConfig, block_size: int) -> int:
    """Bytes of one block across all layers, K and V."""
    elem = torch.empty((), dtype=model.dtype).element_size()
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * elem


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, device_cfg: DeviceConfig, block_size: int, seed: int):
        self.model_cfg = model_cfg
        self.device = device_cfg.device
        self.block_size = block_size
        self.backend = make_backend(device_cfg.attention_backend, block_size, model_cfg.num_heads,
                                    model_cfg.num_kv_heads)
        self.model = self._load_model(Path(model_cfg.path))
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.seeded: dict[str, torch.Generator] = {}  # per-request generators of seeded requests
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._kv_storage: torch.Tensor | None = None
        self._swap_storage: torch.Tensor | None = None

    def _load_model(self, path: Path) -> LlamaForCausalLM:
        cfg = self.model_cfg
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg, self.backend)
        model = model.to_empty(device=self.device)
        try:
            model.load_weights(iter_safetensors(path))
        except ModelLoadError:
            raise
        except ValueError as e:
            raise ModelLoadError(f"weights in {path} do not fit the model: {e}") from None
        model = model.to(cfg.dtype)
        # the RoPE table stays float32 (it was lost on the meta device)
        model.cos_sin_cache = rope_cos_sin_cache(cfg).to(self.device)
        return model.eval()

    def profile_num_blocks(self, gpu_memory_utilization: float, max_num_batched_tokens: int) -> int:
        """CUDA: run a forward of a full token budget, then give the KV cache what is left of
        the allowed fraction of device memory."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        free, total = torch.cuda.mem_get_info()
        ids = torch.zeros(max_num_batched_tokens, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            hidden = self.model.embed_tokens(ids)
            for layer in self.model.layers:
                hidden = layer.down_proj(layer.ops.silu_and_mul(layer.gate_up_proj(hidden)))
            self.model.compute_logits(hidden[:256])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        used_by_others = total - free - torch.cuda.memory_allocated()
        budget = total * gpu_memory_utilization - used_by_others - peak
        return int(budget // kv_block_bytes(self.model_cfg, self.block_size))

    def allocate_kv_cache(self, cache: CacheConfig) -> None:
        cfg = self.model_cfg
        shape = (cfg.num_layers, 2, cache.num_blocks, cfg.num_kv_heads, cache.block_size, cfg.head_dim)
        # zero-fill touches every page, so the pool's memory is committed now, not mid-run
        self._kv_storage = torch.zeros(shape, dtype=cfg.dtype, device=self.device)
        self._kv_storage.fill_(0)
        self.kv_caches = [(self._kv_storage[i, 0], self._kv_storage[i, 1]) for i in range(cfg.num_layers)]
        if cache.num_swap_blocks:
            swap_shape = shape[:2] + (cache.num_swap_blocks,) + shape[3:]
            # left untouched on purpose: swap pages cost memory only once something is swapped
            self._swap_storage = torch.empty(swap_shape, dtype=cfg.dtype,
                                             pin_memory=self.device.type == "cuda")

    def swap_blocks(self, out: SchedulerOutput) -> None:
        """The step's swap-outs, then its swap-ins: one gather and one scatter over the whole
        cache (all layers, K and V) per direction."""
        if out.swap_out:
            src = torch.tensor([d for d, _ in out.swap_out], device=self.device)
            dst = torch.tensor([s for _, s in out.swap_out])
            self._swap_storage[:, :, dst] = self._kv_storage[:, :, src].to("cpu")
        if out.swap_in:
            src = torch.tensor([s for s, _ in out.swap_in])
            dst = torch.tensor([d for _, d in out.swap_in], device=self.device)
            self._kv_storage[:, :, dst] = self._swap_storage[:, :, src].to(self.device, non_blocking=True)

    def _prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        input_ids: list[int] = []
        positions: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        max_blocks = max(len(r.block_ids) for r in out.requests)
        block_tables: list[list[int]] = []
        for r in out.requests:
            n = len(r.token_ids)
            input_ids.extend(r.token_ids)
            positions.extend(range(r.start_pos, r.start_pos + n))
            query_start.append(query_start[-1] + n)
            seq_lens.append(r.start_pos + n)
            block_tables.append(r.block_ids + [0] * (max_blocks - len(r.block_ids)))
            if r.sample:
                logits_rows.append(query_start[-1] - 1)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(out.slot_mapping, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(block_tables, dtype=torch.int32, device=dev),
            max_query_len=max(query_start[i + 1] - query_start[i] for i in range(len(seq_lens))),
            max_seq_len=max(seq_lens),
        )
        self.backend.prepare(meta)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        return ids, pos, meta, logits_rows

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[list[int], list[torch.Tensor]]:
        """Run one step. Returns one sampled token per request whose `sample` is set, and the
        float32 sum of the step's last hidden states per request whose `pool` is set, in order."""
        for rid in out.finished_ids:
            self.seeded.pop(rid, None)
        self.swap_blocks(out)
        if not out.requests:
            return [], []
        ids, pos, meta, logits_rows = self._prepare(out)
        hidden = self.model(ids, pos, meta, self.kv_caches)
        pooled = self._pool(out, hidden, meta) if any(r.pool for r in out.requests) else []
        if not logits_rows:
            return [], pooled
        logits = self.model.compute_logits(hidden[logits_rows])
        sampling = [r for r in out.requests if r.sample]
        own = {i: self._request_generator(r.request_id, r.sampling_params.seed)
               for i, r in enumerate(sampling)
               if r.sampling_params.seed is not None and not r.sampling_params.greedy}
        meta = SamplingMetadata([r.sampling_params for r in sampling], self.device,
                                self.model_cfg.vocab_size, own)
        return sample(logits, meta, self.generator).tolist(), pooled

    @staticmethod
    def _pool(out: SchedulerOutput, hidden: torch.Tensor, meta: AttentionMetadata) -> list[torch.Tensor]:
        starts = meta.query_start_loc.tolist()
        return [hidden[starts[i]:starts[i + 1]].float().sum(dim=0)
                for i, r in enumerate(out.requests) if r.pool]

    def _request_generator(self, request_id: str, seed: int) -> torch.Generator:
        gen = self.seeded.get(request_id)
        if gen is None:
            gen = self.seeded[request_id] = torch.Generator(device=self.device)
            gen.manual_seed(seed)
        return gen
