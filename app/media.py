"""Images a request sends: data: URLs decoded, http(s) URLs fetched only from the hosts the
operator allows (--allowed-media-domains; none by default), never from a private, loopback or
link-local address (the connection goes to the address that was checked, so a second DNS answer
cannot redirect it), with a timeout, a byte cap and no redirect to another host. Each image's
size is read from its header and checked before its pixels are decoded (decompression bombs),
and decoding runs off the event loop."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import io
import ipaddress
import re
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from pageserve.app.errors import APIError, bad_request

# GIF: its first frame. MPO: a JPEG with more pictures after its first (Ultra HDR's gain map,
# a camera's multi-picture JPEG), which Pillow names apart: its first, as any JPEG decoder shows
FORMATS = {"PNG", "JPEG", "MPO", "WEBP", "GIF"}
_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*?);base64,", re.I)
MAX_REDIRECTS = 3
_SPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class MediaSettings:
    allowed_domains: tuple[str, ...] = ()  # hosts http(s) image URLs may name; none: data: URLs only
    max_image_bytes: int = 20 << 20
    max_pixels: int = 40_000_000  # an image's
    # the decoded images held at once, across requests, from decoding until their request's
    # prompt is made (8 images of 40 million pixels in one request took 3.65 GB)
    max_pixels_at_once: int = 160_000_000
    fetch_timeout: float = 10.0


def is_public(address) -> bool:
    return ipaddress.ip_address(address).is_global


class MediaLoader:
    """`resolve` and `public` are the DNS look-up and the address check (a test may stub them)."""

    def __init__(self, settings: MediaSettings, resolve=None, public=is_public):
        self.settings = settings
        self.resolve = resolve or _resolve
        self.public = public
        self.pixels_held = 0  # by the requests in holding()
        self._lock = threading.Lock()  # images decode in worker threads

    @contextlib.contextmanager
    def holding(self) -> Iterator[Callable[[int, str], None]]:
        """A request's images: `take(pixels, param)` before each is decoded; all are given back
        on exit. Images that together pass max_pixels_at_once are a 400; images that would pass
        it beside other requests' a 503 with Retry-After."""
        taken, closed = 0, False

        def take(pixels: int, param: str) -> None:
            nonlocal taken
            cap = self.settings.max_pixels_at_once
            with self._lock:
                if closed:  # the request is gone (cancelled while a decode thread went on)
                    raise APIError(503, "the request ended while its images were read", param)
                if taken + pixels > cap:
                    raise bad_request(f"the request's images have more than {cap} pixels together, more than "
                                      "this server decodes at once", param)
                if self.pixels_held + pixels > cap:
                    raise APIError(503, "the server is decoding other requests' images, as many pixels as it "
                                        "holds at once: retry", param, "server_overloaded", {"Retry-After": "1"})
                self.pixels_held += pixels
                taken += pixels
        try:
            yield take
        finally:
            with self._lock:
                self.pixels_held -= taken
                closed = True

    async def load(self, url: str, param: str, take: Callable[[int, str], None] = lambda pixels, param: None):
        """A decoded, checked PIL image from a data: or allowed http(s) URL (400 naming
        `param` otherwise); `take` (holding()'s) is given its pixels before they are decoded."""
        if url[:5].lower() == "data:":  # base64 read off the event loop (20 MB took it 0.12 s)
            return await asyncio.to_thread(lambda: self.decode(self._data_url(url, param), param, take))
        if url[:7].lower() == "http://" or url[:8].lower() == "https://":
            data = await self._fetch(url, param)
        else:
            raise bad_request("an image URL is a data: URL (base64) or an http(s) URL", param)
        return await asyncio.to_thread(self.decode, data, param, take)

    def _data_url(self, url: str, param: str) -> bytes:
        m = _DATA_URL.match(url)
        if m is None:
            raise bad_request("a data: URL for an image must be base64 (data:image/png;base64,...)", param)
        if m.group("mime") and not m.group("mime").lower().startswith("image/"):
            raise bad_request(f"the data: URL holds {m.group('mime')}, not an image", param)
        body = url[m.end():]
        if _SPACE.search(body):  # base64 in lines (MIME's 76 characters), as some clients write it
            body = _SPACE.sub("", body)
        if len(body) * 3 // 4 > self.settings.max_image_bytes:
            raise bad_request(f"the image is larger than {self.settings.max_image_bytes} bytes", param)
        body += "=" * (-len(body) % 4)  # and without its padding
        try:
            return base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError):
            raise bad_request("the data: URL is not valid base64", param) from None

    def decode(self, data: bytes, param: str, take: Callable[[int, str], None] = lambda pixels, param: None):
        """The image, its size checked from the header before its pixels are decoded."""
        from PIL import Image, UnidentifiedImageError

        try:
            image = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError:  # PIL's own limit, above ours
            raise bad_request(f"the image has too many pixels, more than the {self.settings.max_pixels} this "
                              "server decodes", param) from None
        except (UnidentifiedImageError, OSError, ValueError):
            raise bad_request("the data is not an image this server reads (PNG, JPEG, WebP or GIF)", param) from None
        if image.format not in FORMATS:
            raise bad_request(f"images in {image.format} are not taken (only PNG, JPEG, WebP and GIF)", param)
        w, h = image.size
        if w * h > self.settings.max_pixels:
            raise bad_request(f"the image has {w}x{h} pixels, more than the {self.settings.max_pixels} this "
                              "server decodes", param)
        take(w * h, param)
        try:
            image.seek(0)
            image.load()
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
            raise bad_request(f"the image could not be decoded: {e}", param) from None
        return image

    async def _fetch(self, url: str, param: str) -> bytes:
        import httpx

        allowed = self.settings.allowed_domains
        if not allowed:
            raise bad_request("this server takes images as data: URLs only (the operator allows http(s) "
                              "URLs from chosen hosts with --allowed-media-domains)", param)
        host = (urlsplit(url).hostname or "").lower()
        if host not in allowed:
            raise bad_request(f"images from {host!r} are not allowed (--allowed-media-domains)", param)
        timeout = httpx.Timeout(self.settings.fetch_timeout)
        async with httpx.AsyncClient(timeout=timeout, follow_redirects=False, trust_env=False) as client:
            try:
                for _ in range(MAX_REDIRECTS + 1):
                    parts = urlsplit(url)
                    if parts.scheme not in ("http", "https") or (parts.hostname or "").lower() != host:
                        raise bad_request(f"the image URL redirects to another host ({parts.hostname!r})", param)
                    address = await self._address(parts, param)
                    response = await asyncio.wait_for(self._get(client, parts, address), self.settings.fetch_timeout)
                    if response[0] in (301, 302, 303, 307, 308) and response[1]:
                        url = urljoin(url, response[1])
                        continue
                    if response[0] != 200:
                        raise bad_request(f"fetching the image gave HTTP {response[0]}", param)
                    return response[2]
            except (httpx.HTTPError, asyncio.TimeoutError, OSError) as e:
                raise bad_request(f"the image could not be fetched: {type(e).__name__}", param) from None
            except _TooLarge:
                raise bad_request(f"the image is larger than {self.settings.max_image_bytes} bytes", param) from None
        raise bad_request(f"the image URL redirects more than {MAX_REDIRECTS} times", param)

    async def _address(self, parts, param: str) -> str:
        """The host's address, every address it resolves to checked to be public."""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            addresses = await self.resolve(parts.hostname, port)
        except OSError:
            raise bad_request(f"the image host {parts.hostname!r} does not resolve", param) from None
        if not addresses or not all(self.public(a) for a in addresses):
            raise bad_request(f"the image host {parts.hostname!r} is a private, loopback or link-local "
                              "address, which this server does not fetch from", param)
        return addresses[0]

    async def _get(self, client, parts, address: str) -> tuple[int, str | None, bytes]:
        """GET from `address` itself (Host and TLS name the host): (status, Location, body)."""
        netloc = f"[{address}]" if ":" in address else address
        if parts.port:
            netloc += f":{parts.port}"
        target = parts._replace(netloc=netloc).geturl()
        host = parts.hostname + (f":{parts.port}" if parts.port else "")
        limit = self.settings.max_image_bytes
        async with client.stream("GET", target, headers={"Host": host},
                                 extensions={"sni_hostname": parts.hostname}) as response:
            if response.status_code != 200:
                return response.status_code, response.headers.get("location"), b""
            declared = response.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise _TooLarge
            chunks, size = [], 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > limit:
                    raise _TooLarge
                chunks.append(chunk)
            return 200, None, b"".join(chunks)


class _TooLarge(Exception):
    pass


async def _resolve(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]
