"""Token counts for repetition / presence / frequency penalties, kept per request on the device
and updated in place after every step (one scatter for the whole batch), instead of being
rebuilt from the token lists each step."""

from __future__ import annotations

import torch


class TokenCounts:
    """Rows of output-token counts and of the tokens seen in prompt or output, one row per
    request that has a penalty. Rows are handed out on first use and returned when the
    request finishes."""

    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 8):
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros(capacity, vocab_size, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(capacity, vocab_size, dtype=torch.bool, device=device)
        self.seen = torch.zeros(capacity, vocab_size, dtype=torch.bool, device=device)
        self.rows: dict[str, int] = {}
        self._free = list(range(capacity - 1, -1, -1))

    def row(self, request_id: str, token_ids: list[int], num_prompt_tokens: int) -> int:
        """The request's row, made from its tokens so far the first time it is asked for."""
        row = self.rows.get(request_id)
        if row is not None:
            return row
        if not self._free:
            self._grow()
        row = self.rows[request_id] = self._free.pop()
        self.counts[row].zero_()
        self.in_prompt[row].zero_()
        prompt_ids, output_ids = token_ids[:num_prompt_tokens], token_ids[num_prompt_tokens:]
        if prompt_ids:
            self.in_prompt[row, torch.tensor(prompt_ids, device=self.device)] = True
        if output_ids:
            ones = torch.ones(len(output_ids), dtype=torch.int32, device=self.device)
            self.counts[row].index_add_(0, torch.tensor(output_ids, device=self.device), ones)
        torch.logical_or(self.in_prompt[row], self.counts[row] > 0, out=self.seen[row])
        return row

    def reserve(self, rows: int) -> None:
        """Room for `rows` requests at once, allocated now (the CUDA memory profile takes the
        rows of the most sequences a step can hold before it measures)."""
        while self.counts.shape[0] < rows:
            self._grow()

    def _grow(self) -> None:
        old = self.counts.shape[0]
        self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
        self.in_prompt = torch.cat([self.in_prompt, torch.zeros_like(self.in_prompt)])
        self.seen = torch.cat([self.seen, torch.zeros_like(self.seen)])
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def add(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """One sampled token per row."""
        self.counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
        self.seen[rows, tokens] = True

    def release(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self._free.append(row)


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, count_rows: torch.Tensor, counts: TokenCounts,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> None:
    """vLLM's (and HF's) definitions, in place on logits[rows]: a token seen in the prompt or
    output has its logit divided by `repetition` when positive, multiplied when negative; then
    `frequency` x its output count and `presence` x (count > 0) are subtracted. Only the seen
    tokens change, so only they are touched: a few hundred per row, not the vocabulary."""
    r, t = counts.seen[count_rows].nonzero(as_tuple=True)
    c = counts.counts[count_rows[r], t].float()
    x = logits[rows[r], t]
    rep = repetition[r]
    x = torch.where(x > 0, x / rep, x * rep) - frequency[r] * c - presence[r] * (c > 0)
    logits.index_put_((rows[r], t), x)
