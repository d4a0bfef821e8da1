"""Batched sampling: every logits processor works on the whole batch in a few tensor ops.

Order, as vLLM applies them: allowed tokens, logit bias, the min_tokens and bad_words masks,
penalties (all of which also change greedy picks), then temperature, min-p, top-k and top-p, then one draw per row by
inverse CDF. Log-probabilities are those of the model's own distribution (before any
processor)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from pageserve.sampling.logprobs import TokenLogprobs
from pageserve.sampling.penalties import TokenCounts, apply_penalties
from pageserve.sampling.params import SamplingParams


@dataclass(slots=True)
class SampleRow:
    """What the sampler needs of one request that samples this step."""
    request_id: str
    params: SamplingParams
    token_ids: list[int]  # prompt then output so far (for penalties and min_tokens); read only
    num_prompt_tokens: int
    eos_token_ids: tuple[int, ...]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class SamplingMetadata:
    """Per-step tensors describing the batch's sampling parameters, built once per step."""

    def __init__(self, rows: list[SampleRow], device: torch.device, vocab_size: int,
                 generators: dict[int, torch.Generator] | None = None,
                 counts: TokenCounts | None = None, upload_many: Callable | None = None):
        """upload_many([(values, dtype), ...], device): host lists to the device, all in one copy
        (on a GPU without waiting for the step in flight: runtime/device.py); torch.tensor each
        by default."""
        params = [r.params for r in rows]
        self.generators = generators or {}  # row -> the request's own seeded generator
        self.bitmask = None  # packed int32 [B, ceil(V / 32)] of allowed tokens (structured output)
        self.apply_bitmask = None
        self.bias = self.banned = self.penalty_rows = self.allowed = None
        if all(p.plain_greedy for p in params):  # an argmax and nothing else (most greedy batches)
            self.all_greedy = self.any_greedy = True
            self.logprob_rows, self.max_logprobs, self.num_logprobs = [], 0, []
            return
        self.all_greedy = all(p.greedy for p in params)
        self.any_greedy = any(p.greedy for p in params)
        up: list[tuple[str, list, torch.dtype]] = []  # (attribute, host values, dtype), uploaded together
        if not self.all_greedy:  # the random-sampling tensors: a greedy step needs none
            truncated = [not p.greedy and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0) for p in params]
            # greedy rows keep temperature 1 so the division stays finite; their argmax is used
            up += [("greedy", [p.greedy for p in params], torch.bool),
                   ("temperature", [p.temperature or 1.0 for p in params], torch.float32),
                   ("top_k", [min(p.top_k, vocab_size) for p in params], torch.int64),
                   ("top_p", [p.top_p for p in params], torch.float32),
                   ("min_p", [p.min_p for p in params], torch.float32),
                   ("truncated", truncated, torch.bool)]
            sampled = [p for p in params if not p.greedy]
            self.need_sort = any(p.top_k > 0 or p.top_p < 1.0 for p in sampled)
            self.need_min_p = any(p.min_p > 0 for p in sampled)
            self.any_truncated = any(truncated)
            cut, maybe_full = sync_free_rows(params, truncated, vocab_size)
            self.bounded_on_host = len(cut) + len(maybe_full) == len(params)  # no row left to the data
            self.cut_rows = self.maybe_full_rows = None  # off CUDA, a draw forced to go sync-free finds them
            if device.type == "cuda" and self.any_truncated:  # for a draw without a sync; in the step's one copy
                up += [("cut_rows", cut, torch.int64), ("maybe_full_rows", maybe_full, torch.int64)]

        # (row, token, value) of the logit bias and (row, token) of the tokens min_tokens or
        # bad_words hold back, from arrays each request made once
        bias = [(i, (np.frombuffer(p.bias_tokens, np.int64), np.frombuffer(p.bias_values, np.float32)))
                for i, p in enumerate(params) if p.logit_bias]
        banned = [(i, _banned(r)) for i, r in enumerate(rows)
                  if r.num_output_tokens < r.params.min_tokens or r.params.bad_words_token_ids]
        banned = [(i, tokens) for i, tokens in banned if len(tokens)]
        allowed = [(i, np.frombuffer(p.allowed_tokens, np.int64)) for i, p in enumerate(params) if p.allowed_tokens]
        if bias:
            up += [("bias_rows", _repeat_rows([(i, a[0]) for i, a in bias]), torch.int64),
                   ("bias_tokens", np.concatenate([a[0] for _, a in bias]), torch.int64),
                   ("bias_values", np.concatenate([a[1] for _, a in bias]), torch.float32)]
        if banned:
            up += [("banned_rows", _repeat_rows(banned), torch.int64),
                   ("banned_tokens", np.concatenate([tokens for _, tokens in banned]), torch.int64)]
        if allowed:  # the rows, and (index among them, token) of what each may sample
            up += [("allowed_rows", [i for i, _ in allowed], torch.int64),
                   ("allowed_at", _repeat_rows([(j, a) for j, (_, a) in enumerate(allowed)]), torch.int64),
                   ("allowed_tokens", np.concatenate([a for _, a in allowed]), torch.int64)]

        pen = [i for i, p in enumerate(params) if p.has_penalties]
        if pen:
            assert counts is not None
            self.counts = counts
            up += [("penalty_rows", pen, torch.int64),
                   ("count_rows", [counts.row(rows[i].request_id, rows[i].token_ids, rows[i].num_prompt_tokens)
                                   for i in pen], torch.int64),
                   ("presence", [params[i].presence_penalty for i in pen], torch.float32),
                   ("frequency", [params[i].frequency_penalty for i in pen], torch.float32),
                   ("repetition", [params[i].repetition_penalty for i in pen], torch.float32)]
        if up:
            tensors = (upload_many or _upload_many)([(values, dtype) for _, values, dtype in up], device)
            for (name, _, _), tensor in zip(up, tensors):
                setattr(self, name, tensor)
        if bias:
            self.bias = (self.bias_rows, self.bias_tokens, self.bias_values)
        if banned:
            self.banned = (self.banned_rows, self.banned_tokens)
        if allowed:
            self.allowed = (self.allowed_rows, self.allowed_at, self.allowed_tokens)

        want = [(i, p.logprobs) for i, p in enumerate(params) if p.logprobs is not None]
        self.logprob_rows = [i for i, _ in want]
        self.max_logprobs = max((k for _, k in want), default=0)
        self.num_logprobs = [k for _, k in want]

    @property
    def may_mask_all(self) -> bool:
        """Whether a row's masks may forbid every token (a logit bias or penalty never does)."""
        return self.bitmask is not None or self.allowed is not None or self.banned is not None

    def set_bitmask(self, bitmask: torch.Tensor, apply) -> None:
        """Grammar masks for the batch, applied in one call by `apply(logits, bitmask)` (the
        Triton kernel on CUDA, the torch reference elsewhere)."""
        self.bitmask, self.apply_bitmask = bitmask, apply


