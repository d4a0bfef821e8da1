"""JSON schema -> regular expression, through outlines-core, with what it leaves out done here.

outlines-core turns a schema into a regex but ignores some keywords: numeric bounds (minimum,
maximum and the exclusive ones) above all, so "age between 0 and 120" would allow -5. Such a
subschema is replaced by a placeholder constant before the conversion, and the placeholder in
the regex by an exact range regex (numeric_ranges.py). Keywords that neither side can enforce (e.g.
multipleOf, uniqueItems, not, if/then/else) are refused with an error that names them, rather
than producing output that would not validate."""

from __future__ import annotations

import itertools
import json
import math
import re
import time
from dataclasses import dataclass

import regex as timed_re  # a search with a timeout: a client's pattern may backtrack for minutes
from outlines_core.json_schema import build_regex_from_schema

from pageserve.grammar.numeric_ranges import MAX_BOUND_DIGITS, MAX_UPPER_DIGITS, TooCostly, range_regex
from pageserve.grammar.patterns import MAX_REGEX_WEIGHT, BackReference, regex_weight

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
_COUNTS = ("minItems", "maxItems", "minLength", "maxLength")
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
        except RecursionError:
            raise UnsupportedSchema("the JSON schema is nested too deeply") from None
    if schema is True or schema == {}:
        schema = {"type": "object"}  # "anything": an object, as json_object mode gives
    if not isinstance(schema, dict):
        raise UnsupportedSchema("the JSON schema must be an object")
    check_size(schema)
    ranges: dict[str, str] = {}
    walk = _Walk(itertools.count(), PATTERN_CHECK_SECONDS)
    rewritten = _rewrite(schema, ranges, walk, "#")
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
_ANY_TYPES = ("string", "number", "boolean", "null", "object", "array")
_NO_CONSTRAINT = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "strict",
                  "deprecated", "readOnly", "writeOnly", "nullable"}


def regex_size_bound(schema) -> int:
    """Roughly the most regex characters `schema` can take (as a call's parameters, or as a JSON
    literal in a Python call): each optional property repeats the object's other properties, so
    an object costs (optional properties + 1) times the sum of its properties, an array twice its
    item (and additionalProperties' schema), and a `$ref` its
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
    # an array writes its item twice (the first, then the repeated ", item"): nested arrays double
    if "items" in schema:
        total += 2 * _size_bound(schema["items"], defs, memo, refs)
    elif kind == "array" or (isinstance(kind, list) and "array" in kind):
        total += 2 * _ANY_VALUE_CHARS  # items of any kind
    properties = schema.get("properties")
    if isinstance(properties, dict) and properties:
        required = {r for r in _list(schema.get("required")) if isinstance(r, str)}
        optional = len(properties.keys() - required)
        total += (optional + 1) * sum(len(k) + 16 + _size_bound(v, defs, memo, refs) for k, v in properties.items())
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):  # a value schema, written twice (as an array's item) beside each property
        n = len(properties) if isinstance(properties, dict) else 0
        total += 2 * (n + 1) * (32 + _size_bound(extra, defs, memo, refs))
    elif properties is None and (kind == "object" or (isinstance(kind, list) and "object" in kind)
                                 or "additionalProperties" in schema):
        total += _ANY_VALUE_CHARS  # any object
    return total


def _list(value) -> list:
    return value if isinstance(value, list) else []


@dataclass(slots=True)
class _Walk:
    """What one schema's rewrite shares: the numbering of its range markers, and the time its
    patterns may still take against their enums' values, all of them together."""
    counter: itertools.count
    pattern_seconds: float


