"""runtime/wire.py: every message between the engine and its workers survives a round trip, and
nothing but those messages decodes (no pickle: nothing from the wire names code to run)."""

import builtins
import dataclasses
import enum
import hashlib
import math
import os
import pickle
import subprocess
import time
import types
from array import array
import typing

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pageserve.runtime import wire
from pageserve.runtime.config import CacheConfig, PreemptionMode, SchedulerConfig
from pageserve.runtime.encoder_cache import EncoderCacheManager
from pageserve.runtime.kv_cache_manager import KVCacheManager
from pageserve.runtime.lora.request import LoRARequest
from pageserve.runtime.model_runner import StepResult
from pageserve.runtime.multimodal import ImageItem
from pageserve.runtime.request import Request
from pageserve.runtime.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from pageserve.runtime.swap_space import SwapSpace
from pageserve.runtime.wire import MaskRow, WireError, decode, encode
from pageserve.sampling.params import RequestOutputKind, SamplingParams, StructuredOutputsParams, ThinkingBudget
from pageserve.sampling.logprobs import TokenLogprobs

pytestmark = pytest.mark.unit


def same(a, b) -> bool:
    """Equal, and of the same types all the way down (tensors by value and dtype; ImageItem,
    which compares by identity, field by field)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(type(k) is type(j) for k, j in zip(a, b)) \
            and all(same(a[k], b[k]) for k in a)
    if dataclasses.is_dataclass(a):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    return a == b


def round_trip(x):
    y = decode(encode(x))
    assert same(x, y), (x, y)
    return y


class FakeMatcher:
    """A grammar matcher as MaskRow.of uses it: fill_bitmask clears the bits of banned tokens."""

    def __init__(self, banned):
        self.banned = banned

    def fill_bitmask(self, bitmask, row):
        for t in self.banned:
            bitmask.view(np.uint32)[row, t // 32] &= ~np.uint32(1 << (t % 32))


def sampling(i: int) -> SamplingParams:
    so = [StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}},
                                  source="response_format", reasoning_end=(7, 8), reasoning_start=6),
          StructuredOutputsParams(regex=r"\d+", source="regex"),
          StructuredOutputsParams(choice=("yes", "no")),
          StructuredOutputsParams(json_object=True),
          StructuredOutputsParams(json='{"type": "string"}'), None][i % 6]
    return SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5,
                          frequency_penalty=-0.5, repetition_penalty=1.2, logit_bias={5: 2.0, 100_000: -100.0},
                          max_tokens=100 + i, min_tokens=2, stop=["\n\n", "END"], stop_token_ids=[2, 3],
                          include_stop_str_in_output=True, ignore_eos=True, skip_special_tokens=False,
                          seed=2 ** 63 - 1 - i, logprobs=5, prompt_logprobs=3,
                          output_kind=RequestOutputKind.DELTA, structured_outputs=so,
                          thinking_budget=[ThinkingBudget(3, (7, 8), 6), ThinkingBudget(0, (9,)), None][i % 3])


def image(seed: int, dtype=torch.float32) -> ImageItem:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(2, 3, 8, 8, generator=g).to(dtype)
    data = {"pixel_values": pixels[1:], "pixel_attention_mask": torch.rand(1, 8, 8, generator=g) > 0.5,
            "grid": (1, 4, 4), "mrope_grid": (1, 2, 2), "image_size": (336, 512)}
    return ImageItem(bytes(range(16)), 3, 9, 8, 8 * 4096, data, torch.tensor([True] * 8 + [False]))


LORA = LoRARequest("sql", 3, "/adapters/sql", base_model_name="tiny")


def step(num_requests: int = 5, tokens: int = 40) -> SchedulerOutput:
    requests = []
    for i in range(num_requests):
        toks = list(range(1000 * i, 1000 * i + tokens))
        requests.append(ScheduledRequest(
            request_id=f"req-{i}", token_ids=toks[-3:], start_pos=tokens - 3, block_ids_start=i,
            new_block_ids=[i, 10 + i, 20 + i],
            sample=i % 2 == 0, sampling_params=sampling(i), pool=i == 4, num_samples=2, num_prompt_tokens=tokens - 5,
            matcher=MaskRow.of(FakeMatcher([1, 31, 40 + i]), 100) if i % 2 else None, request_tokens=toks,
            eos_token_ids=(2, 151_643), mm_items=(image(i), image(i + 1, torch.bfloat16)) if i < 2 else (),
            lora=LORA if i == 1 else None, draft_tokens=[9, 8, 7] if i == 3 else []))
    return SchedulerOutput(requests=requests, slot_mapping=list(range(3 * num_requests)), num_tokens=3 * num_requests,
                           preempted=["old-1", "old-2"], swap_out=[(4, 0), (5, 1)], swap_in=[(2, 6)],
                           finished_ids=["done-1", "done-2#1"], freed_images=[b"\x00" * 16, bytes(range(16))])


def top(pairs: list[tuple[int, float]]) -> tuple[bytes, bytes]:
    """TokenLogprobs' two arrays of (token id, log-probability) pairs."""
    return array("i", [t for t, _ in pairs]).tobytes(), array("f", [lp for _, lp in pairs]).tobytes()


