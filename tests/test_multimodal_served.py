"""Images through the real server: OpenAI's image_url parts (data: URLs) from the Python and
Node SDKs and the AI SDK, the Responses API's input_image, the prefix cache keyed by the image,
and a 400 naming the part for each bad input, the server serving on. http(s) image URLs:
refused unless the operator allows the host, and never fetched from private or loopback
addresses, redirects included."""

from __future__ import annotations

import base64
import io
import json
import shutil
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai
import pytest
import torch

from pageserve.loadtest.tiny_vlm import build_llava, random_image
from tests.live_server import ROOT, InProcessServer

pytestmark = pytest.mark.server

QUESTION = "Describe this image."


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def image_message(*urls: str, text: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         *({"type": "image_url", "image_url": {"url": u}} for u in urls)]}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from pageserve.runtime.engine_args import EngineArgs

    model_dir = build_llava(tmp_path_factory.mktemp("llava-served"))
    s = InProcessServer(EngineArgs(model=str(model_dir), dtype="float32", kv_cache_memory=0.01, max_model_len=256,
                                   limit_mm_per_prompt='{"image": 2}'), served_model_names=("llava",))
    yield s
    s.stop()


def hf_answer(model_dir, messages: list[dict], images: list) -> str:
    """HF's greedy answer to the conversation rendered by the same template."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    proc = AutoProcessor.from_pretrained(model_dir)
    text = proc.tokenizer.apply_chat_template(
        [{"role": m["role"], "content": "".join(p.get("text", "<image>") for p in m["content"])} for m in messages],
        tokenize=False, add_generation_prompt=True)
    inputs = proc(text=[text], images=images, return_tensors="pt", add_special_tokens=False)
    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=12)
    return proc.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_openai_client_image_url_gets_hfs_answer(server):
    image = random_image(1, 40, 50)
    messages = image_message(data_url(png(image)))
    want = hf_answer(server.settings.model_path, messages, [image])
    c = client(server)
    whole = c.chat.completions.create(model="llava", messages=messages, temperature=0, max_tokens=12)
    assert whole.choices[0].message.content == want
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="llava", messages=messages, temperature=0, max_tokens=12, stream=True) if ch.choices)
    assert streamed == want
    other = c.chat.completions.create(model="llava", messages=image_message(data_url(png(random_image(2, 40, 50)))),
                                      temperature=0, max_tokens=12)
    assert other.choices[0].message.content == hf_answer(server.settings.model_path, messages,
                                                         [random_image(2, 40, 50)])
    server.wait_idle()
    metrics = httpx.get(f"{server.url}/metrics").text
    count = next(line for line in metrics.splitlines() if line.startswith("pageserve:mm_encoder_seconds_count"))
    assert float(count.split()[-1]) >= 2


def test_jpeg_webp_gif_and_responses_input_image(server):
    image = random_image(3, 36, 36)
    c = client(server)
    answers = set()
    # MPO: a JPEG with a second picture (an Ultra HDR photo's gain map), which Pillow names apart
    for fmt, mime in (("JPEG", "image/jpeg"), ("WEBP", "image/webp"), ("GIF", "image/gif"), ("MPO", "image/jpeg")):
        buf = io.BytesIO()
        image.save(buf, format=fmt, **({"save_all": True, "append_images": [random_image(4, 18, 18)]}
                                       if fmt == "MPO" else {}))
        r = c.chat.completions.create(model="llava", messages=image_message(data_url(buf.getvalue(), mime)),
                                      temperature=0, max_tokens=8)
        assert r.choices[0].finish_reason in ("stop", "length")
        answers.add(fmt)
    raw = data_url(png(image))
    chat = c.chat.completions.create(model="llava", messages=image_message(raw), temperature=0, max_tokens=12)
    resp = c.responses.create(model="llava", temperature=0, max_output_tokens=12, input=[
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION},
                                     {"type": "input_image", "image_url": raw}]}])
    assert resp.output_text == chat.choices[0].message.content
    bad = httpx.post(f"{server.url}/v1/responses", timeout=60, json={
        "model": "llava", "input": [{"role": "user", "content": [
            {"type": "input_text", "text": QUESTION}, {"type": "input_image", "image_url": data_url(b"GIF89a broken")}]}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"
    assert "not an image this server reads" in bad.json()["error"]["message"]
    server.wait_idle()


def test_prefix_cache_hits_the_same_image_only(server):
    text = "The quick brown fox jumps over the lazy dog. Paged attention keeps the KV cache in fixed-size blocks."
    c = client(server)

    def ask(seed):
        r = c.chat.completions.create(model="llava", temperature=0, max_tokens=8,
                                      messages=image_message(data_url(png(random_image(seed, 40, 40))), text=text))
        return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens, r.usage.prompt_tokens

    first, cached0, n = ask(21)
    again, cached1, _ = ask(21)
    other, cached2, _ = ask(22)
    # the image's 16 tokens end the user turn: the repeat hits through them, the other image only before them
    assert again == first and cached1 >= n - 16
    assert cached2 < n - 16 - 8
    assert cached1 > cached2
    server.wait_idle()


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels (its data is a stub)."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


@pytest.mark.parametrize("content, status, message", [
    (image_message(data_url(b"not an image at all")), 400, "not an image this server reads"),
    (image_message("data:text/plain;base64,aGVsbG8="), 400, "holds text/plain, not an image"),
    (image_message("data:image/png;base64,@@@"), 400, "not valid base64"),
    (image_message("data:image/png,rawbytes"), 400, "must be base64"),
    (image_message(data_url(_png_header_only(7000, 7000))), 400, "7000x7000 pixels, more than the"),
    (image_message(data_url(_png_header_only(20000, 20000))), 400, "too many pixels, more than the"),
    (image_message(*[data_url(png(random_image(1, 8, 8)))] * 3), 400, "3 images in one prompt; this server takes at most 2"),
    (image_message("https://example.com/cat.png"), 400, "data: URLs only"),
    (image_message("ftp://example.com/cat.png"), 400, "data: URL (base64) or an http(s) URL"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}], 400,
     "'input_audio' are not supported"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], 400, "needs 'image_url'"),
])
def test_bad_images_get_a_400_naming_the_part(server, content, status, message):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"model": "llava", "messages": content, "max_tokens": 4})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"]
    assert error["param"] is None or error["param"].startswith("messages")
    ok = client(server).chat.completions.create(model="llava", messages=image_message(data_url(png(random_image(1, 9, 9)))),
                                                max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")
    server.wait_idle()


def test_base64_in_lines_or_unpadded_is_read_and_transparency_is_white(server):
    """Base64 as MIME writes it (76-character lines) or without its padding is the same image;
    what is transparent is white (as vLLM makes RGBA images), not the colours under it."""
    from PIL import Image

    from pageserve.app.media import MediaLoader, MediaSettings
    from pageserve.runtime.multimodal import image_digest, _rgb

    raw = png(random_image(5, 20, 20))
    text = base64.b64encode(raw).decode()
    loader = MediaLoader(MediaSettings())
    for body in ("\r\n".join(text[i:i + 76] for i in range(0, len(text), 76)), text.rstrip("=") + "\n"):
        assert loader._data_url("data:image/png;base64," + body, "p") == raw
    r = client(server).chat.completions.create(model="llava", max_tokens=2, messages=image_message(
        "data:image/png;base64," + "\n".join(text[i:i + 76] for i in range(0, len(text), 76))))
    assert r.choices[0].finish_reason in ("stop", "length")
    white = Image.new("RGB", (4, 4), (255, 255, 255))
    hidden_red = Image.new("RGBA", (4, 4), (255, 0, 0, 0))
    keyed = Image.new("P", (4, 4), 0)
    keyed.info["transparency"] = 0
    for image in (hidden_red, hidden_red.convert("LA"), keyed):
        assert image_digest(_rgb(image)) == image_digest(white), image.mode
    half = _rgb(Image.new("RGBA", (1, 1), (0, 0, 0, 128))).getpixel((0, 0))
    assert all(126 <= c <= 128 for c in half)


def test_processed_images_held_by_requests_in_flight_are_bounded(server):
    """A request holds its images' processor tensors until it ends: past what the server holds,
    a new one is a 503 with Retry-After (or a 400 when its own images are more); each share comes
    back when its tensors are freed."""
    import gc

    from pageserve.runtime.multimodal import ImagesHeldError

    engine, held = server.state.engine, server.state.engine.held_images
    text = "USER: <image>\nWhat is this? ASSISTANT:"
    _, items = engine.process_images(text, [random_image(6, 30, 30)], "messages")
    one = held.held
    assert one > 0
    limit, held.limit = held.limit, one * 3 // 2
    try:
        with pytest.raises(ImagesHeldError):
            engine.process_images(text, [random_image(7, 30, 30)], "messages")
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": "llava", "max_tokens": 2, "messages": image_message(data_url(png(random_image(8, 30, 30))))})
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        with pytest.raises(ValueError, match="more than the"):
            engine.process_images(text.replace("<image>", "<image><image>"), [random_image(7, 30, 30)] * 2, "m")
        del items
        gc.collect()
        assert held.held == 0
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": "llava", "max_tokens": 2, "messages": image_message(data_url(png(random_image(8, 30, 30))))})
        assert r.status_code == 200, r.text
        server.wait_idle()
        gc.collect()
        assert held.held == 0  # the request's share came back when it ended
    finally:
        held.limit = limit


def test_decompression_bomb_refused_before_decoding(server):
    """A 1-bit PNG of 64 M pixels is a few KB; its header alone refuses it."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (8000, 8000)).save(buf, format="PNG")
    assert len(buf.getvalue()) < 100_000
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"model": "llava", "messages": image_message(data_url(buf.getvalue())), "max_tokens": 4})
    assert r.status_code == 400 and "8000x8000 pixels" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages.0.content.1"  # the image part