def sync_free_rows(params: list[SamplingParams], truncated: list[bool], vocab_size: int) -> tuple[list[int], list[int]]:
    """For draw without a sync: the truncated rows, and the rows whose draw the host cannot
    tell to lie among the candidates (all but those truncated by a top-k within them)."""
    k = min(vocab_size, CANDIDATES)
    cut = [i for i, t in enumerate(truncated) if t]
    maybe_full = [i for i, (t, p) in enumerate(zip(truncated, params))
                  if not (t and (0 < min(p.top_k, vocab_size) <= k or k == vocab_size))]
    return cut, maybe_full


def _banned(row: SampleRow) -> np.ndarray:
    """What the row may not sample next: its stop and EOS tokens while min_tokens holds them
    back, and the tokens its bad words forbid after its output."""
    p, parts = row.params, []
    if row.num_output_tokens < p.min_tokens:
        eos = () if p.ignore_eos else row.eos_token_ids
        parts += [np.frombuffer(p.stop_tokens, np.int64), np.asarray(eos, np.int64)]
    if p.bad_words_token_ids:
        parts.append(np.asarray(p.banned_after(row.token_ids, row.num_prompt_tokens), np.int64))
    return np.concatenate(parts)


def _repeat_rows(rows: list[tuple[int, np.ndarray]]) -> np.ndarray:
    """Each row index as many times as its array has entries."""
    return np.repeat([i for i, _ in rows], [len(a) for _, a in rows])