def logprobs(t: int) -> TokenLogprobs:
    return TokenLogprobs(t, -0.25 * t, t % 7 + 1, *top([(t, -0.25 * t), (t + 1, -1.5), (2 ** 31 - 1, float("-inf"))]))


def result() -> StepResult:
    return StepResult(
        sampled=[5, 7, 151_643], logprobs={"req-0": logprobs(5), "req-0#1": logprobs(7)},
        prompt_logprobs={"req-2": (4, [logprobs(1), logprobs(2)])},
        pooled=[torch.randn(16), torch.randn(16).to(torch.bfloat16), torch.randn(4, dtype=torch.float16)],
        encoder_seconds={"req-0": 0.125}, spec_tokens={"req-3": [9, 8, 4]},
        spec_logprobs={"req-3": [logprobs(9), logprobs(8), logprobs(4)]})


CACHE = CacheConfig(block_size=32, num_blocks=1234, enable_prefix_caching=True, num_swap_blocks=64,
                    preemption_mode=PreemptionMode.RECOMPUTE, sliding_window=4096)

# every message runtime/executor.py sends, and every answer runtime/worker.py gives
MESSAGES = [("execute", (step(),)), ("copy_blocks", ([(1, 2), (3, 4)],)), ("allocate_kv_cache", (CACHE,)),
            ("warm_up", (64,)), ("add_lora", (LORA,)), ("remove_lora", (3,)), ("shutdown", ()),
            ("engine_gone", ()), ("ok", result()), ("ok", StepResult()), ("ok", 4096), ("ok", None),
            ("ok", "adapter sql: no adapter_config.json"),
            ("error", "Traceback (most recent call last):\n  ...\nRuntimeError: boom\n")]


@pytest.mark.parametrize("message", MESSAGES, ids=[f"{i}-{m[0]}" for i, m in enumerate(MESSAGES)])
def test_every_message_round_trips(message):
    back = round_trip(message)
    if message[0] == "execute":
        out, = back[1]
        assert out.requests[1].mm_items[1].data["pixel_values"].dtype == torch.bfloat16
        assert out.requests[0].sampling_params.seed == 2 ** 63 - 1
        assert out.requests[1].lora == LORA and out.requests[1].matcher == MaskRow.of(FakeMatcher([1, 31, 41]), 100)
        assert out.requests[0].sampling_params.structured_outputs.reasoning_end == (7, 8)
        back_tensor = out.requests[0].mm_items[0].data["pixel_values"]
        back_tensor += 1  # writable, and its own memory
        assert back_tensor.device.type == "cpu"