def test_decoded_images_share_a_pixel_budget(server):
    """Decoded images are held until their prompt is made: a request's together past the
    budget is a 400 naming the image; one that would pass it beside another request's a 503
    with Retry-After; every pixel is given back when the request is done."""
    from pageserve.app.errors import APIError
    from pageserve.app.media import MediaLoader, MediaSettings

    saved = server.state.media
    loader = server.state.media = MediaLoader(MediaSettings(max_pixels_at_once=5000))
    try:
        def ask(*urls):
            return httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                              json={"model": "llava", "messages": image_message(*urls), "max_tokens": 2})
        one = data_url(png(random_image(3, 60, 60)))  # 3,600 pixels
        r = ask(one, one)
        assert r.status_code == 400 and "more than 5000 pixels together" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "messages.0.content.2" and loader.pixels_held == 0
        with loader.holding() as take:  # another request's images
            take(2000, "messages.0.content.1")
            r = ask(one)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["code"] == "server_overloaded" and loader.pixels_held == 2000
        assert ask(one).status_code == 200 and loader.pixels_held == 0
        with loader.holding() as late:  # a decode thread that outlives its cancelled request
            pass
        with pytest.raises(APIError, match="ended"):
            late(100, "messages.0.content.1")
        assert loader.pixels_held == 0
    finally:
        server.state.media = saved


