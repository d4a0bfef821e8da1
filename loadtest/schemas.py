"""Fifty JSON schemas for the structured-output tests and benchmark: nested objects, arrays
with min/max items, enums, integers and numbers with bounds, strings with patterns, formats
and lengths, required and optional keys, anyOf, const, nullable types and $defs."""

from __future__ import annotations


def _s(max_length: int = 24, **extra) -> dict:
    return {"type": "string", "maxLength": max_length, **extra}


def _obj(props: dict, required: list[str] | None = None, **extra) -> dict:
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required, "additionalProperties": False, **extra}


def _person(i: int) -> tuple[str, dict]:
    return (f"a person (#{i}) with a name and an age",
            _obj({"name": _s(20), "age": {"type": "integer", "minimum": 0, "maximum": 100 + i}}))


def _product(i: int) -> tuple[str, dict]:
    return (f"a product in a shop (#{i})", _obj({
        "id": {"type": "integer", "minimum": 1, "maximum": 10 ** (i % 5 + 2)},
        "price": {"type": "number", "minimum": 0, "maximum": 500 + i},
        "tags": {"type": "array", "items": _s(12), "minItems": 1, "maxItems": 3},
        "in_stock": {"type": "boolean"}}))


def _shirt(i: int) -> tuple[str, dict]:
    colors = ["red", "green", "blue", "black", "white"][: 2 + i % 4]
    return (f"a shirt (#{i})", _obj({"color": {"enum": colors}, "size": {"enum": ["S", "M", "L", "XL"]},
                                     "sleeves": {"enum": ["short", "long"]}}))


def _address(i: int) -> tuple[str, dict]:
    return (f"a postal address in a city (#{i})", _obj({
        "street": _s(30), "city": _s(20),
        "zip": {"type": "string", "pattern": r"^[0-9]{5}$"},
        "country": {"const": "FR"} if i % 2 else _s(16)}))


def _points(i: int) -> tuple[str, dict]:
    coord = {"type": "integer", "minimum": -10 - i, "maximum": 10 + i}
    return (f"a short path of points on a grid (#{i})", _obj({
        "points": {"type": "array", "items": _obj({"x": coord, "y": coord}), "minItems": 1,
                   "maxItems": 2 + i % 3}}))


def _optional(i: int) -> tuple[str, dict]:
    props = {"title": _s(30), "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
             "rating": {"type": "number", "exclusiveMinimum": 0, "maximum": 10},
             "genre": {"enum": ["drama", "comedy", "horror", "documentary"]}}
    required = [["title"], ["title", "year"], ["year"], ["title", "genre"]][i % 4]
    return (f"a film (#{i})", _obj(props, required))


def _code(i: int) -> tuple[str, dict]:
    return (f"a flight booking (#{i})", _obj({
        "flight": {"type": "string", "pattern": r"^[A-Z]{2}[0-9]{3,4}$"},
        "seat": {"type": "string", "pattern": r"^[0-9]{1,2}[A-F]$"},
        "date": {"type": "string", "format": "date"},
        "passengers": {"type": "integer", "minimum": 1, "maximum": 9}}))


def _nested(i: int) -> tuple[str, dict]:
    return (f"a company with its chief executive and office (#{i})", _obj({
        "company": _s(24),
        "ceo": _obj({"name": _s(20), "contact": _obj({"email": {"type": "string", "format": "email",
                                                                "maxLength": 40},
                                                      "phone": {"type": ["string", "null"],
                                                                "pattern": r"^\+?[0-9]{6,12}$"}},
                                                     ["email"])}),
        "office": _obj({"floor": {"type": "integer", "minimum": -2, "maximum": 50 + i},
                        "open": {"type": "boolean"}})}))


def _any_of(i: int) -> tuple[str, dict]:
    return (f"a measurement (#{i})", {
        "$defs": {"unit": {"enum": ["m", "cm", "mm", "km"]}},
        **_obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 1000},
                                    {"type": "string", "maxLength": 8}]},
                "unit": {"$ref": "#/$defs/unit"},
                "note": {"type": ["string", "null"], "maxLength": 20}}, ["value", "unit"])})


def _scores(i: int) -> tuple[str, dict]:
    return (f"test scores of a student (#{i})", _obj({
        "student": _s(20, minLength=2),
        "scores": {"type": "array", "items": {"type": "number", "minimum": -5.5, "maximum": 100},
                   "minItems": 2, "maxItems": 4},
        "grade": {"type": "string", "pattern": r"^[A-F][+-]?$"}}))


_MAKERS = [_person, _product, _shirt, _address, _points, _optional, _code, _nested, _any_of, _scores]


def fifty_schemas() -> list[tuple[str, dict]]:
    """(what to describe, schema) pairs, five variants of ten shapes."""
    return [_MAKERS[i % len(_MAKERS)](i) for i in range(50)]