def test_default_eq_dataclasses_come_back_equal():
    for x in [CACHE, LORA, sampling(0), sampling(5), logprobs(3), SchedulerOutput(swap_in=[(1, 2)]),
              dataclasses.replace(step(4), requests=[dataclasses.replace(r, mm_items=()) for r in step(4).requests])]:
        assert decode(encode(x)) == x


def test_a_worker_can_grow_the_decoded_step():
    """worker.py extends a request's tokens in place and assigns request_tokens."""
    out = decode(encode(step()))
    out.requests[0].request_tokens.append(5)
    out.requests[0].request_tokens = [1, 2]
    out.requests[0].sampling_params.max_tokens = 7


def test_plain_values_keep_their_types():
    round_trip((1, (2, (3,)), [4, (5,)], ()))
    assert type(decode(encode([(1, 2)]))[0]) is tuple and type(decode(encode(((1, 2),)))) is tuple
    back = round_trip({1: "a", -2: "b", 2 ** 40: "c", "k": {3: 1.0}})
    assert all(type(k) is int for k in list(back)[:3])
    for n in (0, -1, 2 ** 31, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1, 2 ** 64, -2 ** 63, -2 ** 63 - 1, 3 ** 200, -3 ** 200):
        assert round_trip(n) == n
    for f in (0.0, -0.0, 1e-300, float("inf"), float("-inf"), float("nan")):
        round_trip(f)
    round_trip([None, True, False, "", "é漢", b"", b"\xff\x00", 1.5])
    assert decode(encode(np.int64(7))) == 7 and decode(encode(np.float32(0.5))) == 0.5  # as Python numbers
    assert decode(encode([bytearray(b"ab"), memoryview(b"cd")])) == [b"ab", b"cd"]  # msgpack's bin: as bytes
    round_trip([torch.bfloat16, torch.device("cpu"), torch.device("cuda:1")])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
                                   torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool])
def test_tensors_of_every_dtype(dtype):
    x = (torch.randn(3, 5) * 50).to(dtype)
    for t in (x, x[:, 1:4], x.t(), x[0, 0], x[:0], x.reshape(3, 1, 5, 1)):
        y = round_trip(t)
        assert y.is_contiguous() and y.device.type == "cpu"


def test_numpy_arrays_are_writable():
    for a in (np.arange(10, dtype=np.int32), np.ones((3, 4), np.float16)[:, ::2], np.zeros((0, 2), np.uint64),
              np.array([True, False]), np.array(2.5)):
        y = round_trip(a)
        assert y.flags.writeable and y.flags.c_contiguous


def test_mask_row_fills_as_the_executor_did():
    row = MaskRow.of(FakeMatcher([0, 33, 99]), 100)
    assert row.words.dtype == np.int32 and row.words.shape == (1, 4)
    bitmask = np.full((3, 4), -1, dtype=np.int32)
    decode(encode(row)).fill_bitmask(bitmask, 1)
    expect = np.full((4,), -1, dtype=np.int32)
    FakeMatcher([0, 33, 99]).fill_bitmask(expect[None], 0)
    assert (bitmask[1] == expect).all() and (bitmask[[0, 2]] == -1).all()


def test_a_real_scheduler_step_round_trips():
    kv = KVCacheManager(64, 16, enable_prefix_caching=True)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=4096, enable_chunked_prefill=True,
                          max_loras=2)
    sched = Scheduler(cfg, kv, SwapSpace(0), "recompute", EncoderCacheManager(1 << 20))
    for i in range(4):
        sched.add_request(Request(f"r{i}", list(range(50 + i)), sampling(i), 16, (0, 1), lora=LORA if i else None,
                                  mm_items=(image(i),) if i == 2 else ()))
    out = sched.schedule()
    assert len(out.requests) == 4
    for sr in out.requests:  # as runtime/executor.py's _for_workers sends them
        sr.matcher = MaskRow.of(FakeMatcher([3]), 64)
    round_trip(("execute", (out,)))


