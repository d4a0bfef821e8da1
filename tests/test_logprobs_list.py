"""A sequence's logprobs packed in arrays (sampling/logprobs.py): read back exactly as the
TokenLogprobs appended, slices that stay what they were as the list grows, forks of their own,
and no Python object per token for the garbage collector to walk."""

from __future__ import annotations

import gc
import random
from array import array

import pytest

from pageserve.sampling.logprobs import LogprobsList, TokenLogprobs

pytestmark = pytest.mark.unit


def entry(rng: random.Random, k: int) -> TokenLogprobs:
    ids = [rng.randrange(50_000) for _ in range(k)]
    lps = sorted((rng.uniform(-20, 0) for _ in range(k)), reverse=True)
    # a float32's value, as the sampler gives it (a float made from a float32 tensor)
    logprob = array("f", [rng.uniform(-20, 0)])[0]
    return TokenLogprobs(rng.randrange(50_000), logprob, rng.randrange(1, 100), array("i", ids).tobytes(),
                         array("f", lps).tobytes())


def test_reads_back_what_was_appended():
    rng = random.Random(3)
    entries = [entry(rng, k) for k in (0, 1, 20, 5, 0, 3)]  # each token its own number of alternatives
    packed = LogprobsList()
    for e in entries:
        packed.append(e)
    assert len(packed) == len(entries) and list(packed) == entries and packed == entries
    assert [packed[i] for i in range(-6, 6)] == entries + entries
    assert packed[2].top == entries[2].top and packed[4].top == []
    with pytest.raises(IndexError):
        packed[6]
    assert packed[1:4] == entries[1:4] and packed[::2] == entries[::2] and packed[5:2] == []
    assert LogprobsList(entries) == packed
    prompt = LogprobsList([None])  # a prompt's: nothing before its first token
    prompt.extend(entries[:2])
    assert list(prompt) == [None, *entries[:2]] and prompt[0] is None and prompt[1:] == entries[:2]


def test_a_slice_stays_as_it_was_and_a_copy_is_its_own():
    rng = random.Random(4)
    packed = LogprobsList(entry(rng, 4) for _ in range(5))
    whole, tail = packed[:], packed[3:]
    fork = packed.copy()
    more = entry(rng, 4)
    packed.append(more)
    assert len(whole) == 5 and len(tail) == 2 and list(tail) == list(packed)[3:5]
    assert tail[1:] == [packed[4]] and len(tail[5:]) == 0
    with pytest.raises(TypeError):
        tail.append(more)
    assert len(fork) == 5
    fork.append(entry(rng, 2))
    assert packed[5] == more and fork[5] != more and fork[:5] == whole


def test_the_collector_walks_no_object_per_token():
    rng = random.Random(5)
    entries = [entry(rng, 20) for _ in range(200)]
    gc.collect()
    before = len(gc.get_objects())
    lists = [LogprobsList(entries * 50) for _ in range(4)]  # 40,000 tokens
    gc.collect()
    assert len(gc.get_objects()) - before < 50
    assert sum(map(len, lists)) == 40_000


def test_pieces_join_as_a_stream_merges_them():
    """A slow reader's unread pieces (output_processor's views) merge back into one run."""
    rng = random.Random(6)
    packed = LogprobsList(entry(rng, 3) for _ in range(3))
    first = packed[0:3]
    packed.append(entry(rng, 3))
    packed.append(entry(rng, 3))
    second, third = packed[3:4], packed[4:5]
    joined = first + second + third
    assert joined == list(packed) and joined._cols is packed._cols  # views of the same arrays
    assert first + LogprobsList() == first and first + [] == first
    other = LogprobsList([entry(rng, 2)])
    assert first + other == list(first) + list(other) and (first + other)._cols is not packed._cols
    assert second + first == [packed[3], *first]  # not in a row: a list of its own
