"""The engine's side of structured output and thinking budgets: a request's grammar compiles in
the compiler's process while the request waits (WAITING_FOR_GRAMMAR, which the scheduler passes
over); then the request gets one Matcher, which every sampled token advances. The runner fills
the token bitmask from the matchers (runtime/step_sampler.py)."""

from __future__ import annotations

import concurrent.futures
import logging

from pageserve.grammar.compiler import CompilerBusy, GrammarCompiler
from pageserve.grammar.matcher import Matcher, reasoning_end_position
from pageserve.runtime.input_processor import InvalidRequest
from pageserve.runtime.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class StructuredOutputs:
    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self.waiting: dict[str, Request] = {}  # request id -> request whose grammar is compiling

    def add(self, req: Request, grammar: str | None, owner: str = "") -> None:
        """A new request: its grammar (a regex, None for none) is sent to be compiled in
        `owner`'s turn, or its thinking budget alone gets a matcher."""
        if grammar is not None:
            req.grammar = self.compiler.submit(grammar, owner)
            req.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.waiting[req.request_id] = req
        elif req.sampling_params.thinking_budget is not None:
            req.matcher = matcher(req, None)

    def resolve(self) -> list[tuple[str, Exception]]:
        """Requests whose grammar has compiled may be admitted (WAITING). Returns (output id,
        error) for each grammar that failed: an InvalidRequest naming the request field it came
        from, or CompilerBusy."""
        failed = []
        for rid, req in list(self.waiting.items()):
            if req.status != RequestStatus.WAITING_FOR_GRAMMAR:  # aborted meanwhile
                del self.waiting[rid]
            elif req.grammar.done():
                del self.waiting[rid]
                try:
                    index = req.grammar.result()
                except CompilerBusy as e:  # not the request's fault: a 503, to be sent again
                    failed.append((req.output_id, e))
                    continue
                except Exception as e:  # noqa: BLE001 - reported to the request's owner
                    failed.append((req.output_id, InvalidRequest(
                        str(e), req.sampling_params.structured_outputs.source or "structured_outputs")))
                    continue
                req.matcher = matcher(req, index)
                req.grammar = None
                req.status = RequestStatus.WAITING
        return failed

    def wait(self, timeout: float) -> None:
        """Until one waiting grammar is done (nothing else to run: no busy loop)."""
        concurrent.futures.wait([r.grammar for r in self.waiting.values()], timeout=timeout,
                                return_when=concurrent.futures.FIRST_COMPLETED)


def matcher(req: Request, index) -> Matcher:
    """The request's grammar (`index`, None for none) and thinking budget, as one matcher: a
    budget's end marker is where the grammar starts too."""
    params = req.sampling_params
    stop_ids = tuple(dict.fromkeys((*req.eos_token_ids, *params.stop_token_ids)))
    spec, budget = params.structured_outputs, params.thinking_budget
    if budget is not None:
        return Matcher(index, stop_ids, reasoning_end=budget.end, reasoning_start=budget.start, budget=budget.tokens)
    return Matcher(index, stop_ids, reasoning_end=spec.reasoning_end, reasoning_start=spec.reasoning_start)


def advance(req: Request, token: int) -> RequestStatus | None:
    """Feed the appended token to the request's matcher. While the grammar waits for the end of
    reasoning, the token is only compared with the end marker: the grammar governs from the next
    token once the output ends with it (the runner masks only active matchers). Returns
    FINISHED_STOPPED when the grammar ends the request."""
    m = req.matcher
    if m.opening:  # the output's first token: the thinking's opener, or the grammar's first
        m.opening = False
        if token == m.reasoning_start:
            return None
        m.start = 0
    elif m.start is None:
        m.think(token)
        if m.ends_reasoning(req.token_ids, req.num_prompt_tokens):
            m.start = req.num_output_tokens
        return None
    if m.guide is None:  # a thinking budget alone: nothing to govern after the thinking
        return None
    if not m.advance(token):
        logger.error("request %s sampled token %d that its grammar does not allow", req.request_id, token)
        return RequestStatus.FINISHED_STOPPED
    if m.is_terminated():  # the grammar is complete: nothing more to write
        return RequestStatus.FINISHED_STOPPED
    return None


def check_matcher(req: Request) -> None:
    """Where a request's grammar starts follows from its tokens alone."""
    m = req.matcher
    if m is not None and m.reasoning_end is not None:
        out = req.output_token_ids
        if m.reasoning_start is not None and out[:1] != [m.reasoning_start]:
            assert m.start == (0 if out else None) and m.opening == (not out), req
        else:
            assert m.start == reasoning_end_position(out, m.reasoning_end), req
