"""Every JSON the server writes, streamed or whole, goes through `dumps`: orjson, with the
three line breaks that JSON leaves raw (U+0085, U+2028, U+2029) written as escapes. Clients
that split an SSE stream into lines the way Python's str.splitlines does (httpx's
iter_lines, many hand-written readers) would otherwise cut an event in two."""

from __future__ import annotations

import orjson

_RAW_BREAKS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))


def dumps(obj) -> bytes:
    data = orjson.dumps(obj)
    # whole UTF-8 sequences (a lead byte is never a continuation byte), found only inside strings
    if b"\xe2\x80" in data or b"\xc2\x85" in data:
        for raw, escaped in _RAW_BREAKS:
            data = data.replace(raw, escaped)
    return data
