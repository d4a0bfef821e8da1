"""How large a client's regex (a `regex` request, a schema's `pattern`) is to compile, read off
its parse tree before anything compiles it (json_schema.check_pattern refuses it past the bound)."""

from __future__ import annotations

import re

# what a client's regex may spell out through its counted repetitions ({m,n}, nested ones
# multiplying), a position weighted by how much of the vocabulary it takes (a literal 1, a class
# of up to 16 characters 1, of up to 64 4, a broad one such as . [^"] \w 16): its automaton and
# the compile's walk over the vocabulary grow with both. With SmolLM2's vocabulary, alone on a
# Xeon: a{2000} 0.9 s, [^"]{1,2000} 12.6 s, .{1,10000} and a{99999} past the 60 s limit, and
# ((a{1,30}){1,30}){1,30} 58 s (nested counts cost more than their expansion)
MAX_REGEX_WEIGHT = 10_000
_NARROW, _MEDIUM = 16, 64  # a class's characters for weights 1 and 4


class BackReference(ValueError):
    """The regex refers back to a group ((?P=name), (?(1)...))."""


_C = re._constants
_REPEATS = {_C.MAX_REPEAT, _C.MIN_REPEAT, _C.POSSESSIVE_REPEAT}
_CATEGORY_CHARS = {_C.CATEGORY_DIGIT: 10, _C.CATEGORY_SPACE: 6}  # the rest (\w, \D, \S, \W): broad


def regex_weight(items, limit: int) -> int:
    """What a parsed regex spells out: each repetition its body times its upper count (an
    unbounded one: its lower count + 1), each position weighted by its breadth (_class_weight);
    stops past `limit`. BackReference for a back-reference."""
    total = 0
    for op, av in items:
        if op in _REPEATS:
            lo, hi, body = av
            total += (lo + 1 if hi == _C.MAXREPEAT else max(hi, 1)) * regex_weight(body, limit)
        elif op is _C.SUBPATTERN:
            total += regex_weight(av[-1], limit)
        elif op is _C.ATOMIC_GROUP:
            total += regex_weight(av, limit)
        elif op is _C.BRANCH:
            total += sum(regex_weight(branch, limit) for branch in av[1])
        elif op in (_C.GROUPREF, _C.GROUPREF_EXISTS):
            raise BackReference
        elif op is _C.IN:
            total += _class_weight(av)
        elif op in (_C.ANY, _C.NOT_LITERAL):
            total += 16
        elif op is not _C.AT:
            total += 1
        if total > limit:
            break
    return total


def _class_weight(members) -> int:
    chars = 0
    for op, av in members:
        if op is _C.NEGATE:
            return 16
        chars += av[1] - av[0] + 1 if op is _C.RANGE else _CATEGORY_CHARS.get(av, 1 << 16) \
            if op is _C.CATEGORY else 1
    return 1 if chars <= _NARROW else 4 if chars <= _MEDIUM else 16
