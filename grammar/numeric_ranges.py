"""Exact regexes for numeric ranges (JSON Schema's minimum, maximum and the exclusive ones):
integers and decimal numbers, fractional ends included, as outlines-core's schema conversion
leaves them out. Ranges whose grammar outlines-core would compile too slowly are refused."""

from __future__ import annotations

import math
import os
from decimal import Decimal

# outlines-core's compile time grows about 5x with each digit where a range of integers may leave
# its ends, and about 2x with each digit of a range's upper end (measured with SmolLM2's
# vocabulary: integers from 123456789 take 1 s, from 1234567890123 over 30 s; up to 10**15 0.3 s,
# 10**18 2.9 s; numbers up to 1e30, over 60 s). Integers from 1700000000000 (the significant
# digits of an end count, not its length) are cheap.
MAX_BOUND_DIGITS = 9
MAX_UPPER_DIGITS = 16  # 10**15 has 16


class TooCostly(ValueError):
    """A range of integers would end at this value, with more digits to leave it at than
    MAX_BOUND_DIGITS, or past MAX_UPPER_DIGITS digits."""


def range_regex(lo: float, lo_excl: bool, hi: float, hi_excl: bool, integer: bool) -> str:
    """Values v with lo <(=) v <(=) hi as JSON writes them (-inf and inf: no bound); empty when
    there are none. TooCostly where the grammar would compile too slowly."""
    parts = []
    if hi > 0 or (hi == 0 and not hi_excl):  # v >= 0: magnitudes in [max(lo, 0), hi]
        part = _magnitude(*((lo, lo_excl) if lo >= 0 else (0.0, False)), hi, hi_excl, integer)
        if part:
            parts.append(part)
    if lo < 0:  # v < 0: -m with m in [max(-hi, 0), -lo] ("-0" only where 0 is allowed)
        low = (-hi, hi_excl) if hi < 0 else (0.0, hi == 0 and hi_excl)
        part = _magnitude(*low, -lo, lo_excl, integer)
        if part:
            parts.append(f"-({part})")
    return "|".join(parts)


def _ends(a: int, b: int | None) -> int:
    """`a`, checked as the least of the integers up to `b` (None: any above): the digits where
    the range may leave its ends, after those both share, are at most MAX_BOUND_DIGITS."""
    x = str(a)
    y = str(10 ** len(x) - 1 if b is None else b)
    if len(y) > MAX_UPPER_DIGITS:
        raise TooCostly(y)
    shared = len(os.path.commonprefix([x, y])) if len(x) == len(y) else 0
    # trailing zeros cost nothing, nor do an upper end's trailing nines
    for end, digits in ((x, x.rstrip("0")), (y, y.rstrip("9").rstrip("0"))):
        if len(digits) - shared > MAX_BOUND_DIGITS:
            raise TooCostly(end)
    return a


def _magnitude(lo: float, lo_excl: bool, hi: float, hi_excl: bool, integer: bool) -> str:
    """Digits (and for numbers an optional fraction) of values v with lo <(=) v <(=) hi, where
    0 <= lo. Empty when there are none. Exact, fractional ends included. TooCostly where a range
    of integers it writes would be too costly to compile."""
    if integer:
        a = math.floor(lo) + 1 if lo_excl and float(lo).is_integer() else math.ceil(lo)
        if math.isinf(hi):
            return _int_at_least(_ends(a, None))
        b = math.ceil(hi) - 1 if hi_excl and float(hi).is_integer() else math.floor(hi)
        return _int_range(_ends(a, b), b) if a <= b else ""
    low, low_frac = _split(lo)
    parts = []
    if math.isinf(hi):
        if not low_frac and not lo_excl:  # an integer minimum: its own digits, then any fraction
            return _with_fraction(_int_at_least(_ends(low, None)), [r"[0-9]+"], True)
        parts.append(_with_fraction(str(low), _frac_at_least(low_frac, lo_excl),
                                    not low_frac and not lo_excl))
        parts.append(_with_fraction(_int_at_least(_ends(low + 1, None)), [r"[0-9]+"], True))
        return "|".join(p for p in parts if p)
    high, high_frac = _split(hi)
    top_whole = bool(high_frac) or not hi_excl  # the integer `high` itself is allowed
    if low == high:
        parts.append(_with_fraction(str(low), _frac_between(low_frac, high_frac, lo_excl, hi_excl),
                                    not low_frac and not lo_excl and top_whole))
    else:
        parts.append(_with_fraction(str(low), _frac_at_least(low_frac, lo_excl), not low_frac and not lo_excl))
        if high - low > 1:
            parts.append(_with_fraction(_int_range(_ends(low + 1, high - 1), high - 1), [r"[0-9]+"], True))
        parts.append(_with_fraction(str(high), _frac_at_most(high_frac, hi_excl), top_whole))
    return "|".join(p for p in parts if p)


def _split(x: float) -> tuple[int, str]:
    """Integer part and fraction digits (no trailing zeros) of a non-negative bound, exactly as
    written in decimal."""
    text = format(Decimal(repr(float(x))), "f")
    whole, _, frac = text.partition(".")
    return int(whole), frac.rstrip("0")


def _with_fraction(whole: str, fractions: list[str], bare: bool) -> str:
    """`whole` followed by one of the fraction alternatives, or by nothing when `bare`."""
    if not fractions:
        return f"({whole})" if bare else ""
    frac = rf"\.({'|'.join(fractions)})"
    return f"({whole})({frac})?" if bare else f"({whole}){frac}"


def _first_run(digits: str) -> tuple[int, int, str]:
    """The first digit, how many times it repeats at the start, and the digits after."""
    k = len(digits) - len(digits.lstrip(digits[0]))
    return int(digits[0]), k, digits[k:]