def _rewrite(node, ranges: dict[str, str], walk: _Walk, path: str):
    """A copy of the schema with bounded numbers swapped for placeholder constants; refuses
    unsupported keywords."""
    if isinstance(node, list):
        return [_rewrite(v, ranges, walk, f"{path}/{i}") for i, v in enumerate(node)]
    if not isinstance(node, dict):
        return node
    for key in node:
        if key not in _SUPPORTED:
            raise UnsupportedSchema(f"the JSON schema keyword '{key}' (at {path}) is not supported "
                                    f"for structured output")
    _check_values(node, path)
    if not node.keys() - _NO_CONSTRAINT:  # any value: outlines-core's own regex for it lost its group
        node = {**node, "type": list(_ANY_TYPES)}  # ({"x": {}} let `null` alone be the whole output)
    if "format" in node and node["format"] not in _FORMATS:
        raise UnsupportedSchema(f"the JSON schema format '{node['format']}' (at {path}) is not supported; "
                                f"supported: {', '.join(sorted(_FORMATS))}")
    if "pattern" in node:
        check_pattern(node["pattern"], f"the pattern at {path}")
    if ("enum" in node or "const" in node) and node.keys() & _LISTED_CONSTRAINTS:
        node = _filter_listed(node, path, walk)  # the listed values are the grammar; the rest prune them
    elif "pattern" in node and ("minLength" in node or "maxLength" in node):  # outlines-core drops the pattern
        raise UnsupportedSchema(f"a pattern with minLength or maxLength (at {path}) cannot both be enforced; "
                                "write the length into the pattern (e.g. ^[a-z]{1,8}$)")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        node = _merged_objects(node, path)
    elsewhere = node.keys() & {"$ref", "anyOf", "oneOf", "allOf"}  # where its properties may be named
    if isinstance(node.get("required"), list) and node["required"] and not elsewhere:
        node = _required_properties(node, path)
    kind = node.get("type")
    if any(b in node for b in _BOUNDS) and kind in ("integer", "number"):
        marker = f"PSRANGE{next(walk.counter)}X"
        ranges[marker] = _number_regex(node, integer=kind == "integer", path=path)
        return {"const": marker}
    elif any(b in node for b in _BOUNDS):
        raise UnsupportedSchema(f"numeric bounds (at {path}) are supported with type 'integer' or "
                                f"'number' (a single type), not with {kind!r}")
    out = {}
    for key, value in node.items():
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            out[key] = {k: _rewrite(v, ranges, walk, f"{path}/{key}/{k}") for k, v in value.items()}
        elif key in ("items", "additionalProperties", "anyOf", "oneOf", "allOf", "prefixItems"):
            out[key] = _rewrite(value, ranges, walk, f"{path}/{key}")
        elif key == "pattern":
            out[key] = ascii_digits(value)
        elif key in _COUNTS:
            out[key] = int(value)
        else:
            out[key] = value
    return out


_OBJECT_PARTS = {"type", "properties", "required", "title", "description"}


def _merged_objects(node: dict, path: str) -> dict:
    """A node whose allOf holds several subschemas: outlines-core writes them one after another
    (two objects back to back, not JSON), so object schemas written in place (type, properties,
    required) are merged into one here; anything else is refused."""
    parts = [node, *node["allOf"]]
    properties: dict = {}
    required: list = []
    for i, part in enumerate(parts):
        own = {} if not isinstance(part, dict) else part.keys() - {"allOf"} if part is node else part.keys()
        if not isinstance(part, dict) or own - _OBJECT_PARTS or part.get("type", "object") != "object":
            raise UnsupportedSchema(f"allOf with several subschemas (at {path}) is supported where each is an "
                                    "object schema written in place (type, properties, required); merge them")
        _check_values(part, path if part is node else f"{path}/allOf/{i - 1}")
        for name, schema in (part.get("properties") or {}).items():
            if properties.setdefault(name, schema) != schema:
                raise UnsupportedSchema(f"allOf (at {path}) gives the property '{name}' two schemas")
        required += [r for r in _list(part.get("required")) if r not in required]
    merged = {k: v for k, v in node.items() if k not in ("allOf", "properties", "required")}
    return {**merged, "type": "object", "properties": properties, **({"required": required} if required else {})}


def _check_values(node: dict, path: str) -> None:
    """Keywords whose malformed values outlines-core ignores, refused by name: a count that is
    not a count, or a `required` that is not a list, constrained nothing at all."""
    for key in _COUNTS:  # 10.0 is an integer to JSON Schema (written as 10 for outlines-core)
        v = node.get(key, 0)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not float(v).is_integer() or v < 0:
            raise UnsupportedSchema(f"'{key}' (at {path}) must be an integer >= 0, got {v!r:.60}")
    for lo, hi in (("minItems", "maxItems"), ("minLength", "maxLength")):
        if node.get(lo, 0) > node.get(hi, node.get(lo, 0)):
            raise UnsupportedSchema(f"'{lo}' {node[lo]} is above '{hi}' {node[hi]} (at {path}): no value fits")
    required = node.get("required", [])  # true or false: draft 3's own flag on a property, as before
    if not isinstance(required, (list, bool)) or not all(isinstance(r, str) for r in _list(required)):
        raise UnsupportedSchema(f"'required' (at {path}) must be an array of property names, got {required!r:.60}")
    for key in ("anyOf", "oneOf", "allOf"):
        if key in node and not (isinstance(node[key], list) and node[key]):
            raise UnsupportedSchema(f"'{key}' (at {path}) must be a non-empty array of schemas")
    if "enum" in node and not (isinstance(node["enum"], list) and node["enum"]):
        raise UnsupportedSchema(f"'enum' (at {path}) must be a non-empty array of values, got {node['enum']!r:.60}")
    kinds = node.get("type", "object")
    if not (isinstance(kinds, str) or isinstance(kinds, list) and kinds and all(isinstance(k, str) for k in kinds)):
        raise UnsupportedSchema(f"'type' (at {path}) must be a type name or a non-empty array of them, "
                                f"got {kinds!r:.60}")
    if not isinstance(node.get("format", ""), str):
        raise UnsupportedSchema(f"'format' (at {path}) must be a string, got {node['format']!r:.60}")


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
        parsed = re._parser.parse(pattern)  # the tree re.compile builds (parsed again: it keeps none)
    except re.error as e:
        raise UnsupportedSchema(f"{what} ({pattern[:100]!r}) is not a valid regex: {e}") from None
    limit = max(MAX_REGEX_WEIGHT, 16 * len(pattern))  # without counted repetitions a regex never reaches it
    try:
        weight = regex_weight(parsed, limit)
    except BackReference:
        raise UnsupportedSchema(f"{what} ({pattern[:100]!r}) uses back-references, which structured output "
                                f"cannot enforce") from None
    if weight > limit:
        raise UnsupportedSchema(f"{what} ({pattern[:100]!r}) is too large to compile: its counted repetitions "
                                f"({{m,n}}) spell out more than {limit:,} characters' worth (one of a "
                                f"broad class such as . or [^\"] counts 16); use smaller counts")


