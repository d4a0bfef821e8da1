"""A step's sampling: which rows of the logits each request samples from, with what generator
and grammar mask, and what the draws give it. A request samples `num_samples` tokens from its
last row (n > 1 draws its forks' first tokens there); a request with draft tokens samples at its
last real token and at each draft, each row as if the drafts before it were its tokens, and keeps
the run that spec_decode.verify finds. The per-request state that outlives a step lives here too:
seeded requests' generators, the penalty counts, and the last step's draws on the device (the
inputs of requests running ahead under async scheduling)."""

from __future__ import annotations

import numpy as np
import torch

from pageserve.runtime.request import child_id
from pageserve.runtime.scheduler import SchedulerOutput
from pageserve.runtime.spec_decode import verify
from pageserve.sampling.penalties import TokenCounts
from pageserve.sampling.sampler import SampleRow, SamplingMetadata, sample


def fill_grammar_rows(bitmask: np.ndarray, row: int, matcher, drafts: list[int]) -> None:
    """Rows row.. of a packed bitmask from a grammar matcher: one per draft and one after it, the
    matcher advanced through the drafts and rolled back (they passed it when proposed)."""
    for j, token in enumerate(drafts):
        matcher.fill_bitmask(bitmask, row + j)
        matcher.advance(token)
    matcher.fill_bitmask(bitmask, row + len(drafts))
    if drafts:
        matcher.rollback(len(drafts))


class StepSampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int, kernels, dev):
        """kernels: the backend's argmax and grammar-mask kernels (Kernels); dev: the device's
        copies to the host (runtime/device.py)."""
        self.vocab_size, self.device, self.kernels, self.dev = vocab_size, device, kernels, dev
        # the last step's draws and whose they are, row by row (request or n > 1 sequence ids)
        self._last: tuple[torch.Tensor, list[str]] | None = None
        self.generator = torch.Generator(device=device)  # unseeded requests' draws
        self.generator.manual_seed(seed)
        self.seeded: dict[str, torch.Generator] = {}  # per-request generators of seeded requests
        self.counts = TokenCounts(vocab_size, device)  # for penalties

    def release(self, finished: list[str], preempted: list[str]) -> None:
        for rid in finished:
            self.seeded.pop(rid, None)
            self.counts.release(rid)
        for rid in preempted:  # rebuilt from its tokens when it runs again, so that rows
            self.counts.release(rid)  # never outnumber the running sequences (its seed stays)

    def sample(self, out: SchedulerOutput, plain: torch.Tensor | None, at_drafts: torch.Tensor | None,
               result) -> None:
        """Fill result (a StepResult) from the logits of the requests that sample without drafts
        (`plain`: one row each, in order) and of those with drafts (`at_drafts`: 1 + drafts rows
        each, in order)."""
        plain_reqs = [r for r in out.requests if r.sample and not r.draft_tokens]
        spec, rewind = [r for r in out.requests if r.draft_tokens], {}
        if at_drafts is None and all(r.num_samples == 1 and r.matcher is None and r.sampling_params.plain_greedy
                                     for r in plain_reqs):
            # an argmax and nothing else, one row each (most greedy batches): no rows or metadata
            token_ids = self.kernels.argmax(plain)
            self._last = (token_ids, [r.request_id for r in plain_reqs])
            result.pending = self.dev.download(token_ids)
            return
        rows, own, constrained = [], {}, []  # SampleRows; row -> seeded generator; grammar rows
        simple = all(r.num_samples == 1 and r.matcher is None and r.sampling_params.seed is None for r in plain_reqs)
        if simple:  # one row each, no generator or grammar of its own (most batches): the loop's rows
            rows = [SampleRow(r.request_id, r.sampling_params, r.request_tokens, r.num_prompt_tokens, r.eos_token_ids)
                    for r in plain_reqs]
        for r in () if simple else plain_reqs:
            for i in range(r.num_samples):
                if r.matcher is not None:
                    constrained.append((len(rows), r.matcher, ()))
                rid = r.request_id if r.num_samples == 1 else child_id(r.request_id, i)
                p = r.sampling_params
                if p.seed is not None and not p.greedy:
                    own[len(rows)] = self._generator(rid, p.seed + i)
                rows.append(SampleRow(rid, p, r.request_tokens, r.num_prompt_tokens, r.eos_token_ids))
        num_plain = len(rows)
        for r in spec:
            p = r.sampling_params
            if r.matcher is not None:
                constrained.append((len(rows), r.matcher, r.draft_tokens))
            gen = self._generator(r.request_id, p.seed) if p.seed is not None and not p.greedy else None
            if gen is not None:
                rewind[r.request_id] = (gen, gen.get_state())
            for j in range(len(r.draft_tokens) + 1):
                if gen is not None:
                    own[len(rows)] = gen
                rows.append(SampleRow(r.request_id, p, r.request_tokens + r.draft_tokens[:j],
                                      r.num_prompt_tokens, r.eos_token_ids))
        parts = []
        if plain is not None:
            if num_plain > len(plain_reqs):  # n > 1 forks draw several tokens from one row
                plain = plain.repeat_interleave(self.dev.upload([r.num_samples for r in plain_reqs],
                                                                torch.int64, self.device), dim=0)
            parts.append(plain)
        if at_drafts is not None:
            parts.append(at_drafts)
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)
        meta = SamplingMetadata(rows, self.device, self.vocab_size, own, self.counts, self.dev.upload_many)
        if constrained:
            meta.set_bitmask(self._grammar_bitmask(len(rows), constrained), self.kernels.ops.apply_token_bitmask)
        token_ids, logprobs = sample(logits, meta, self.generator, self.kernels.argmax)
        # a request running ahead reads a real token: its NO_TOKEN fails it when the host sees it
        last = token_ids.clamp(min=0) if meta.may_mask_all else token_ids
        self._last = (last, [row.request_id for row in rows[:num_plain]])
        by_row = dict(zip(meta.logprob_rows, logprobs))
        result.logprobs = {rows[i].request_id: by_row[i] for i in meta.logprob_rows if i < num_plain}
        if not spec:  # the host reads the draws when the step is collected (StepResult.resolve)
            result.pending = self.dev.download(token_ids)
            return
        ids = token_ids.tolist()
        result.sampled = ids[:num_plain]
        at = num_plain
        for r in spec:
            run = verify(r.draft_tokens, ids[at:at + len(r.draft_tokens) + 1])
            result.spec_tokens[r.request_id] = run
            if r.sampling_params.logprobs is not None:
                result.spec_logprobs[r.request_id] = [by_row[at + j] for j in range(len(run))]
            if r.request_id in rewind:  # the generator as if it had drawn for the kept tokens only
                gen, state = rewind[r.request_id]
                gen.set_state(state)
                for _ in run:  # one draw a row, as sample() draws them
                    torch.rand((), generator=gen, device=self.device)
            at += len(r.draft_tokens) + 1

    def last_draws(self, request_ids: list[str]) -> tuple[torch.Tensor, list[int] | None]:
        """The last step's draws on the device, and the row of each of these requests (one
        token each) in them: None where they are the last step's rows, in order (a steady
        batch of decodes)."""
        ids, owners = self._last
        if request_ids == owners:
            return ids, None
        where = {rid: i for i, rid in enumerate(owners)}
        return ids, [where[rid] for rid in request_ids]

    def _generator(self, request_id: str, seed: int) -> torch.Generator:
        gen = self.seeded.get(request_id)
        if gen is None:
            gen = self.seeded[request_id] = torch.Generator(device=self.device)
            gen.manual_seed(seed)
        return gen

    def _grammar_bitmask(self, num_rows: int, constrained: list) -> torch.Tensor:
        """[rows, ceil(V / 32)] packed int32: every bit set for free rows, each constrained
        row filled by its grammar matcher (in CPU memory, then moved once). `constrained`:
        (first row, matcher, drafts): a request with drafts fills one row per draft and one
        after, its matcher advanced through them and rolled back (they passed it when proposed)."""
        words = -(-self.vocab_size // 32)
        mask = torch.full((num_rows, words), -1, dtype=torch.int32)
        view = mask.numpy()
        for row, matcher, drafts in constrained:
            fill_grammar_rows(view, row, matcher, drafts)
        return mask.to(self.device, non_blocking=True)
