"""Small pieces the benchmarks share."""

from __future__ import annotations

import json


def save_json(result: dict, path: str | None) -> dict:
    """Write the result where --output-json says (nowhere without it); returns it."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
    return result