# --- what the decoder refuses ---

def _forged(tag: bytes, *values, code=wire._O) -> bytes:
    return msgpack.packb([msgpack.ExtType(code, tag), *values])


def test_a_class_not_on_the_list_is_never_imported_or_called(monkeypatch):
    monkeypatch.setattr(os, "system", lambda *a: pytest.fail("os.system called"))
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("Popen called"))
    imported, real_import = [], builtins.__import__

    def watched(data: bytes):
        builtins.__import__ = lambda name, *a, **k: imported.append(name) or real_import(name, *a, **k)
        try:
            return decode(data)
        finally:
            builtins.__import__ = real_import

    for tag in (b"os.system", b"subprocess.Popen", b"posix:system", b"builtins.eval", b"Request", b"ModelConfig",
                b"EngineArgs", b"__main__.Evil", b""):
        for code in (wire._O, wire._E):
            with pytest.raises(WireError, match="unknown type tag"):
                watched(_forged(tag, "touch /tmp/pwned", code=code))
            with pytest.raises(WireError):
                watched(msgpack.packb(["run", [msgpack.ExtType(code, tag), "echo"]]))
    with pytest.raises(WireError):  # a pickle is no message either
        watched(b"cos\nsystem\n(S'touch /tmp/pwned'\ntR.")
    assert imported == []


def test_fields_must_be_the_dataclass_s():
    tag = wire._tag(LoRARequest)
    assert tag.startswith(b"LoRARequest#")
    assert decode(_forged(tag, "a", 1, "/p", None)) == LoRARequest("a", 1, "/p")
    with pytest.raises(WireError, match="LoRARequest of 3 values for 4: lora_name, lora_int_id"):
        decode(_forged(tag, "a", 1, "/p"))
    with pytest.raises(WireError, match="LoRARequest of 5 values"):
        decode(_forged(tag, "a", 1, "/p", None, "extra"))
    # a sender whose LoRARequest has other fields (or the same in another order)
    for names in ("lora_name lora_int_id lora_path base_model_name evil", "lora_int_id lora_name lora_path base_model_name"):
        other = b"LoRARequest#" + hashlib.blake2b(names.encode(), digest_size=4).hexdigest().encode()
        with pytest.raises(WireError, match="LoRARequest whose fields are not this side's"):
            decode(_forged(other, "a", 1, "/p", None, 5))
    with pytest.raises(WireError, match="not this side's"):
        decode(_forged(b"LoRARequest", "a", 1, "/p", None))
    with pytest.raises(WireError, match="unknown type tag"):  # an enum's tag as a dataclass's, and back
        decode(_forged(b"PreemptionMode", "swap"))
    with pytest.raises(WireError, match="unknown type tag"):
        decode(_forged(tag, "a", 1, "/p", None, code=wire._E))
    assert decode(_forged(b"PreemptionMode", "swap", code=wire._E)) is PreemptionMode.SWAP
    with pytest.raises(WireError, match="is no PreemptionMode"):
        decode(_forged(b"PreemptionMode", "fast", code=wire._E))
    with pytest.raises(WireError, match="is no RequestOutputKind"):
        decode(_forged(b"RequestOutputKind", [1], code=wire._E))
    with pytest.raises(WireError, match="RequestOutputKind of 2 values"):
        decode(_forged(b"RequestOutputKind", 1, 2, code=wire._E))


def test_markers_out_of_place():
    t = msgpack.ExtType(1, b"")
    lora = msgpack.ExtType(wire._O, wire._tag(LoRARequest))
    for bad in ([1, t], {"a": t}, {t: 1}, t, [[t], t], [1, [1, lora]], lora, {"k": lora}):
        with pytest.raises(WireError):
            decode(msgpack.packb(bad))


def _array_ext(code, name, shape, raw):
    header = msgpack.packb([name, shape])
    return msgpack.packb(msgpack.ExtType(code, bytes((len(header),)) + header + raw))