def _repeat(c: int, lo: int, hi: int | None = None) -> str:
    """The digit c, lo to hi times (exactly lo when hi is None)."""
    if hi is None or hi == lo:
        return str(c) * lo if lo < 4 else f"{c}{{{lo}}}"
    return f"{c}{{{lo},{hi}}}"


# Each bound's fraction is taken a run of equal digits at a time, so the regex grows with the
# runs, not the digits: 1.2e-301 has a run of 300 zeros (as prefixes, a 49 KB regex).

def _frac_at_least(a: str, strict: bool) -> list[str]:
    """Non-empty digit strings d with 0.d >= 0.a (> when strict); `a` has no trailing zeros."""
    if not a:
        return ["[0-9]*[1-9][0-9]*" if strict else "[0-9]+"]
    c, k, rest = _first_run(a)
    out = [f"{_repeat(c, 0, k - 1)}[{c + 1}-9][0-9]*"] if c < 9 else []  # a larger digit within the run
    if rest:
        out.append(f"{_repeat(c, k)}({'|'.join(_frac_at_least(rest, strict))})")
    else:
        out.append(f"{_repeat(c, k)}[0-9]*[1-9][0-9]*" if strict else f"{_repeat(c, k)}[0-9]*")
    return out


def _frac_at_most(b: str, strict: bool) -> list[str]:
    """Non-empty digit strings d with 0.d <= 0.b (< when strict); `b` has no trailing zeros."""
    if not b:
        return [] if strict else ["0+"]
    c, k, rest = _first_run(b)
    out = [f"{_repeat(c, 0, k - 1)}[0-{c - 1}][0-9]*"] if c > 0 else []  # a smaller digit within the run
    if k > 1:
        out.append(_repeat(c, 1, k - 1))  # a part of the run, then the end
    if rest:
        out.append(f"{_repeat(c, k)}({'|'.join(_frac_at_most(rest, strict))})?")
    elif not strict:
        out.append(f"{_repeat(c, k)}0*")
    return out


def _frac_between(a: str, b: str, a_strict: bool, b_strict: bool) -> list[str]:
    """Non-empty digit strings d with 0.a <(=) 0.d <(=) 0.b, where 0.a <= 0.b."""
    if not a and not b:
        return [] if a_strict or b_strict else ["0+"]
    # the digits both share, `a` read with the zeros after its end (0.a <= 0.b: `b` is not shorter)
    same = next((i for i, (x, y) in enumerate(zip(a.ljust(len(b), "0"), b)) if x != y), len(b))
    if same:  # every such d starts with those digits, or is `a` and some of those zeros
        a_rest, b_rest = a[same:], b[same:]
        rest = _frac_between(a_rest, b_rest, a_strict, b_strict)
        empty_ok = not a_rest and not a_strict and (bool(b_rest) or not b_strict)
        written = _written(b[:same])
        out = [f"{written}({'|'.join(rest)})" + ("?" if empty_ok else "")] if rest else \
            ([written] if empty_ok else [])
        fewest = 0 if a else 1  # d is `a`, then fewer zeros than the prefix has after it (d not empty)
        if not a_strict and same - len(a) - 1 >= fewest:
            out.append(_written(a) + _repeat(0, fewest, same - len(a) - 1))
        return out
    a0, b0 = (int(a[0]) if a else 0), (int(b[0]) if b else 0)
    a_rest, b_rest = a[1:], b[1:]
    out = []
    if b0 - a0 > 1:
        out.append(f"[{a0 + 1}-{b0 - 1}][0-9]*")
    tail = _frac_at_least(a_rest, a_strict)
    empty_ok = not a_rest and not a_strict
    out.append(f"{a0}({'|'.join(tail)})" + ("?" if empty_ok else ""))
    tail = _frac_at_most(b_rest, b_strict)
    empty_ok = bool(b_rest) or not b_strict
    if tail:
        out.append(f"{b0}({'|'.join(tail)})" + ("?" if empty_ok else ""))
    elif empty_ok:
        out.append(str(b0))
    return out


def _written(digits: str) -> str:
    """Exactly `digits`, each run of a digit written once with its count."""
    out = []
    while digits:
        c, k, digits = _first_run(digits)
        out.append(_repeat(c, k))
    return "".join(out)


def _int_at_least(a: int) -> str:
    """Integers >= a (a >= 0), no leading zeros."""
    if a <= 0:
        return "0|[1-9][0-9]*"
    digits = len(str(a))
    return f"{_int_range(a, 10 ** digits - 1)}|[1-9][0-9]{{{digits},}}"


def _int_range(a: int, b: int) -> str:
    """Integers in [a, b], 0 <= a <= b, no leading zeros."""
    parts = []
    for d in range(len(str(a)), len(str(b)) + 1):
        x = max(a, 10 ** (d - 1) if d > 1 else 0)
        y = min(b, 10 ** d - 1)
        if x <= y:
            parts.append(_same_length(str(x), str(y)))
    return "|".join(parts)


def _same_length(x: str, y: str) -> str:
    if x == y:
        return x
    if len(x) == 1:
        return f"[{x}-{y}]"
    if x[0] == y[0]:
        return x[0] + "(" + _same_length(x[1:], y[1:]) + ")"
    n = len(x) - 1
    if x[1:] == "0" * n and y[1:] == "9" * n:
        return f"[{x[0]}-{y[0]}][0-9]{{{n}}}"
    parts = [x[0] + "(" + _same_length(x[1:], "9" * n) + ")"]
    if int(y[0]) - int(x[0]) > 1:
        parts.append(f"[{int(x[0]) + 1}-{int(y[0]) - 1}][0-9]{{{n}}}")
    parts.append(y[0] + "(" + _same_length("0" * n, y[1:]) + ")")
    return "|".join(parts)
