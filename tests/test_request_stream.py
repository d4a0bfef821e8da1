"""A request's stream of outputs in the server (runtime/request_stream.py): streamed (delta)
outputs that wait for a reader behind the engine are merged into one, and nothing is lost or
reordered by it."""

from __future__ import annotations

import asyncio

import pytest

from pageserve.runtime import SamplingParams
from pageserve.runtime.async_engine import AsyncEngine
from pageserve.runtime.request_stream import RequestStream
from pageserve.runtime.engine_args import EngineArgs
from pageserve.runtime.outputs import CompletionOutput, RequestOutput
from pageserve.sampling.params import RequestOutputKind


def _delta(rid: str, text: str, ids: list[int], index: int = 0, finished: bool = False,
           logprobs: list | None = None, prompt_logprobs: list | None = None) -> RequestOutput:
    return RequestOutput(rid, None, [1, 2], [CompletionOutput(index, text, ids, "length" if finished else None,
                                                              None, logprobs)],
                         finished, prompt_logprobs=prompt_logprobs)


class _Engine:
    def abort(self, rid, stream) -> None:
        pass


def _stream(*delta_ids: str) -> RequestStream:
    stream = RequestStream(_Engine())
    for rid in ("a", "b"):
        stream.expect(rid, deltas=rid in delta_ids)
    return stream


async def _read(stream: RequestStream) -> list[RequestOutput]:
    return [out async for out in stream]


@pytest.mark.unit
def test_unread_deltas_of_one_sequence_merge_in_order():
    stream = _stream("a", "b")
    stream.put(_delta("a", "Hel", [1], logprobs=["p1"], prompt_logprobs=[None, "q"]))
    stream.put(_delta("a", "lo", [2], logprobs=["p2"]))
    stream.put(_delta("b", "x", [9]))  # another request: its own item, after a's
    stream.put(_delta("a", "!", [3], logprobs=["p3"]))
    stream.put(_delta("b", "y", [8], finished=True))
    stream.put(_delta("a", "?", [4], logprobs=["p4"], finished=True))  # finished: after b's, not merged
    a, b, a2 = asyncio.run(_read(stream))
    assert (a.request_id, a.outputs[0].text, a.outputs[0].token_ids, a.outputs[0].logprobs) == \
        ("a", "Hello!", [1, 2, 3], ["p1", "p2", "p3"])
    assert a.prompt_logprobs == [None, "q"] and not a.finished
    assert (b.request_id, b.outputs[0].text, b.outputs[0].token_ids, b.finished) == ("b", "xy", [9, 8], True)
    assert (a2.outputs[0].text, a2.outputs[0].token_ids, a2.finished, a2.outputs[0].finish_reason) == \
        ("?", [4], True, "length")


@pytest.mark.unit
def test_other_sequences_and_non_delta_outputs_are_not_merged_and_an_error_still_ends_the_stream():
    stream = _stream("a")
    stream.put(_delta("a", "1", [1], index=0))
    stream.put(_delta("a", "2", [2], index=1))  # n > 1: another sequence
    stream.put(_delta("b", "x", [5]))  # cumulative (not a delta request): never merged
    stream.put(_delta("b", "xy", [5, 6], finished=True))
    stream.put(RuntimeError("the engine failed"))
    stream.put(_delta("a", "3", [3], index=1))  # merged into its sequence's unread piece
    got = []

    async def read():
        with pytest.raises(RuntimeError, match="the engine failed"):
            async for out in stream:
                got.append((out.outputs[0].index, out.outputs[0].text))

    asyncio.run(read())
    assert got == [(0, "1"), (1, "23"), (0, "x"), (0, "xy")]


@pytest.mark.unit
def test_an_output_without_sequences_passes_beside_unread_deltas():
    stream = _stream("a")
    stream.put(_delta("a", "1", [1]))
    stream.put(_delta("a", "2", [2]))
    stream.put(RequestOutput("b", None, [1, 2], [], True))  # an embedding's: no sequences
    stream.put(_delta("a", "3", [3], finished=True))
    outs = asyncio.run(_read(stream))
    assert [(o.request_id, [c.text for c in o.outputs]) for o in outs] == [("a", ["12"]), ("b", []), ("a", ["3"])]


@pytest.mark.engine
def test_a_reader_behind_the_engine_gets_the_whole_text_in_fewer_pieces(tiny_model_dir):
    """A streamed request whose reader waits until the request has finished gets its output in
    one merged piece, equal to what a reader at every step gets in pieces, logprobs included."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2,
                            output_kind=RequestOutputKind.DELTA)

    async def run() -> tuple[list[RequestOutput], list[RequestOutput]]:
        eng = AsyncEngine.build(EngineArgs(model=str(tiny_model_dir), dtype="float32", kv_cache_memory=0.01,
                                           max_model_len=256, swap_space=0))
        eng.start()
        try:
            eager = eng.new_stream()
            eng.add_request(eager, "eager", [5, 6, 7], params)
            pieces = await _read(eager)
            late = eng.new_stream()
            eng.add_request(late, "late", [5, 6, 7], params)
            while "late" in eng._streams:  # the engine finishes it before anything is read
                await asyncio.sleep(0.01)
            return pieces, await _read(late)
        finally:
            await eng.stop()

    pieces, merged = asyncio.run(run())
    assert len(pieces) == 12 and len(merged) == 1 and merged[0].finished
    assert merged[0].outputs[0].token_ids == [t for p in pieces for t in p.outputs[0].token_ids]
    assert merged[0].outputs[0].text == "".join(p.outputs[0].text for p in pieces)
    assert merged[0].outputs[0].finish_reason == "length"
    logprobs = merged[0].outputs[0].logprobs
    assert len(logprobs) == 12 and logprobs == [e for p in pieces for e in p.outputs[0].logprobs]
