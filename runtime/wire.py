"""The format of the messages between the engine and its worker processes (runtime/executor.py,
runtime/worker.py), which rank 0 also relays to other machines: msgpack, never pickle.

Nothing that arrives may name code to run, so the decoder builds only the types on the allow-list
below (dataclasses and enums by a short tag, numpy arrays and torch tensors of listed dtypes) and
raises WireError on anything else; the encoder refuses any type not listed, naming it, so that a
field of a new type is noticed at once. Dataclasses are rebuilt as pickle rebuilds them (fields set,
no __init__ or __post_init__: the sender's object passed those), so decode(encode(x)) == x.

Layout: plain values are msgpack's own (tuples excepted). A tuple is the array [T, *items], a
dataclass [O(name#digest of its field names), *values in field order], an enum [E(name), value],
where T, O, E are ext markers that only count first in an array; an array or tensor is one ext
(header length, header: dtype name and shape, its C-contiguous bytes); so are an int beyond
64 bits, a torch.dtype and a torch.device."""

from __future__ import annotations

import collections
import dataclasses
import enum
import hashlib
import itertools
import math
import operator
import re

import msgpack
import numpy as np
import torch

from pageserve.runtime.config import CacheConfig, PreemptionMode
from pageserve.runtime.lora.request import LoRARequest
from pageserve.runtime.model_runner import StepResult
from pageserve.runtime.multimodal import ImageItem
from pageserve.runtime.scheduler import ScheduledRequest, SchedulerOutput
from pageserve.runtime.step_sampler import fill_grammar_rows
from pageserve.sampling.params import RequestOutputKind, SamplingParams, StructuredOutputsParams, ThinkingBudget
from pageserve.sampling.logprobs import TokenLogprobs


class WireError(ValueError):
    """A message not in the wire format, or an object the format does not carry."""


@dataclasses.dataclass(slots=True, eq=False)
class MaskRow:
    """A grammar matcher's rows of the token bitmask, filled in the engine process (where the
    matchers live and advance) and sent in its place: one row, or with drafts one per draft and
    one after. The runner fills and steps through them as through the matcher itself
    (fill_bitmask, advance, rollback)."""
    words: np.ndarray  # int32 [rows, ceil(vocab_size / 32)]
    at: int = 0  # the row the matcher would be at

    @classmethod
    def of(cls, matcher, vocab_size: int, drafts: list[int] = ()) -> MaskRow:
        rows = np.full((len(drafts) + 1, -(-vocab_size // 32)), -1, dtype=np.int32)
        fill_grammar_rows(rows, 0, matcher, drafts)
        return cls(rows)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        bitmask[row] = self.words[self.at]

    def advance(self, token: int) -> bool:
        self.at += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        self.at -= num_tokens

    def __eq__(self, other) -> bool:
        return type(other) is MaskRow and self.at == other.at and self.words.dtype == other.words.dtype \
            and np.array_equal(self.words, other.words)


# every dataclass and enum a message may hold: tagged by class name (keep names unique)
TYPES: tuple[type, ...] = (
    SchedulerOutput, ScheduledRequest, SamplingParams, StructuredOutputsParams, ThinkingBudget, RequestOutputKind,
    LoRARequest, ImageItem, MaskRow, CacheConfig, PreemptionMode, StepResult, TokenLogprobs)
_BY_NAME = {cls.__name__: cls for cls in TYPES}
assert len(_BY_NAME) == len(TYPES), "two allow-listed types share a name"
assert all(dataclasses.is_dataclass(c) or issubclass(c, enum.Enum) for c in TYPES)
_FIELDS = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in TYPES if dataclasses.is_dataclass(cls)}
_GETTERS = {cls: operator.attrgetter(*names, *names[:1]) for cls, names in _FIELDS.items()}  # one more: a tuple


def _tag(cls: type) -> bytes:
    """Its name; a dataclass's with a digest of its field names, in order, that both sides must share."""
    if cls not in _FIELDS:
        return cls.__name__.encode()
    return f"{cls.__name__}#{hashlib.blake2b(' '.join(_FIELDS[cls]).encode(), digest_size=4).hexdigest()}".encode()


_T, _O, _E, _NDARRAY, _TENSOR, _BIGINT, _DTYPE, _DEVICE = range(1, 9)  # ext codes
_TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.uint8, torch.bool)}
_NUMPY_DTYPES = {n: np.dtype(n) for n in (
    "float32", "float64", "float16", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "bool")}