def test_a_text_far_too_long_beside_an_image_is_refused_from_a_part(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": "llava", "max_tokens": 2,
        "messages": image_message(data_url(png(random_image(4, 20, 20))), text="hello world " * 200_000)})
    assert r.status_code == 400 and "has at least" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "messages"


def test_a_text_model_refuses_images(tiny_server):
    r = httpx.post(f"{tiny_server.url}/v1/chat/completions", timeout=60,
                   json={"model": tiny_server.model, "max_tokens": 4,
                         "messages": image_message(data_url(png(random_image(1, 8, 8))))})
    assert r.status_code == 400 and "takes no images" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages.0.content.1"


class _Images(BaseHTTPRequestHandler):
    """/cat.png: an image; /same: a redirect on the same host; /away: a redirect to 127.0.0.1."""
    body = b""

    def do_GET(self):
        if self.path == "/cat.png":
            self.send_response(200)
            self.send_header("Content-Length", str(len(self.body)))
            self.end_headers()
            self.wfile.write(self.body)
            return
        self.send_response(302)
        port = self.server.server_address[1]
        self.send_header("Location", "/cat.png" if self.path == "/same" else f"http://127.0.0.1:{port}/cat.png")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    _Images.body = png(random_image(5, 20, 20))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def test_ssrf_loopback_private_and_redirects_refused(server, image_host):
    """Even with the host allowed, 127.0.0.1 is refused; a host resolving to a private address is
    refused before any connection; a redirect to another host is refused, one on the same host
    followed. (A stub resolver plays DNS: images.example is the local image host, made to pass
    the public-address check so that the redirect rules are what is tested.)"""
    import asyncio

    from pageserve.app.errors import APIError
    from pageserve.app.media import MediaLoader, MediaSettings, is_public

    port = image_host

    async def resolve(host, _port):
        return {"images.example": ["127.0.0.1"], "internal.example": ["10.1.2.3"]}.get(host, [host])

    allowed = ("images.example", "internal.example", "127.0.0.1")
    real = MediaLoader(MediaSettings(allowed), resolve=resolve)
    stubbed = MediaLoader(MediaSettings(allowed), resolve=resolve,
                          public=lambda a: a == "127.0.0.1" or is_public(a))

    def refused(loader, url, message):
        with pytest.raises(APIError) as e:
            asyncio.run(loader.load(url, "messages.0.content"))
        assert e.value.status == 400 and message in e.value.message, e.value.message

    refused(real, f"http://127.0.0.1:{port}/cat.png", "private, loopback or link-local")
    refused(real, f"http://internal.example:{port}/cat.png", "private, loopback or link-local")
    refused(real, f"http://other.example:{port}/cat.png", "not allowed")
    refused(stubbed, f"http://images.example:{port}/away", "redirects to another host ('127.0.0.1')")
    assert asyncio.run(stubbed.load(f"http://images.example:{port}/same", "p")).size == (20, 20)
    assert asyncio.run(stubbed.load(f"http://images.example:{port}/cat.png", "p")).size == (20, 20)
    # and through the server, with 127.0.0.1 allowed by the operator: still refused
    server.state.media = MediaLoader(MediaSettings(("127.0.0.1",)))
    try:
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                       json={"model": "llava", "max_tokens": 4,
                             "messages": image_message(f"http://127.0.0.1:{port}/cat.png")})
    finally:
        server.state.media = MediaLoader(MediaSettings())
    assert r.status_code == 400 and "loopback" in r.json()["error"]["message"]


