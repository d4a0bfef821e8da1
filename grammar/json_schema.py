"""JSON schema -> regular expression, through outlines-core, with what it leaves out done here.

outlines-core turns a schema into a regex but ignores some keywords: numeric bounds (minimum,
maximum and the exclusive ones) above all, so "age between 0 and 120" would allow -5. Such a
subschema is replaced by a placeholder constant before the conversion, and the placeholder in
the regex by an exact range regex built here. Keywords that neither side can enforce (e.g.
multipleOf, uniqueItems, not, if/then/else) are refused with an error that names them, rather
than producing output that would not validate."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from decimal import Decimal

from outlines_core.json_schema import build_regex_from_schema

# between JSON tokens: at most one space. Unbounded whitespace lets a small model loop on
# newlines forever; none at all makes it write unusual text
WHITESPACE = r"[ ]?"

# keywords enforced by outlines-core or here; annotations that constrain nothing
_SUPPORTED = {
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
    "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
    "minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "title", "description", "default", "examples", "$schema", "$id", "$comment",
    "nullable", "strict", "deprecated", "readOnly", "writeOnly",
}
_FORMATS = {"date-time", "date", "time", "uuid", "email", "uri"}
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# outlines-core's compile time grows about 5x with each digit where a range of integers may leave
# its ends, and about 2x with each digit of a range's upper end (measured with SmolLM2's
# vocabulary: integers from 123456789 take 1 s, from 1234567890123 over 30 s; up to 10**15 0.3 s,
# 10**18 2.9 s; numbers up to 1e30, over 60 s). Integers from 1700000000000 (the significant
# digits of an end count, not its length) are cheap.
MAX_BOUND_DIGITS = 9
MAX_UPPER_DIGITS = 16  # 10**15 has 16


class _TooFine(ValueError):
    """An end of a range of integers with more than MAX_BOUND_DIGITS digits to leave it at."""
MAX_SCHEMA_CHARS = 64_000  # a schema written as JSON
# a schema's regex; outlines-core's grows with the square of an object's optional properties, so
# a schema of a few KB could take minutes of the grammar worker (every request's grammar waits)
MAX_REGEX_CHARS = 200_000


class UnsupportedSchema(ValueError):
    pass


def schema_to_regex(schema: dict | bool | str) -> str:
    """The regex of every JSON text that `schema` accepts (a subset, for numeric bounds with
    fractional ends). ValueError naming the feature for what cannot be enforced."""
    if isinstance(schema, str):
        if len(schema) > MAX_SCHEMA_CHARS:
            raise UnsupportedSchema(f"the JSON schema is longer than {MAX_SCHEMA_CHARS} characters")
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise UnsupportedSchema(f"the JSON schema is not valid JSON: {e}") from None
    if schema is True or schema == {}:
        schema = {"type": "object"}  # "anything": an object, as json_object mode gives
    if not isinstance(schema, dict):
        raise UnsupportedSchema("the JSON schema must be an object")
    check_size(schema)
    ranges: dict[str, str] = {}
    counter = itertools.count()
    rewritten = _rewrite(schema, ranges, counter, "#")
    try:
        regex = build_regex_from_schema(json.dumps(rewritten), WHITESPACE)
    except Exception as e:  # noqa: BLE001 - outlines-core raises ValueError / RuntimeError
        raise UnsupportedSchema(f"the JSON schema cannot be compiled: {str(e).splitlines()[0]}") from None
    for marker, sub in ranges.items():  # (one in an unused $defs entry is simply absent)
        regex = regex.replace(f'"{marker}"', f"({sub})")
    if len(regex) > MAX_REGEX_CHARS:
        raise UnsupportedSchema(f"the JSON schema makes a regex of {len(regex)} characters, more than the "
                                f"{MAX_REGEX_CHARS} that can be compiled; use fewer optional properties (their "
                                f"regex grows as their square)")
    return regex


def check_size(schema: dict) -> None:
    """UnsupportedSchema for a schema too long, or whose regex would surely be too large (never
    built: a few KB of JSON can ask outlines-core for gigabytes)."""
    try:
        size = len(json.dumps(schema, ensure_ascii=False, default=str))
        if size > MAX_SCHEMA_CHARS:
            raise UnsupportedSchema(f"the JSON schema takes {size} characters, more than {MAX_SCHEMA_CHARS}")
        bound = regex_size_bound(schema)
    except RecursionError:
        raise UnsupportedSchema("the JSON schema is nested too deeply") from None
    if bound > 8 * MAX_REGEX_CHARS:
        raise UnsupportedSchema(f"the JSON schema would make a regex of more than {MAX_REGEX_CHARS} characters, "
                                f"too large to compile; use fewer optional properties (their regex grows as "
                                f"their square)")


_ANY_VALUE_CHARS = 14_000  # outlines-core's regex for an untyped value, as a property writes it
_NO_CONSTRAINT = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "strict",
                  "deprecated", "readOnly", "writeOnly", "nullable"}


def regex_size_bound(schema) -> int:
    """Roughly the most regex characters `schema` can take (as a call's parameters, or as a JSON
    literal in a Python call): each optional property repeats the object's other properties, so
    an object costs (optional properties + 1) times the sum of its properties, and a `$ref` its
    definition each time it is used (outlines-core writes it out in place). In time linear in
    the schema: a definition is sized once. Any JSON is taken: what is not a valid schema is
    refused later, when it is built."""
    return _size_bound(schema, {}, {}, ())


def _size_bound(schema, defs: dict, memo: dict, refs: tuple) -> int:
    if not isinstance(schema, dict):
        return _ANY_VALUE_CHARS
    own = [schema[key] for key in ("$defs", "definitions") if isinstance(schema.get(key), dict)]
    if own:
        defs = {**defs, **{k: v for d in own for k, v in d.items()}}
    if "$ref" in schema:
        ref = str(schema["$ref"])
        if ref in refs:
            return 256  # outlines-core cuts recursion short
        if ref not in memo:
            memo[ref] = _size_bound(defs.get(ref.rsplit("/", 1)[-1]), defs, memo, (*refs, ref))
        return memo[ref]
    if "enum" in schema or "const" in schema:
        return len(json.dumps(schema.get("enum", schema.get("const")), default=str)) + 16
    if not schema.keys() - _NO_CONSTRAINT:
        return _ANY_VALUE_CHARS
    total = 64 + len(str(schema.get("pattern", "")))
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        total += sum(_size_bound(s, defs, memo, refs) for s in _list(schema.get(key)))
    kind = schema.get("type")
    if "items" in schema:
        total += _size_bound(schema["items"], defs, memo, refs)
    elif kind == "array" or (isinstance(kind, list) and "array" in kind):
        total += _ANY_VALUE_CHARS  # items of any kind
    properties = schema.get("properties")
    if isinstance(properties, dict) and properties:
        required = {r for r in _list(schema.get("required")) if isinstance(r, str)}
        optional = len(properties.keys() - required)
        total += (optional + 1) * sum(len(k) + 16 + _size_bound(v, defs, memo, refs) for k, v in properties.items())
    elif properties is None and (kind == "object" or (isinstance(kind, list) and "object" in kind)
                                 or "additionalProperties" in schema):
        total += _ANY_VALUE_CHARS  # any object
    return total


def _list(value) -> list:
    return value if isinstance(value, list) else []


def _rewrite(node, ranges: dict[str, str], counter, path: str):
    """A copy of the schema with bounded numbers swapped for placeholder constants; refuses
    unsupported keywords."""
    if isinstance(node, list):
        return [_rewrite(v, ranges, counter, f"{path}/{i}") for i, v in enumerate(node)]
    if not isinstance(node, dict):
        return node
    for key in node:
        if key not in _SUPPORTED:
            raise UnsupportedSchema(f"the JSON schema keyword '{key}' (at {path}) is not supported "
                                    f"for structured output")
    if "format" in node and node["format"] not in _FORMATS:
        raise UnsupportedSchema(f"the JSON schema format '{node['format']}' (at {path}) is not supported; "
                                f"supported: {', '.join(sorted(_FORMATS))}")
    if "pattern" in node:
        check_pattern(node["pattern"], f"the pattern at {path}")
    kind = node.get("type")
    if any(b in node for b in _BOUNDS) and ("enum" in node or "const" in node):
        node = _filter_by_bounds(node, path)  # the listed values are the grammar; bounds prune them
    elif any(b in node for b in _BOUNDS) and kind in ("integer", "number"):
        marker = f"PSRANGE{next(counter)}X"
        ranges[marker] = _number_regex(node, integer=kind == "integer", path=path)
        return {"const": marker}
    elif any(b in node for b in _BOUNDS):
        raise UnsupportedSchema(f"numeric bounds (at {path}) are supported with type 'integer' or "
                                f"'number' (a single type), not with {kind!r}")
    out = {}
    for key, value in node.items():
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            out[key] = {k: _rewrite(v, ranges, counter, f"{path}/{key}/{k}") for k, v in value.items()}
        elif key in ("items", "additionalProperties", "anyOf", "oneOf", "allOf", "prefixItems"):
            out[key] = _rewrite(value, ranges, counter, f"{path}/{key}")
        elif key == "pattern":
            out[key] = ascii_digits(value)
        else:
            out[key] = value
    return out


def ascii_digits(regex: str) -> str:
    r"""\d means any Unicode digit to the automaton library (so a date could come out in
    segmented digits); users mean 0-9."""
    out, i, in_class = [], 0, False
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            nxt = regex[i + 1]
            out.append(("0-9" if in_class else "[0-9]") if nxt == "d" else
                       ("[^0-9]" if nxt == "D" and not in_class else c + nxt))
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
        elif c == "]" and in_class and out and out[-1] != "[":
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


_LOOKAROUND = re.compile(r"\(\?(?:[=!]|<[=!])|\\[1-9]|\\[bBAzZ]")


def check_pattern(pattern, what: str) -> None:
    if not isinstance(pattern, str):
        raise UnsupportedSchema(f"{what} must be a string")
    if _LOOKAROUND.search(pattern):
        raise UnsupportedSchema(f"{what} ({pattern[:100]!r}) uses look-around, back-references or word "
                                f"boundaries, which structured output cannot enforce")
    try:
        re.compile(pattern)
    except re.error as e:
        raise UnsupportedSchema(f"{what} ({pattern[:100]!r}) is not a valid regex: {e}") from None


def _filter_by_bounds(node: dict, path: str) -> dict:
    lo, lo_excl, hi, hi_excl = _bound(node, path)

    def inside(v) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return True  # bounds constrain numbers only
        return (v > lo if lo_excl else v >= lo) and (v < hi if hi_excl else v <= hi)

    out = {k: v for k, v in node.items() if k not in _BOUNDS}
    values = node["enum"] if "enum" in node else [node["const"]]
    kept = [v for v in values if inside(v)]
    if not kept:
        raise UnsupportedSchema(f"the bounds at {path} exclude every value of its enum or const")
    out.pop("const", None)
    out["enum"] = kept
    return out


# ---- numeric ranges ----

def _bound(node: dict, path: str) -> tuple[float, bool, float, bool]:
    lo, lo_excl = -math.inf, False
    hi, hi_excl = math.inf, False
    for key in _BOUNDS:
        v = node.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise UnsupportedSchema(f"'{key}' (at {path}) must be a finite number")
        if key == "minimum" and v >= lo:
            lo, lo_excl = v, False
        elif key == "exclusiveMinimum" and v >= lo:
            lo, lo_excl = v, True
        elif key == "maximum" and v <= hi:
            hi, hi_excl = v, False
        elif key == "exclusiveMaximum" and v <= hi:
            hi, hi_excl = v, True
    return lo, lo_excl, hi, hi_excl


def _number_regex(node: dict, integer: bool, path: str) -> str:
    lo, lo_excl, hi, hi_excl = _bound(node, path)
    parts = []
    if hi > 0 or (hi == 0 and not hi_excl):  # v >= 0: magnitudes in [max(lo, 0), hi]
        try:
            part = _magnitude(*((lo, lo_excl) if lo >= 0 else (0.0, False)), hi, hi_excl, integer)
        except _TooFine as e:
            raise _too_fine(e, path) from None
        if part:
            parts.append(part)
    if lo < 0:  # v < 0: -m with m in [max(-hi, 0), -lo] ("-0" only where 0 is allowed)
        low = (-hi, hi_excl) if hi < 0 else (0.0, hi == 0 and hi_excl)
        try:
            part = _magnitude(*low, -lo, lo_excl, integer)
        except _TooFine as e:
            raise _too_fine(e, path) from None
        if part:
            parts.append(f"-({part})")
    if not parts:
        raise UnsupportedSchema(f"the bounds at {path} leave no {'integer' if integer else 'number'} "
                                f"that structured output can write")
    return "|".join(parts)


def _too_fine(e: _TooFine, path: str) -> UnsupportedSchema:
    return UnsupportedSchema(f"the bounds at {path} make a grammar of integers that may end at {e}; structured "
                             f"output enforces ranges whose ends have at most {MAX_BOUND_DIGITS} significant "
                             f"digits, up to 10**{MAX_UPPER_DIGITS - 1} (the grammar's compile time grows steeply "
                             "with both): leave the bound out and check the value after")


def _ends(a: int, b: int | None) -> int:
    """`a`, checked as the least of the integers up to `b` (None: any above): the digits where
    the range may leave its ends, after those both share, are at most MAX_BOUND_DIGITS."""
    x = str(a)
    y = str(10 ** len(x) - 1 if b is None else b)
    if len(y) > MAX_UPPER_DIGITS:
        raise _TooFine(y)
    shared = len(os.path.commonprefix([x, y])) if len(x) == len(y) else 0
    # trailing zeros cost nothing, nor do an upper end's trailing nines
    for end, digits in ((x, x.rstrip("0")), (y, y.rstrip("9").rstrip("0"))):
        if len(digits) - shared > MAX_BOUND_DIGITS:
            raise _TooFine(end)
    return a


def _magnitude(lo: float, lo_excl: bool, hi: float, hi_excl: bool, integer: bool) -> str:
    """Digits (and for numbers an optional fraction) of values v with lo <(=) v <(=) hi, where
    0 <= lo. Empty when there are none. Exact, fractional ends included. _TooFine where a range
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