PATTERN_CHECK_SECONDS = 0.1  # a schema's enums' values against their patterns (maybe on the event loop)
# what prunes an enum's or const's values (outlines-core writes the values and ignores these)
_LISTED_CONSTRAINTS = {"type", "minLength", "maxLength", "pattern", *_BOUNDS}
_IS_TYPE = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: not isinstance(v, bool) and (isinstance(v, int) or isinstance(v, float) and v.is_integer()),
    "number": lambda v: not isinstance(v, bool) and isinstance(v, (int, float)),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


def _filter_listed(node: dict, path: str, walk: _Walk) -> dict:
    """An enum or const beside type, length, pattern or numeric bounds: the values they allow."""
    lo, lo_excl, hi, hi_excl = _bound(node, path)
    kinds = node.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else None
    pattern = node.get("pattern")

    def matches(v: str) -> bool:
        started = time.thread_time()  # this thread's CPU: a busy engine thread beside it does not count
        try:
            return timed_re.search(pattern, v, timeout=max(walk.pattern_seconds, 0.0)) is not None
        except TimeoutError:
            raise UnsupportedSchema(f"the patterns of the schema take more than {PATTERN_CHECK_SECONDS} s to check "
                                    f"against their enums' values (at {path})") from None
        except timed_re.error as e:
            raise UnsupportedSchema(f"the pattern at {path} is not a valid regex: {e}") from None
        finally:
            walk.pattern_seconds -= time.thread_time() - started

    def allowed(v) -> bool:
        if kinds is not None and not any(_IS_TYPE.get(k, lambda v: False)(v) for k in kinds):
            return False
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return (v > lo if lo_excl else v >= lo) and (v < hi if hi_excl else v <= hi)
        if isinstance(v, str):
            return (node.get("minLength", 0) <= len(v) <= node.get("maxLength", len(v))
                    and (pattern is None or matches(v)))
        return True

    out = {k: v for k, v in node.items() if k not in _LISTED_CONSTRAINTS and k != "const"}
    kept = [v for v in (node["enum"] if "enum" in node else [node["const"]]) if allowed(v)]
    if not kept:
        raise UnsupportedSchema(f"the type, length, pattern or bounds at {path} exclude every value of its "
                                "enum or const")
    out["enum"] = kept
    return out


def _required_properties(node: dict, path: str) -> dict:
    """A required property that `properties` does not name may hold any value (outlines-core
    would never write it); where additionalProperties is false, no object fits."""
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    missing = [r for r in node["required"] if isinstance(r, str) and r not in properties]
    if not missing:
        return node
    if node.get("additionalProperties") is False:
        raise UnsupportedSchema(f"'required' (at {path}) names {missing[0]!r}, which 'properties' does not "
                                "name and additionalProperties false forbids")
    return {**node, "properties": {**properties, **{name: {} for name in missing}}}


# ---- numeric ranges ----

# JavaScript's safe integers: zod writes .int() as these bounds, which mean "no bound" to its users
# (and would cost a grammar of 16-digit ends)
SAFE_INTEGER = 2 ** 53 - 1


def _bound(node: dict, path: str) -> tuple[float, bool, float, bool]:
    lo, lo_excl = -math.inf, False
    hi, hi_excl = math.inf, False
    for key in _BOUNDS:
        v = node.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise UnsupportedSchema(f"'{key}' (at {path}) must be a finite number")
        if (key, v) in (("minimum", -SAFE_INTEGER), ("maximum", SAFE_INTEGER)):
            continue
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
    try:
        regex = range_regex(lo, lo_excl, hi, hi_excl, integer)
    except TooCostly as e:
        raise UnsupportedSchema(f"the bounds at {path} make a grammar of integers that may end at {e}; structured "
                                f"output enforces ranges whose ends have at most {MAX_BOUND_DIGITS} significant "
                                f"digits, up to 10**{MAX_UPPER_DIGITS - 1} (the grammar's compile time grows steeply "
                                "with both): leave the bound out and check the value after") from None
    if not regex:
        raise UnsupportedSchema(f"the bounds at {path} leave no {'integer' if integer else 'number'} "
                                f"that structured output can write")
    return regex