def test_node_openai_and_ai_sdk_send_images(server, tmp_path):
    node = shutil.which("node")
    assert node, "node is needed for this test (make test installs the npm packages)"
    image = random_image(7, 30, 40)
    file = tmp_path / "image.png"
    file.write_bytes(png(image))
    proc = subprocess.run([node, str(ROOT / "tests" / "node" / "images.mjs"), f"{server.url}/v1", "llava", str(file)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    want = hf_answer(server.settings.model_path, image_message("x"), [image])
    assert out == {"openai": want, "aisdk": want}
    server.wait_idle()


def test_bench_serve_random_mm(server, capsys):
    """vLLM's random-mm dataset: every request carries its images (chat endpoint), the prompt
    tokens the server counts include the images', and the report gives the encoder's share."""
    import argparse

    from pageserve.loadtest import bench_serve

    ns = bench_serve.add_args(argparse.ArgumentParser()).parse_args([
        "--base-url", server.url, "--dataset-name", "random-mm", "--random-input-len", "20",
        "--random-output-len", "4", "--num-prompts", "6", "--max-concurrency", "3", "--disable-tqdm",
        "--random-mm-base-items-per-request", "2", "--random-mm-bucket-config", "{(40, 30, 1): 0.5, (64, 64, 1): 0.5}",
        "--temperature", "0", "--output-png", "", "--save-detailed"])
    r = bench_serve.main(ns)
    assert (r["completed"], r["failed"], r["backend"]) == (6, 0, "openai-chat")
    assert all(n >= 20 + 2 * 16 for n in r["input_lens"])  # two images of 16 tokens each, and the text
    assert 0 < r["mm_encoder_seconds"] < r["engine_step_seconds"] and 0 < r["mm_encoder_share_of_steps"] < 1
    assert "vision encoder:" in capsys.readouterr().out
    with pytest.raises(ValueError, match="images only"):
        bench_serve.resolve(bench_serve.add_args(argparse.ArgumentParser()).parse_args(
            ["--dataset-name", "random-mm", "--random-mm-bucket-config", "{(8, 8, 4): 1.0}"]))
    with pytest.raises(ValueError, match="only the chat endpoint"):
        bench_serve.resolve(bench_serve.add_args(argparse.ArgumentParser()).parse_args(
            ["--dataset-name", "random-mm", "--endpoint", "completions"]))
    server.wait_idle()