@pytest.mark.parametrize("code", [4, 5])
def test_malformed_arrays(code):
    assert decode(_array_ext(code, "int32", [2, 2], bytes(16))).shape == (2, 2)
    for name, shape, raw, match in [("int32", [2, 2], bytes(15), "has 15 bytes, not 16"),
                                    ("int32", [3], bytes(16), "not 12"), ("int32", [-1, 4], bytes(16), "shape"),
                                    ("int32", [True], bytes(4), "shape"), ("int32", [2 ** 63], b"", "not"),
                                    ("object", [2], bytes(16), "unknown dtype"), ("complex64", [1], bytes(8), "dtype"),
                                    ("torch.float32", [1], bytes(4), "dtype"), ("int32", [1] * 40, bytes(4), "shape"),
                                    (5, [1], bytes(4), "header"), ("int32", 4, bytes(16), "header")]:
        with pytest.raises(WireError, match=match):
            decode(_array_ext(code, name, shape, raw))
    for payload in (b"", b"\x09\x92", b"\x01\xc1"):
        with pytest.raises(WireError):
            decode(msgpack.packb(msgpack.ExtType(code, payload)))


def ext(code: int, payload: bytes) -> bytes:
    return msgpack.packb(msgpack.ExtType(code, payload))


def test_other_malformed_messages():
    good = encode(MESSAGES[0])
    for bad in (b"", good[:-1], good[: len(good) // 2], good + b"\x00", b"\x91" * 100_000 + b"\xc0",
                msgpack.packb(msgpack.ExtType(99, b"x")), ext(wire._DTYPE, b"torch.float32"),
                ext(wire._DTYPE, b"complex64"), ext(wire._DTYPE, b"\xff"), ext(wire._DEVICE, b"cuda; rm"),
                ext(wire._DEVICE, b"cpu:x"), ext(wire._DEVICE, b"tpu"), ext(wire._BIGINT, b""),
                msgpack.packb(msgpack.ExtType(5, b"")), b"\xa2\xff\xfe", msgpack.packb({(1,): 2})[:1] + b"\x91\x01\x02",
                b"\xc1"):
        with pytest.raises(WireError):
            decode(bad)
    for cut in range(0, len(good), max(1, len(good) // 300)):  # every truncation of a real step
        with pytest.raises(WireError):
            decode(good[:cut])


_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text() | st.binary(),
    lambda inner: st.lists(inner) | st.lists(inner).map(tuple)
    | st.dictionaries(st.integers() | st.text(), inner), max_leaves=30)


@settings(max_examples=200, deadline=None)
@given(_values)
def test_plain_values_round_trip(value):
    round_trip(value)
    assert same(decode(bytearray(encode(value))), value) and same(decode(memoryview(encode(value))), value)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_random_bytes_only_raise_wire_error(data):
    try:
        decode(data)
    except WireError:
        pass


_GOOD = encode(("execute", (step(2, 8),)))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(_GOOD) - 1), st.integers(0, 255)), min_size=1, max_size=4))
def test_corrupted_steps_only_raise_wire_error(edits):
    data = bytearray(_GOOD)
    for at, byte in edits:
        data[at] = byte
    try:
        decode(bytes(data))
    except WireError:
        pass


def test_unregistered_values_are_refused_by_name():
    class Mode(enum.Enum):
        A = 1

    @dataclasses.dataclass
    class Extra:
        x: int = 0

    for value, name in [(lambda: 0, "function"), ({1}, "set"), (object(), "object"), (Mode.A, "Mode"),
                        (Extra(), "Extra"), (frozenset(), "frozenset"), (b"x".decode, "builtin_function"),
                        (torch.zeros(1, dtype=torch.complex64), "complex64"),
                        (np.array(["a"]), "<U1"), (np.array([1], dtype=">i4"), ">i4"), (1j, "complex"),
                        (types.SimpleNamespace(), "SimpleNamespace"), (torch.zeros(2).to_sparse(), "sparse"),
                        (torch.device("mps"), "device"), (torch.float8_e4m3fn, "dtype"),
                        (dataclasses.replace(step(1).requests[0], matcher=FakeMatcher([])), "FakeMatcher")]:
        with pytest.raises(WireError, match=name):
            encode({"k": [value]})
    a = []
    a.append(a)
    with pytest.raises(WireError):
        encode(a)


