"""Steps that no scheduler built, which the runner executes as it executes real ones: the
worst cases that the memory profile measures, and the smallest step of each kernel variant,
which warm-up runs so that nothing compiles while serving."""

from __future__ import annotations

import dataclasses

from pageserve.runtime.scheduler import ScheduledRequest, SchedulerOutput
from pageserve.sampling.params import MAX_LOGPROBS, SamplingParams
from pageserve.sampling.sampler import CANDIDATES

# every sampling path at once: logit bias, the min_tokens ban, penalties, seeded random
# sampling through the full-vocabulary top-k/top-p sort (top-k past the candidates looked at
# first, so every row takes it), and the most logprobs and prompt logprobs a request may ask for
WORST_CASE_PARAMS = SamplingParams(
    temperature=0.7, top_p=0.95, top_k=CANDIDATES + 1, presence_penalty=0.5,
    frequency_penalty=0.5, repetition_penalty=1.2, logit_bias={1: 1.0}, min_tokens=1,
    logprobs=MAX_LOGPROBS, prompt_logprobs=MAX_LOGPROBS, seed=0)
# one such row with min-p puts every row through min-p too (a row with min-p alone might be
# sampled among the candidates, depending on its logits)
WORST_CASE_MIN_P = dataclasses.replace(WORST_CASE_PARAMS, min_p=1e-6)
GREEDY_PARAMS = SamplingParams(temperature=0.0)


class AnyToken:
    """A grammar matcher that allows every token: its row of the bitmask is still built and
    the mask still applied, as for a real grammar."""

    def fill_bitmask(self, bitmask, row: int) -> None:
        bitmask[row] = -1


def build_step(shapes: list[tuple[int, int, int]], params: list[SamplingParams], block_size: int,
               num_blocks: int, vocab_size: int, eos_token_ids: tuple[int, ...], name: str,
               write: bool = True, matcher: object = None) -> SchedulerOutput:
    """One step from (tokens this step, context length after it, samples) and sampling params
    per request, each request's whole context a prompt whose last token ends this step (so it
    samples). Block tables cycle over the first `num_blocks` blocks; write=False gives every
    token slot -1, which the Triton kernels write nowhere."""
    out = SchedulerOutput()
    for i, ((n, ctx, samples), sp) in enumerate(zip(shapes, params, strict=True)):
        start = ctx - n
        blocks = [b % num_blocks for b in range(-(-ctx // block_size))]
        tokens = [t % vocab_size for t in range(ctx)]
        out.requests.append(ScheduledRequest(
            request_id=f"{name}-{i}", token_ids=tokens[start:], start_pos=start, block_ids_start=0,
            new_block_ids=blocks,
            sample=True, sampling_params=sp, num_samples=samples, num_prompt_tokens=ctx,
            matcher=matcher, request_tokens=tokens, eos_token_ids=eos_token_ids))
        out.slot_mapping.extend(blocks[p // block_size] * block_size + p % block_size if write else -1
                                for p in range(start, ctx))
        out.num_tokens += n
    return out


def worst_case_steps(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                     split_decode: tuple[int, int] | None, block_size: int, num_blocks: int,
                     vocab_size: int, eos_token_ids: tuple[int, ...]) -> list[SchedulerOutput]:
    """The largest step of each kind the scheduler can build, every sampling path on:
    1. the whole token budget over the most requests, drawing max_num_seqs samples (an n > 1
       request draws several from its one row), each row through a grammar bitmask;
    2. the budget as one prompt chunk, for the most prompt-logprob rows;
    3. `split_decode` (requests, context), the attention's largest split-KV partition buffers.
    Their requests hold penalty rows and seeded generators until released as finished."""
    tokens = max_num_batched_tokens
    num_reqs = min(max_num_seqs, tokens)
    shares = [min(tokens // num_reqs + (i < tokens % num_reqs), max_model_len) for i in range(num_reqs)]
    samples = [max_num_seqs - num_reqs + 1] + [1] * (num_reqs - 1)
    common = dict(block_size=block_size, num_blocks=num_blocks, vocab_size=vocab_size,
                  eos_token_ids=eos_token_ids)
    params = [WORST_CASE_PARAMS] * num_reqs
    if num_reqs > 1:
        params[-1] = WORST_CASE_MIN_P
    steps = [build_step([(n, n, s) for n, s in zip(shares, samples)], params, name="profile-batch",
                        matcher=AnyToken(), **common)]
    chunk = min(tokens, max_model_len)
    steps.append(build_step([(chunk, chunk, 1)], [WORST_CASE_PARAMS], name="profile-prompt", **common))
    if split_decode is not None:
        num_seqs, ctx = split_decode
        steps.append(build_step([(1, ctx, 1)] * num_seqs, [WORST_CASE_PARAMS] * num_seqs,
                                name="profile-split", **common))
    return steps


def warm_up_steps(decode_shapes: list[tuple[int, int]], block_size: int, vocab_size: int,
                  eos_token_ids: tuple[int, ...]) -> list[SchedulerOutput]:
    """The smallest step of each kernel variant: a mixed step (a two-token prompt chunk
    beside a one-token one) sampling through a grammar bitmask, then a decode-only step for
    each (requests, context) the attention backend names. Nothing is written to the KV cache
    and every block table points at block 0: variants depend on shapes, not data."""
    common = dict(block_size=block_size, num_blocks=1, vocab_size=vocab_size,
                  eos_token_ids=eos_token_ids, write=False)
    steps = [build_step([(2, 2, 1), (1, 3, 1)], [GREEDY_PARAMS] * 2, name="warm-up-mixed",
                        matcher=AnyToken(), **common)]
    for i, (num_seqs, ctx) in enumerate(decode_shapes):
        steps.append(build_step([(1, ctx, 1)] * num_seqs, [GREEDY_PARAMS] * num_seqs,
                                name=f"warm-up-decode{i}", **common))
    return steps
