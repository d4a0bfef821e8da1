"""GET /: the chat page, one hand-written HTML file shipped inside the package
(app/static/chat.html), served with a content security policy that lets only its own inline
scripts run, so markup that slips into a rendered answer cannot execute."""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from importlib.resources import files

from starlette.requests import Request
from starlette.responses import Response

_SCRIPT = re.compile(r"<script>(.*?)</script>", re.S)


@functools.cache
def _page() -> tuple[bytes, dict[str, str]]:
    html = (files("pageserve.app") / "static" / "chat.html").read_text(encoding="utf-8")
    hashes = " ".join("'sha256-%s'" % base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()
                      for s in _SCRIPT.findall(html))
    # connect-src is open: the page may talk to another pageserve (?api=...), which CORS guards
    csp = (f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; img-src data:; "
           "connect-src *; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
    return html.encode(), {"Content-Security-Policy": csp, "X-Content-Type-Options": "nosniff",
                           "Cache-Control": "no-cache"}


async def chat_page(request: Request) -> Response:
    body, headers = _page()
    return Response(body, media_type="text/html", headers=headers)