def _upload_many(items: list[tuple], device: torch.device) -> list[torch.Tensor]:
    return [torch.tensor(values, dtype=dtype, device=device) for values, dtype in items]


# candidates looked at first for truncated rows (top-k, top-p, min-p); a row whose kept tokens
# might reach past them is sampled over the whole vocabulary instead, so results stay exact
CANDIDATES = 128
NO_TOKEN = -1  # a row whose masks leave no token at all (the engine fails its request)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and top-p nucleus, in one sort."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    kth = sorted_logits.gather(1, (torch.where(top_k > 0, top_k.clamp(max=vocab), vocab) - 1)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))  # ties with the k-th stay
    probs = sorted_logits.softmax(dim=-1)
    sorted_logits = sorted_logits.masked_fill(_past_nucleus(probs, top_p), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)


def _past_nucleus(share: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """On rows of shares sorted in descending order: the tokens the ones above already cover
    top_p for (the nucleus is the fewest tokens holding at least top_p, as vLLM and HF keep it).
    A row of top_p 1 keeps every token: its float32 sum may pass 1 before the tail."""
    above = share.cumsum(dim=-1) - share
    past = (above >= top_p[:, None]) & (top_p < 1)[:, None]
    past[:, 0] = False  # the likeliest token stays whatever top_p is (one below float32's least: 0)
    return past


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p x the row's highest probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def _truncate_sorted(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                     norm: torch.Tensor) -> torch.Tensor:
    """min-p, top-k, then top-p on rows of probabilities sorted in descending order (the head
    of the vocabulary): returns the kept (not renormalized) probabilities, zero elsewhere.
    `norm`: the mass of everything min-p and top-k keep over the whole vocabulary, which the
    top-p nucleus is measured against."""
    keep = probs >= kth_value(probs, top_k)
    keep &= probs >= probs[:, :1] * min_p[:, None]
    kept = probs * keep
    return kept.masked_fill(_past_nucleus(kept / norm[:, None], top_p), 0.0)


def kth_value(probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """[B, 1]: each row's top_k-th value (its last where top_k is 0 or past the row) on rows
    sorted in descending order; top-k keeps every token tied with it, as vLLM and HF do (a row
    of top_k up to CANDIDATES is drawn among them: a tie that reaches past them is cut there)."""
    width = probs.shape[-1]
    return probs.gather(1, (torch.where(top_k > 0, top_k.clamp(max=width), width) - 1)[:, None])


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row from unnormalized non-negative weights, with one uniform per row."""
    cdf = weights.cumsum(dim=-1)
    target = (u * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=weights.shape[-1] - 1)


def draw(logits: torch.Tensor, meta: SamplingMetadata, u: torch.Tensor, sync_free: bool | None = None) -> torch.Tensor:
    """Sample each row of temperature-scaled logits after min-p, top-k and top-p.

    A truncated row is sampled among its CANDIDATES most likely tokens when those provably
    hold every token the filters keep (top-k within them, the min-p threshold above the last
    of them, or their mass past top-p); any other row over the whole vocabulary (sorting it
    when truncated). Which way a row goes depends on that row alone, so a seeded row draws
    the same token whatever else is in the batch. Both by inverse CDF: one uniform a row.

    sync_free: the host reads nothing back (a sync would stall the step queued behind this
    one): every truncated row is drawn among its candidates, every row the host cannot tell to
    stay there over the whole vocabulary, and each row keeps the draw its own data chooses, the
    same token as the other way. The default on a GPU where that costs nothing more: no row is
    truncated but by a top-k within the candidates (a top-p or min-p row would sort the whole
    vocabulary every step, likely dearer than the sync)."""
    if sync_free is None:
        sync_free = logits.is_cuda and meta.bounded_on_host
    if sync_free and meta.any_truncated and meta.cut_rows is None:  # forced (tests): the lists now
        cut = meta.truncated.nonzero()[:, 0]
        k = min(logits.shape[-1], CANDIDATES)
        sure = meta.truncated & (((meta.top_k > 0) & (meta.top_k <= k)) | (k == logits.shape[-1]))
        meta.cut_rows, meta.maybe_full_rows = cut, (~sure).nonzero()[:, 0]
    vocab = logits.shape[-1]
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    full = ~meta.truncated
    if meta.any_truncated:
        probs = logits.softmax(dim=-1)
        k = min(vocab, CANDIDATES)
        cand, cand_ids = probs.topk(k, dim=-1)
        threshold = cand[:, 0] * meta.min_p
        by_top_k = (meta.top_k > 0) & (meta.top_k <= k)
        by_min_p = (meta.min_p > 0) & (cand[:, -1] < threshold)
        by_top_p = (meta.top_p < 1) & (cand.sum(dim=-1) > meta.top_p) & (meta.top_k <= k)
        whole = torch.full_like(meta.truncated, k == vocab)
        exact = meta.truncated & (by_top_k | by_min_p | by_top_p | whole)
        rows = meta.cut_rows if sync_free else exact.nonzero()[:, 0]
        if rows.numel():
            c, t, p, m = cand[rows], meta.top_k[rows], meta.top_p[rows], meta.min_p[rows]
            # what min-p and top-k keep: inside the candidates when they bound the row, else
            # (top-p alone bounds it) over the whole vocabulary
            head = (c >= kth_value(c, t)) & (c >= threshold[rows, None])
            norm = (c * head).sum(dim=-1)
            # rows bounded by top-p alone: min-p keeps tokens past the candidates as well
            loose = (~(by_top_k | by_min_p | whole))[rows]
            wide = loose & (m > 0)
            if sync_free:
                if meta.need_min_p:  # else no row is wide
                    kept_mass = (probs * (probs >= threshold[:, None])).sum(dim=-1)
                    norm = torch.where(wide, kept_mass[rows], norm)
            elif wide.any():
                w = rows[wide]
                norm[wide] = (probs[w] * (probs[w] >= threshold[w, None])).sum(dim=-1)
            norm = torch.where(loose & (m == 0), torch.ones_like(norm), norm)
            kept = _truncate_sorted(c, t, p, m, norm)
            out[rows] = cand_ids[rows].gather(1, inverse_cdf(kept, u[rows])[:, None])[:, 0]
        full = ~exact
    if not meta.any_truncated:
        rows = slice(None)  # every row, as the host knows
    else:
        rows = meta.maybe_full_rows if sync_free else full.nonzero()[:, 0]
        if rows.numel() == logits.shape[0]:  # every row: a view, not a copy (12 MB at 64 rows)
            rows = slice(None)
    if isinstance(rows, slice) or rows.numel():
        sub = logits[rows]
        if meta.need_min_p:
            sub = apply_min_p(sub, meta.min_p[rows])
        if meta.need_sort:
            sub = apply_top_k_top_p(sub, meta.top_k[rows], meta.top_p[rows])
        drawn = inverse_cdf(sub.softmax(dim=-1), u[rows])
        out[rows] = torch.where(full[rows], drawn, out[rows]) if sync_free and meta.any_truncated else drawn
    return out


def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Grammar masks, allowed tokens, bias, the min_tokens and bad_words masks and penalties:
    [B, V] float32 in, a new tensor out
    (the raw logits stay as they are, for the logprobs)."""
    if meta.bias is None and meta.banned is None and meta.penalty_rows is None and meta.bitmask is None \
            and meta.allowed is None:
        return logits
    logits = logits.clone()
    if meta.bitmask is not None:
        meta.apply_bitmask(logits, meta.bitmask)
    if meta.allowed is not None:
        rows, at, tokens = meta.allowed
        keep = torch.zeros(len(rows), logits.shape[-1], dtype=torch.bool, device=logits.device)
        keep[at, tokens] = True
        logits[rows] = logits[rows].masked_fill(~keep, float("-inf"))
    if meta.bias is not None:
        logits.index_put_(meta.bias[:2], meta.bias[2], accumulate=True)
    if meta.banned is not None:
        logits.index_put_(meta.banned, logits.new_full((), float("-inf")))
    if meta.penalty_rows is not None:
        apply_penalties(logits, meta.penalty_rows, meta.count_rows, meta.counts, meta.presence,
                        meta.frequency, meta.repetition)
    return logits


def sample(logits: torch.Tensor, meta: SamplingMetadata, generator: torch.Generator | None,
           argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, list[TokenLogprobs]]:
    """logits: [B, V] float32 from the model. Returns [B] token ids (NO_TOKEN where the masks
    forbid every token) and, for the rows that asked for them, their log-probabilities.
    argmax: the backend's (Kernels.argmax), else torch's."""
    raw = logits
    logits = process_logits(logits, meta)
    ids = (argmax(logits) if argmax is not None else logits.argmax(dim=-1)) if meta.any_greedy else None
    if not meta.all_greedy:
        u = torch.rand(logits.shape[0], generator=generator, device=logits.device)
        for row, own in meta.generators.items():
            # a seeded request draws only from its own generator: its text does not depend on
            # what else is in the batch
            u[row] = torch.rand((), generator=own, device=logits.device)
        drawn = draw(logits / meta.temperature[:, None], meta, u)
        ids = drawn if ids is None else torch.where(meta.greedy, ids, drawn)
    if meta.penalty_rows is not None:
        meta.counts.add(meta.count_rows, ids[meta.penalty_rows])
    logprobs = token_logprobs(raw, meta, ids) if meta.logprob_rows else []
    if meta.may_mask_all:  # allowed tokens, bad words, min_tokens and a grammar may forbid every token
        ids = torch.where(torch.isneginf(logits).all(dim=-1), NO_TOKEN, ids)
    return ids, logprobs


def token_logprobs(raw: torch.Tensor, meta: SamplingMetadata, ids: torch.Tensor) -> list[TokenLogprobs]:
    rows = meta.logprob_rows
    return topk_logprobs(raw[rows], ids[rows], meta.num_logprobs, meta.max_logprobs)


def topk_logprobs(logits: torch.Tensor, targets: torch.Tensor, ks: list[int], max_k: int) -> list[TokenLogprobs]:
    """log_softmax of each row; the target token's log-probability and rank, and the top k."""
    lp = logits.float().log_softmax(dim=-1)
    target_lp = lp.gather(1, targets[:, None])
    ranks = (lp > target_lp).sum(dim=-1) + 1
    top_lp, top_ids = lp.topk(max_k, dim=-1) if max_k else (lp[:, :0], targets[:, None][:, :0])
    target_lp, ranks, targets = target_lp[:, 0].tolist(), ranks.tolist(), targets.tolist()
    top_lp, top_ids = top_lp.cpu().numpy(), top_ids.to(torch.int32).cpu().numpy()
    return [TokenLogprobs(targets[i], target_lp[i], ranks[i], top_ids[i, :k].tobytes(), top_lp[i, :k].tobytes())
            for i, k in enumerate(ks)]
