"""From sampled tokens to what the caller sees: stop checks, incremental text, log-probs, and
one RequestOutput per request (or per sequence of an n > 1 request) as its output kind asks."""

from __future__ import annotations

from pageserve.runtime import pooling
from pageserve.runtime.input_processor import InvalidRequest
from pageserve.runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pageserve.runtime.request import Request, RequestStatus
from pageserve.sampling.params import RequestOutputKind

_FINAL_ONLY, _DELTA = RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA  # read at every token


def detokenize_and_check_stop(req: Request, token: int, max_model_len: int) -> RequestStatus | None:
    """Feed the request's new token to its detokenizer (unless it is a stop token whose text is
    left out) and say whether the request stops: on a stop token, then on a stop string in the
    decoded text, then at the length limit. EOS and stop tokens cannot come before min_tokens
    (the sampler masks them), so they need no check here."""
    params = req.sampling_params
    status = None
    if not params.ignore_eos and token in req.eos_token_ids:
        status = RequestStatus.FINISHED_STOPPED
    elif token in params.stop_token_ids:
        req.stop_reason = token
        status = RequestStatus.FINISHED_STOPPED
    num_tokens = len(req.token_ids)
    num_output = num_tokens - req.num_prompt_tokens
    if status is None or params.include_stop_str_in_output:
        stop_str = req.detokenizer.add_token(token, num_output >= params.min_tokens)
        if status is None and stop_str is not None:
            req.stop_reason = stop_str
            status = RequestStatus.FINISHED_STOPPED
    if status is None and (num_output >= req.max_tokens or num_tokens >= max_model_len):
        status = RequestStatus.FINISHED_LENGTH
    return status


def no_token_error(req: Request) -> InvalidRequest:
    """The error of a request whose masks forbade every token at its next one (sampled as NO_TOKEN)."""
    p = req.sampling_params
    masks = [name for name, on in (("allowed_token_ids", p.allowed_token_ids is not None),
                                   ("bad_words", bool(p.bad_words)),
                                   ("min_tokens", req.num_output_tokens < p.min_tokens),
                                   ("response_format", req.matcher is not None)) if on]
    return InvalidRequest(f"{' and '.join(masks) or 'the request'} left no token to write at output token "
                          f"{req.num_output_tokens + 1}: together they forbid every one", masks[0] if masks else None)


def _metrics(req: Request, members: list[Request] | None = None) -> RequestMetrics:
    if not members or len(members) == 1:  # one sequence (most requests, at every streamed step)
        one = members[0] if members else req
        num_output = len(one.token_ids) - one.num_prompt_tokens
        return RequestMetrics(req.arrival_time, req.first_token_time, one.finished_time, req.scheduled_time,
                              req.num_prompt_tokens, num_output, num_output,
                              one.num_cached_tokens, len(req.mm_items), req.encoder_seconds)
    finished = max((m.finished_time for m in members if m.finished_time is not None), default=None)
    return RequestMetrics(req.arrival_time, req.first_token_time, finished, req.scheduled_time,
                          req.num_prompt_tokens, sum(m.num_output_tokens for m in members),
                          max(m.num_output_tokens for m in members),
                          max(m.num_cached_tokens for m in members), len(req.mm_items), req.encoder_seconds)


class OutputProcessor:
    def __init__(self):
        # n > 1 requests: output id -> its sequences, in index order
        self.groups: dict[str, list[Request]] = {}

    def add_group(self, members: list[Request]) -> None:
        self.groups[members[0].output_id] = members

    def members(self, output_id: str) -> list[Request]:
        return self.groups.get(output_id, [])

    def output(self, req: Request, finished: bool) -> RequestOutput | None:
        """What `req` reports after a step in which it got a token (`finished`: it is done)."""
        kind = req.sampling_params.output_kind
        group = self.groups.get(req.output_id)
        all_done = finished and (group is None or all(m.status.finished for m in group))
        if kind is _FINAL_ONLY:
            if not all_done:
                return None
            members = group or [req]
            self.groups.pop(req.output_id, None)
            return RequestOutput(
                request_id=req.output_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                outputs=[self._completion(m, m.status.finished, False) for m in members],
                finished=True, metrics=_metrics(req, members), prompt_logprobs=members[0].prompt_logprobs,
                lora_request=req.lora)
        first = req.num_sent_tokens == 0
        delta = kind is _DELTA
        completion = self._completion(req, finished, delta)
        if all_done:
            self.groups.pop(req.output_id, None)
        # positional, in the fields' order (every streamed token of every request comes here):
        # request_id, prompt, prompt_token_ids, outputs, finished, metrics, embedding, prompt_logprobs, lora_request
        return RequestOutput(req.output_id, req.prompt, req.prompt_token_ids, [completion], all_done,
                             _metrics(req, group), None,
                             req.prompt_logprobs if first or not delta else None, req.lora)

    @staticmethod
    def _completion(req: Request, finished: bool, delta: bool) -> CompletionOutput:
        detok = req.detokenizer
        new_text = detok.take_delta(finished)
        start = req.num_sent_tokens
        tokens = req.token_ids
        req.num_sent_tokens = len(tokens) - req.num_prompt_tokens
        if delta:
            text, ids = new_text, tokens[req.num_prompt_tokens + start:]
            logprobs = req.logprobs[start:] if req.logprobs is not None else None
        else:
            text, ids = detok.text[:detok.sent], req.output_token_ids
            logprobs = req.logprobs[:] if req.logprobs is not None else None  # as they stand now
        return CompletionOutput(req.index, text, ids, req.finish_reason if finished else None,
                                req.stop_reason, logprobs)

    def abort_group(self, output_id: str) -> None:
        self.groups.pop(output_id, None)

    @staticmethod
    def embedding_output(req: Request, pooler: pooling.PoolerConfig) -> RequestOutput:
        embedding = pooling.embedding(req.pooled, req.num_tokens, pooler)
        return RequestOutput(
            request_id=req.output_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            finished=True, embedding=embedding, metrics=_metrics(req), lora_request=req.lora)