_MAX_DIMS = 32
_DEVICE_NAME = re.compile(r"(cpu|cuda|meta)(:\d{1,4})?")


class _Mark:
    """What a marker ext decodes to until its array is rebuilt around it."""
    __slots__ = ("kind", "cls")

    def __init__(self, kind: int, cls: type | None):
        self.kind, self.cls = kind, cls


_TUPLE_EXT = msgpack.ExtType(_T, b"")
_MARK_EXT = {cls: msgpack.ExtType(_O if cls in _FIELDS else _E, _tag(cls)) for cls in TYPES}
_MARKS = {(_T, b""): _Mark(_T, None), **{(e.code, e.data): _Mark(e.code, cls) for cls, e in _MARK_EXT.items()}}


def _type_name(t: type) -> str:
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _array_ext(code: int, name: str, shape, raw) -> msgpack.ExtType:
    header = msgpack.packb([name, list(shape)])
    return msgpack.ExtType(code, b"".join((bytes((len(header),)), header, raw)))


def _default(obj):
    """msgpack's hook for what it does not pack itself (strict_types: tuples, enums, subclasses)."""
    t = type(obj)
    if t is tuple:
        return [_TUPLE_EXT, *obj]
    if t in _FIELDS:
        return [_MARK_EXT[t], *_GETTERS[t](obj)[:-1]]
    if t in _MARK_EXT:  # an enum: by value
        return [_MARK_EXT[t], obj.value]
    if t is int:  # beyond msgpack's 64 bits
        return msgpack.ExtType(_BIGINT, obj.to_bytes(obj.bit_length() // 8 + 1, "little", signed=True))
    if isinstance(obj, torch.Tensor):
        name = str(obj.dtype).removeprefix("torch.")
        if name not in _TORCH_DTYPES or obj.layout != torch.strided:
            raise WireError(f"cannot send a {obj.layout} tensor of dtype {obj.dtype}: not on runtime/wire.py's list")
        flat = obj.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        return _array_ext(_TENSOR, name, obj.shape, memoryview(flat.numpy()))
    if t is np.ndarray:
        if obj.dtype.name not in _NUMPY_DTYPES or obj.dtype != _NUMPY_DTYPES[obj.dtype.name]:
            raise WireError(f"cannot send a numpy array of dtype {obj.dtype.str}: not on runtime/wire.py's list")
        flat = np.ascontiguousarray(obj).reshape(-1).view(np.uint8)
        return _array_ext(_NDARRAY, obj.dtype.name, obj.shape, memoryview(flat))
    if isinstance(obj, (np.bool_, np.integer, np.floating)):  # a numpy scalar: as the Python number
        return obj.item()
    if t is torch.dtype and str(obj).removeprefix("torch.") in _TORCH_DTYPES:
        return msgpack.ExtType(_DTYPE, str(obj).removeprefix("torch.").encode())
    if t is torch.device and _DEVICE_NAME.fullmatch(str(obj)):
        return msgpack.ExtType(_DEVICE, str(obj).encode())
    raise WireError(f"cannot send a value of type {_type_name(t)} ({obj!r:.80}): not on runtime/wire.py's allow-list")


def encode(obj) -> bytes:
    """obj as bytes: WireError names the first value of a type the format does not carry."""
    try:
        return msgpack.packb(obj, default=_default, strict_types=True, use_bin_type=True)
    except WireError:
        raise
    except (ValueError, TypeError, OverflowError) as e:  # a cycle (nesting limit), an unencodable str
        raise WireError(f"cannot encode the message: {e}") from None


def _array(code: int, data: bytes):
    """An ext's array: writable, from one copy of its bytes."""
    if not data or len(data) < 1 + data[0]:
        raise WireError("a truncated array header")
    header = msgpack.unpackb(data[1:1 + data[0]])
    raw = memoryview(data)[1 + data[0]:]
    if type(header) is not list or len(header) != 2 or type(header[0]) is not str or type(header[1]) is not list:
        raise WireError(f"a malformed array header {header!r:.80}")
    name, shape = header
    if len(shape) > _MAX_DIMS or any(type(d) is not int or d < 0 for d in shape):
        raise WireError(f"a malformed array shape {shape!r:.80}")
    dtype = (_TORCH_DTYPES if code == _TENSOR else _NUMPY_DTYPES).get(name)
    if dtype is None:
        raise WireError(f"an array of unknown dtype {name!r:.40}")
    size = math.prod(shape) * dtype.itemsize
    if size != len(raw):
        raise WireError(f"a {name} array of shape {shape} has {len(raw)} bytes, not {size}")
    buf = bytearray(raw)  # msgpack's bytes are immutable: one copy, so that the array is writable
    if code == _NDARRAY:
        return np.frombuffer(buf, dtype).reshape(shape)
    return torch.frombuffer(buf, dtype=dtype).reshape(shape) if size else torch.empty(shape, dtype=dtype)


_setattr = object.__setattr__  # frozen dataclasses too
_drain = collections.deque(maxlen=0).extend


def _build(mark: _Mark, items: list):
    """The object an array that starts with a marker stands for."""
    if mark.kind == _T:
        return tuple(items)
    cls = mark.cls
    names = _FIELDS.get(cls, ("value",))
    if len(items) != len(names):
        raise WireError(f"a {cls.__name__} of {len(items)} values for {len(names)}: {', '.join(names)}")
    if mark.kind == _E:
        try:
            return cls(items[0])
        except ValueError:
            raise WireError(f"{items[0]!r:.80} is no {cls.__name__}") from None
    obj = object.__new__(cls)  # as pickle does: the sender's object already passed __init__
    _drain(map(_setattr, itertools.repeat(obj), names, items))  # the loop in C
    return obj


def decode(data: bytes | bytearray | memoryview):
    """The object encode() was given; WireError on anything that is not such a message."""
    marks = [0, 0]  # markers decoded, markers that started their array

    def ext_hook(code: int, payload: bytes):
        mark = _MARKS.get((code, payload))
        if mark is not None:
            marks[0] += 1
            return mark
        if code in (_NDARRAY, _TENSOR):
            return _array(code, payload)
        if code == _BIGINT and payload:
            return int.from_bytes(payload, "little", signed=True)
        if code == _DTYPE and payload.decode("ascii", "replace") in _TORCH_DTYPES:
            return _TORCH_DTYPES[payload.decode()]
        if code == _DEVICE and _DEVICE_NAME.fullmatch(payload.decode("ascii", "replace")):
            return torch.device(payload.decode())
        cls = _BY_NAME.get(payload.partition(b"#")[0].decode("ascii", "replace"))
        if code == _O and cls in _FIELDS:
            raise WireError(f"a {cls.__name__} whose fields are not this side's {', '.join(_FIELDS[cls])} "
                            f"(tag {payload[:60]!r}, here {_tag(cls)!r}): do both sides run the same code?")
        if code in (_O, _E):
            raise WireError(f"unknown type tag {payload[:60]!r}: not on runtime/wire.py's allow-list")
        raise WireError(f"unknown ext type {code} ({len(payload)} bytes)")

    def list_hook(items: list):
        if items and type(items[0]) is _Mark:
            marks[1] += 1
            return _build(items[0], items[1:])
        return items

    try:
        # msgpack's timestamp ext (-1) bypasses ext_hook: as a float it is at least a plain value
        obj = msgpack.unpackb(data, ext_hook=ext_hook, list_hook=list_hook, strict_map_key=False, timestamp=1)
    except WireError:
        raise
    except Exception as e:  # noqa: BLE001 - truncated, extra bytes, nesting, bad UTF-8, unhashable keys, ...
        raise WireError(f"malformed message: {type(e).__name__}: {e}"[:300]) from None
    if marks[0] != marks[1]:
        raise WireError(f"{marks[0] - marks[1]} type marker(s) out of place")
    return obj
