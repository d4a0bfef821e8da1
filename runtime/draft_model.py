"""The draft model of --speculative-config {"method": "draft_model"}: a smaller model with the
target's vocabulary, in the target runner's process, with its own ModelRunner (weights, kernels
and a paged KV cache of as many blocks, under the target's block tables: a token's draft K/V
lives in the block and slot of its target K/V, so the block pool, prefix cache, swap and forks
need nothing of their own).

Each step it runs first: one forward over the step's real tokens (every request's, so that its
KV keeps pace with the target's), whose last row gives each speculating request its first
draft, then one single-token forward per further draft. Drafts are the draft model's greedy
tokens: a point mass, which the target's sampler verifies by the rejection-sampling rule
(spec_decode.verify). A run whose drafts were all kept has its last draft's K/V written after
the step (catch_up): no forward had that token as input."""

from __future__ import annotations

import dataclasses
import logging

import torch

from pageserve.runtime.models.loader import ModelLoadError, load_tokenizer, read_config, resolve_model
from pageserve.runtime.scheduler import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)


class DraftModel:
    def __init__(self, runner):
        """runner: the draft's ModelRunner (built by the target's)."""
        self.runner = runner
        self.block_size = runner.block_size

    def _slot(self, sr: ScheduledRequest, pos: int) -> int:
        """(The block tables hold the step's blocks: its first forward brought them up to date.)"""
        block = self.runner.block_tables.block_id(sr.request_id, pos // self.block_size)
        return block * self.block_size + pos % self.block_size

    def _forward(self, step: SchedulerOutput, rows: list[int] | None = None) -> list[int]:
        """Run the draft over `step`; the greedy tokens at hidden rows `rows` (default: each
        request's last)."""
        r = self.runner
        ids, pos, meta = r._prepare(step)[:3]
        hidden = r.model(ids, pos, meta, r.kv_caches)
        if rows is None:
            rows = (meta.query_start_loc[1:] - 1).tolist()
        if not rows:
            return []
        return r.kernels.argmax(r.model.compute_logits(hidden[rows])).tolist()

    @torch.inference_mode()
    def propose(self, out: SchedulerOutput) -> None:
        """Write the draft tokens into the step's speculating requests (their draft_tokens hold
        placeholders: spec_decode.DraftModelProposer), after its forward over the real tokens."""
        real, slots, at, rows = [], [], 0, []
        for sr in out.requests:
            n, d = len(sr.token_ids), len(sr.draft_tokens)
            real.append(dataclasses.replace(sr, token_ids=sr.token_ids[:n - d], draft_tokens=[]))
            slots += out.slot_mapping[at:at + n - d]
            at += n
            if d:
                rows.append(len(slots) - 1)
        spec = [sr for sr in out.requests if sr.draft_tokens]
        firsts = self._forward(SchedulerOutput(requests=real, slot_mapping=slots), rows)
        drafts = [[t] for t in firsts]
        for j in range(1, max((len(sr.draft_tokens) for sr in spec), default=0)):
            step, which = SchedulerOutput(), []
            for i, sr in enumerate(spec):
                if len(sr.draft_tokens) > j:
                    pos = sr.start_pos + len(sr.token_ids) - len(sr.draft_tokens) + j - 1
                    step.requests.append(dataclasses.replace(sr, token_ids=[drafts[i][-1]], start_pos=pos,
                                                             draft_tokens=[]))
                    step.slot_mapping.append(self._slot(sr, pos))
                    which.append(i)
            for i, token in zip(which, self._forward(step)):
                drafts[i].append(token)
        for sr, d in zip(spec, drafts):
            sr.token_ids = sr.token_ids[:len(sr.token_ids) - len(sr.draft_tokens)] + d
            sr.draft_tokens = d

    @torch.inference_mode()
    def catch_up(self, out: SchedulerOutput, runs: dict[str, list[int]]) -> None:
        """The K/V of the last draft of each run kept whole (its token was no forward's input)."""
        step = SchedulerOutput()
        for sr in out.requests:
            if sr.draft_tokens and len(runs.get(sr.request_id, ())) == len(sr.draft_tokens) + 1:
                pos = sr.start_pos + len(sr.token_ids) - 1
                step.requests.append(dataclasses.replace(sr, token_ids=[sr.draft_tokens[-1]], start_pos=pos,
                                                         draft_tokens=[]))
                step.slot_mapping.append(self._slot(sr, pos))
        if step.requests:
            self._forward(step, rows=[])


def draft_model_config(args, spec, target, tokenizer, device: torch.device):
    """The draft's ModelConfig (SpeculativeConfig.model), in the target's dtype and context
    length; refused, with the reason, where the pair cannot work: another vocabulary, tensor
    parallelism or images (not yet)."""
    if args.tensor_parallel_size > 1:
        raise ValueError("speculative method draft_model with --tensor-parallel-size > 1 is not supported yet "
                         "(method ngram is)")
    path = resolve_model(spec.model, None, args.download_dir)
    hf = read_config(path)
    if hf.get("vision_config") or target.hf_config.get("vision_config"):
        raise ValueError("speculative method draft_model is not supported with vision-language models yet")
    cfg = dataclasses.replace(args, model=str(path), max_model_len=target.max_model_len, quantization=None,
                              enable_lora=False).model_config(path, hf, tokenizer, device)
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model {spec.model} has a vocabulary of {cfg.vocab_size} tokens, the model "
                         f"{target.vocab_size}: a draft must share the model's tokenizer")
    try:
        same = load_tokenizer(path).get_vocab() == tokenizer.get_vocab()
    except ModelLoadError:  # no tokenizer files beside the draft's weights: its config's size decides
        same = True
    if not same:
        raise ValueError(f"the draft model {spec.model} has another tokenizer than the model's: a draft must "
                         "share the model's tokenizer")
    logger.info("draft model %s: %s, %d layers, hidden size %d", spec.model, cfg.architecture, cfg.num_layers,
                cfg.hidden_size)
    return cfg
