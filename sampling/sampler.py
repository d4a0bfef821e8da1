"""Batched sampling: greedy, temperature, top-k and top-p in a few whole-batch tensor ops."""

from __future__ import annotations

import torch

from sampling.params import SamplingParams


class SamplingMetadata:
    """Per-step tensors describing the batch's sampling parameters, built once per step."""

    __slots__ = ("all_greedy", "greedy", "temperature", "top_k", "top_p", "need_sort", "generators")

    def __init__(self, params: list[SamplingParams], device: torch.device, vocab_size: int,
                 generators: dict[int, torch.Generator] | None = None):
        self.all_greedy = all(p.greedy for p in params)
        self.generators = generators or {}  # row -> the request's own seeded generator
        if self.all_greedy:
            return
        self.greedy = torch.tensor([p.greedy for p in params], device=device)
        # greedy rows keep temperature 1 so the division stays finite; their argmax is used
        self.temperature = torch.tensor([p.temperature or 1.0 for p in params],
                                        dtype=torch.float32, device=device)
        self.top_k = torch.tensor([min(p.top_k, vocab_size) for p in params], device=device)
        self.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        self.need_sort = any(p.top_k > 0 or p.top_p < 1.0 for p in params if not p.greedy)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and top-p nucleus, in one sort."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # drop a token when the tokens ranked above it already cover top_p
    above = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(above > top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)


def sample(logits: torch.Tensor, meta: SamplingMetadata, generator: torch.Generator | None) -> torch.Tensor:
    """logits: [B, V] float32. Returns [B] token ids."""
    greedy_ids = logits.argmax(dim=-1)
    if meta.all_greedy:
        return greedy_ids
    logits = logits / meta.temperature[:, None]
    if meta.need_sort:
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    probs = logits.softmax(dim=-1)
    # Gumbel-style race: argmax of p / E with E ~ Exp(1) draws from p
    noise = torch.empty_like(probs).exponential_(generator=generator)
    for row, own in meta.generators.items():
        # a seeded request draws only from its own generator: its text does not depend on
        # what else is in the batch
        noise[row].exponential_(generator=own)
    random_ids = (probs / noise).argmax(dim=-1)
    return torch.where(meta.greedy, greedy_ids, random_ids)