# --- the allow-list covers what the executor sends ---

_PLAIN = {int, float, str, bytes, bool, type(None), list, tuple, dict, torch.Tensor, np.ndarray}


def _reached(cls, seen: set, leaves: set) -> None:
    """Every dataclass and enum reachable from cls's field annotations (and their leaf types)."""
    if cls in seen:
        return
    seen.add(cls)
    if not dataclasses.is_dataclass(cls):
        return
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        stack = [hints[f.name]]
        while stack:
            t = stack.pop()
            args = typing.get_args(t)
            stack.extend(a for a in args if a is not Ellipsis)
            origin = typing.get_origin(t) or t
            if origin in (typing.Union, types.UnionType):
                continue
            if dataclasses.is_dataclass(origin) or (isinstance(origin, type) and issubclass(origin, enum.Enum)):
                _reached(origin, seen, leaves)
            else:
                leaves.add((cls.__name__, f.name, origin))


def test_every_type_the_messages_reach_is_registered():
    seen, leaves = set(), set()
    for cls in (SchedulerOutput, CacheConfig, LoRARequest, StepResult, MaskRow, ImageItem):
        _reached(cls, seen, leaves)
    # ImageItem: in ScheduledRequest.mm_items, a bare tuple
    assert {SamplingParams, StructuredOutputsParams, RequestOutputKind, ScheduledRequest, TokenLogprobs,
            PreemptionMode} <= seen
    assert seen - set(wire.TYPES) == set(), "a field's type is missing from runtime/wire.py's TYPES"
    odd = {(c, f, t) for c, f, t in leaves if t not in _PLAIN}
    # ScheduledRequest.matcher: object, replaced by a MaskRow before sending
    assert odd == {("ScheduledRequest", "matcher", object)}, odd


# --- speed, for the record (pytest -s prints it) ---

def _best(fn, repeat=7) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _plain(out: SchedulerOutput) -> SchedulerOutput:
    """The step with plain sampling parameters: no grammar, no bias, no stop strings."""
    return dataclasses.replace(out, requests=[dataclasses.replace(
        r, sampling_params=SamplingParams(temperature=0.7, max_tokens=256), matcher=None) for r in out.requests])


def test_speed_against_pickle():
    cases = {"decode step, 64 x 1000 request_tokens": ("execute", (step(64, 1000),)),
             "decode step, 64 x 1000 request_tokens, plain sampling": ("execute", (_plain(step(64, 1000)),)),
             "later decode step, 64 x 1 new tokens": ("execute", (step(64, 1),)),
             "later decode step, plain sampling": ("execute", (_plain(step(64, 1)),)),
             "answer: 64 tokens with 5 logprobs each": ("ok", StepResult(
                 sampled=list(range(64)), logprobs={f"req-{i}": TokenLogprobs(i, -0.5, 1, *top([(i, -0.5)] * 5))
                                                    for i in range(64)}))}
    for name, msg in cases.items():
        for r in msg[1][0].requests if msg[0] == "execute" else ():
            r.mm_items = ()  # text only
        w = _best(lambda: decode(encode(msg)))
        p = _best(lambda: pickle.loads(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL)))
        print(f"\nwire {name}: encode+decode {w * 1e3:.2f} ms ({len(encode(msg)) / 1024:.0f} KiB); "
              f"pickle {p * 1e3:.2f} ms ({len(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL)) / 1024:.0f} KiB)")
        assert w < 1.0  # a sanity bound only
