"""Bad requests get a 4xx with the error envelope and leave the server serving; auth, CORS,
body size and backpressure on a `pageserve serve` subprocess."""

from __future__ import annotations

import contextlib
import json
import time

import httpx
import pytest

from tests.live_server import SubprocessServer

pytestmark = pytest.mark.server

MSG = [{"role": "user", "content": "hi"}]
CHAT, COMP, EMB = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"

# (route, body (a dict is sent as JSON, bytes as they are), status, param, words in the message)
BAD = [
    (CHAT, b"{not json", 400, None, "not valid JSON"),
    (CHAT, b"[1, 2, 3]", 400, None, "must be a JSON object"),
    (CHAT, b"", 400, None, "not valid JSON"),
    (CHAT, {}, 400, "messages", "required"),
    (CHAT, {"messages": []}, 400, "messages", "at least 1"),
    (CHAT, {"messages": "hello"}, 400, "messages", "valid list"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role", "'user'"),
    (CHAT, {"messages": [{"content": "x"}]}, 400, "messages.0.role", "required"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content", "valid"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}]},
     400, "messages.0.content.0", "not supported"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages.0.content.0.image_url.url", "required"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     400, "messages.0.content.0", "takes no images"),
    (CHAT, {"messages": MSG, "temperature": "hot"}, 400, "temperature", "valid number"),
    (CHAT, {"messages": MSG, "temperature": -1}, 400, "temperature", "greater than or equal"),
    (CHAT, {"messages": MSG, "top_p": 1.5}, 400, "top_p", "less than or equal"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    (CHAT, {"messages": MSG, "max_tokens": "10"}, 400, "max_tokens", "valid integer"),
    (CHAT, {"messages": MSG, "max_tokens": 5000}, 400, "max_tokens",
     "'max_tokens' is too large: 5000. This model's maximum context length is 2048 tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "hello " * 2100}]}, 400, "messages",
     "maximum context length is 2048 tokens. However, your request has 2"),
    (CHAT, {"messages": MSG, "model": "gpt-4o"}, 404, "model", "does not exist"),
    (CHAT, {"messages": MSG, "stream": "yes"}, 400, "stream", "valid boolean"),
    (CHAT, {"messages": MSG, "stop": [1, 2]}, 400, "stop", "valid"),
    (CHAT, {"messages": MSG, "seed": -3}, 400, "seed", "greater than or equal"),
    (CHAT, {"messages": MSG, "n": 0}, 400, "n", "greater than or equal"),
    (CHAT, {"messages": MSG, "stream_options": {"include_usage": 3}}, 400,
     "stream_options.include_usage", "valid boolean"),
    (CHAT, {"messages": MSG, "top_k": -5}, 400, "top_k", "greater than or equal"),
    (CHAT, {"messages": MSG, "stop": [""]}, 400, "stop", "non-empty"),
    (COMP, {"prompt": ""}, 400, "prompt", "at least 1 character"),
    (COMP, {"prompt": [[1, 2], []]}, 400, "prompt.1", "at least 1 item"),
    (COMP, {"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens", "integer"),
    (COMP, {"prompt": []}, 400, "prompt", None),
    (COMP, {"prompt": [1, 99999999]}, 400, "prompt", "outside the vocabulary"),
    (COMP, {"prompt": [1, -2]}, 400, "prompt.1", "greater than or equal to 0"),
    (COMP, {"prompt": {"text": "hi"}}, 400, "prompt", None),
    (COMP, {"prompt": "hi", "max_tokens": 10 ** 9}, 400, "max_tokens", "too large"),
    (COMP, {"prompt": "hi", "suffix": "bye"}, 400, "suffix", "not supported"),
    (COMP, {"model": "nope", "prompt": "hi"}, 404, "model", "does not exist"),
    (EMB, {}, 400, "input", "required"),
    (EMB, {"input": "hi", "encoding_format": "hex"}, 400, "encoding_format", "'float' or 'base64'"),
    ("/tokenize", {"prompt": "a", "messages": MSG}, 400, None, "exactly one"),
    ("/detokenize", {"tokens": [10 ** 9]}, 400, "tokens", "outside the vocabulary"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens", "valid list"),
    (CHAT, b'{"messages": ' + b"[" * 300 + b"]" * 300 + b"}", 400, None, "deeper than 64 levels"),
    (COMP, b'{"prompt": "hi", "model": ' + b"[" * 600 + b"]" * 600 + b"}", 400, None, "deeper than 64"),
    (CHAT, {"messages": MSG, "user_data": json.loads('{"a": ' * 64 + "1" + "}" * 64)}, 400, None,
     "deeper than 64"),
    (CHAT, b'{"messages": ' + b"[" * 2000 + b"]" * 2000 + b"}", 400, None, "not valid JSON"),
    (CHAT, {"messages": MSG, "stop": [f"s{i}" for i in range(65)]}, 400, "stop", "at most 64"),
    (CHAT, {"messages": MSG, "stop": "x" * 300}, 400, "stop", "at most 256"),
    (COMP, {"prompt": [[1]] * 3000}, 400, "prompt", "at most 2048"),
    (CHAT, {"messages": MSG, "logit_bias": {"99999999": 5}}, 400, "logit_bias", "outside the vocabulary"),
    (CHAT, {"messages": MSG, "logit_bias": {str(2 ** 64): 5}}, 400, "logit_bias", "token ids"),  # beyond int64
    (COMP, {"prompt": "hi", "stop_token_ids": [2 ** 64 - 1]}, 400, "stop_token_ids", "token ids"),
    (CHAT, {"messages": MSG, "logit_bias": {"5": 500}}, 400, "logit_bias", "[-100, 100]"),
    (CHAT, {"messages": MSG, "n": 500}, 400, "n", "less than or equal"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs", None),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs", "needs logprobs"),
    (COMP, {"prompt": "hi", "logprobs": 21}, 400, "logprobs", None),
    (CHAT, {"messages": MSG, "min_tokens": 10, "max_tokens": 5}, 400, "min_tokens", None),
    (CHAT, {"messages": MSG, "presence_penalty": 3}, 400, "presence_penalty", None),
    (CHAT, {"messages": MSG, "repetition_penalty": 0}, 400, "repetition_penalty", None),
    (CHAT, {"messages": MSG, "seed": 2 ** 70}, 400, "seed", None),
    (EMB, {"input": [[1]] * 3000}, 400, "input", "at most 2048"),
    (COMP, {"prompt": "hi", "n": 3, "best_of": 2}, 400, "best_of", "at least n (3)"),
    (COMP, {"prompt": "hi", "n": 2, "best_of": 3}, 400, "best_of", "does not rank"),
    (COMP, {"prompt": "hi", "n": 200, "best_of": 200}, 400, "n", "less than or equal"),
    (CHAT, {"messages": MSG, "continue_final_message": True, "add_generation_prompt": True}, 400, None,
     "cannot both be true"),
    ("/tokenize", {"messages": MSG, "continue_final_message": True, "add_generation_prompt": True}, 400, None,
     "cannot both be true"),
    ("/v1/responses", {"input": "hi", "include": ["foo.bar"]}, 400, "include.0", "message.output_text.logprobs"),
    # JSON text inside a string field, nested past the parser's recursion limit
    (CHAT, {"messages": MSG, "guided_json": "[" * 5000}, 400, "guided_json", "nested too deeply"),
    (COMP, {"prompt": "hi", "structured_outputs": {"json": "[" * 5000}}, 400, "structured_outputs.json",
     "nested too deeply"),
]


def _post(url: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
    return httpx.post(url, json=body, timeout=60)


def _assert_envelope(r: httpx.Response, status: int, param=None, words=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                           408: "timeout_error",
                           503: "server_error"}.get(status, "invalid_request_error")
    if param is not None:
        assert err["param"] == param, err
    if words is not None:
        assert words in err["message"], err["message"]
    assert "Traceback" not in err["message"]
    return err


@pytest.mark.parametrize("route,body,status,param,words", BAD,
                         ids=[f"{i}-{b[0].strip('/')}" for i, b in enumerate(BAD)])
def test_bad_request_then_a_good_one(server, route, body, status, param, words):
    _assert_envelope(_post(server.url + route, body), status, param, words)
    ok = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                    json={"model": server.model, "messages": MSG, "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None
    server.wait_idle()


def test_call_arguments_nested_past_the_recursion_limit_reach_the_template_as_text(server):
    """A past tool call's arguments are given to the chat template as an object where they parse;
    '[' * 5000 made the parser raise RecursionError, and the request a 500."""
    deep = "[" * 5000
    calls = [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}]},
             {"role": "tool", "content": "ok", "tool_call_id": "c1"}]
    r = httpx.post(f"{server.url}/tokenize", json={"model": server.model, "messages": calls}, timeout=60)
    assert r.status_code == 200 and r.json()["count"] > 100, r.text
    r = httpx.post(f"{server.url}/v1/responses", timeout=60, json={"model": server.model, "max_output_tokens": 2,
        "input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": deep},
                  {"type": "function_call_output", "call_id": "c1", "output": "ok"}]})
    _assert_envelope(r, 400, None, "maximum context length")  # the text's 5000 brackets, as tokens


def test_a_recursion_error_is_the_clients():
    from pageserve.app.http import engine_error

    assert engine_error(RecursionError()).status == 400


def test_unknown_fields_are_ignored_nulls_take_defaults_unknown_routes_enveloped(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": server.model, "messages": [{"role": "user", "content": "hi", "extra": 1}],
        "max_tokens": 2.0, "some_future_field": {"x": 1},  # an integral float is an integer
        "deep_but_allowed": json.loads('{"a": ' * 63 + "1" + "}" * 63)})  # 64 levels with the body
    assert r.status_code == 200
    nulls = {k: None for k in ("n", "stream", "presence_penalty", "frequency_penalty", "logprobs", "stop",
                               "min_tokens", "ignore_eos", "temperature", "top_p", "seed", "user")}
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": server.model, "messages": MSG, "max_tokens": 2, **nulls})
    assert r.status_code == 200, r.text
    r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        "model": server.model, "prompt": "hi", "echo": None, "max_tokens": None, **nulls})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 16
    _assert_envelope(httpx.get(f"{server.url}/v1/nothing-here"), 404)
    assert httpx.get(f"{server.url}/v1/chat/completions").status_code == 405


@pytest.fixture(scope="module")
def guarded(tiny_model_dir):
    srv = SubprocessServer(str(tiny_model_dir), "--dtype", "float32", "--kv-cache-memory", "0.01",
                           "--api-key", "key-one", "--allowed-origins", "http://good.example",
                           "--max-request-body-mb", "0.01", "--max-num-seqs", "1",
                           "--max-num-queued-reqs", "2", "--served-model-name", "tiny",
                           "--enable-lora", "--allow-runtime-lora-updating",  # every route of the table
                           "--allowed-hosts", "gpu-box.internal",
                           env={"PAGESERVE_API_KEY": "key-two"})
    yield srv
    assert srv.stop() == 0
    out = srv.output()
    assert "key-one" not in out and "key-two" not in out
    # start-up warmed every path and compiled the JSON grammar before it began to serve
    assert out.index("INFO pageserve.runtime.engine: warm-up: ") < out.index("grammar warm-up: ") \
        < out.index("serving tiny on")


def _auth(key):
    return {"Authorization": f"Bearer {key}"}


def test_api_keys(guarded):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    for headers in ({}, _auth("wrong"), {"Authorization": "key-one"}, _auth("key-one-and-more")):
        r = httpx.post(f"{guarded.url}/v1/completions", json=body, headers=headers)
        err = _assert_envelope(r, 401)
        assert err["code"] == "invalid_api_key"
    for key in ("key-one", "key-two"):  # the flag's and the environment's
        assert httpx.post(f"{guarded.url}/v1/completions", json=body, headers=_auth(key)).status_code == 200
    assert httpx.get(f"{guarded.url}/health").status_code == 200  # not under /v1
    assert httpx.get(f"{guarded.url}/v1/models").status_code == 401


def test_a_keys_prompts_hit_only_blocks_its_own_requests_wrote(guarded):
    """The prefix cache is salted by the key: another key's cached tokens in `usage` would
    confirm, a guess at a time, what that key had sent (a second reader's audit found it)."""
    secret = "The launch code is tangerine falcon forty two. " * 6

    def cached(key: str, salt: str | None = None, route: str = "/v1/completions") -> int:
        if route == "/v1/messages":
            r = httpx.post(f"{guarded.url}{route}", headers={"x-api-key": key, "anthropic-version": "2023-06-01"},
                           json={"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": secret}]})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["cache_read_input_tokens"]
        body = {"model": "tiny", "prompt": secret, "max_tokens": 1, **({"cache_salt": salt} if salt else {})}
        r = httpx.post(f"{guarded.url}{route}", json=body, headers=_auth(key))
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached("key-one")
    assert cached("key-one") >= 32  # its own blocks
    assert cached("key-two") == 0
    assert cached("key-two") >= 32
    cached("key-one", salt="shared")
    assert cached("key-two", salt="shared") == 0  # the same salt from another key: still apart
    cached("key-one", route="/v1/messages")
    assert cached("key-two", route="/v1/messages") == 0


def test_the_route_table_drives_router_openapi_and_auth(guarded):
    """Every route of the table is served, is in the OpenAPI document (so it is fuzzed), and
    asks for the key exactly when the table says so."""
    from pageserve.app.routes import ROUTES

    doc = httpx.get(f"{guarded.url}/openapi.json").json()
    assert set(doc["paths"]) == {r.path for r in ROUTES}
    for r in ROUTES:
        op = doc["paths"][r.path][r.method]
        assert ("security" in op) == (not r.open), r.path
        status = httpx.request(r.method.upper(), f"{guarded.url}{r.path}", json={}).status_code
        assert (status == 401) == (not r.open), (r.path, status)
        assert status not in (404, 405), (r.path, status)


def test_cors_only_for_allowed_origins(guarded):
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    ok = httpx.options(f"{guarded.url}/v1/completions", headers={"Origin": "http://good.example", **pre})
    assert ok.headers.get("access-control-allow-origin") == "http://good.example"
    bad = httpx.options(f"{guarded.url}/v1/completions", headers={"Origin": "http://evil.example", **pre})
    assert "access-control-allow-origin" not in bad.headers


def test_other_sites_pages_and_bodies_that_are_not_json_are_refused(guarded):
    """A web page may send a form or text/plain to any server, a local one included, with no
    CORS preflight: a browser's request from another site (Sec-Fetch-Site) is refused unless
    its origin is allowed, and a body declared as anything but JSON is refused (as vLLM does)."""
    url, raw = f"{guarded.url}/v1/completions", b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}'
    for site, origin, status in (("cross-site", "http://evil.example", 403),
                                 ("same-site", "http://localhost:3000", 403),
                                 ("cross-site", "http://good.example", 200), ("same-origin", guarded.url, 200)):
        r = httpx.post(url, content=raw, headers={**_auth("key-one"), "Origin": origin, "Sec-Fetch-Site": site,
                                                  "Content-Type": "application/json"})
        if status == 403:
            assert _assert_envelope(r, 403)["code"] == "origin_not_allowed" and origin in r.text
        else:
            assert r.status_code == 200, (site, origin, r.text)
    cross = {"Sec-Fetch-Site": "cross-site", "Origin": "http://evil.example"}
    assert httpx.post(f"{guarded.url}/v1/responses/x/cancel", headers={**_auth("key-one"), **cross}).status_code == 403
    r = httpx.post(f"{guarded.url}/v1/messages", json={}, headers={"Sec-Fetch-Site": "cross-site"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"  # Anthropic's shape
    r = httpx.post(f"{guarded.url}/v1/messages", content=b"{}", headers={**_auth("key-one"), "Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["type"] == "invalid_request_error"
    for media, status in (("text/plain;charset=UTF-8", 415), ("application/x-www-form-urlencoded", 415),
                          ("multipart/form-data; boundary=x", 415), ("application/json; charset=utf-8", 200),
                          ("application/vnd.api+json", 200), (None, 200)):
        headers = _auth("key-one") | ({} if media is None else {"Content-Type": media})
        r = httpx.post(url, content=raw, headers=headers)
        if status == 415:
            assert _assert_envelope(r, 415)["code"] == "unsupported_media_type" and media.split(";")[0] in r.text
        else:
            assert r.status_code == 200, (media, r.text)


def test_hosts_other_than_local_names_are_refused(guarded):
    """DNS rebinding: a page of evil.example, its name pointed at 127.0.0.1, is its own origin to
    the browser (Sec-Fetch-Site same-origin) and would read the answers; its requests name
    evil.example in Host and are refused, on every route. localhost, IP addresses and the names
    of --allowed-hosts are served."""
    port = guarded.url.rpartition(":")[2]
    for host in ("evil.example", f"evil.example:{port}", "EVIL.example.", "localhost.evil.example"):
        for method, path in (("GET", "/v1/models"), ("GET", "/"), ("POST", "/v1/completions")):
            r = httpx.request(method, f"{guarded.url}{path}", json={"model": "tiny", "prompt": "hi", "max_tokens": 1},
                              headers={**_auth("key-one"), "Host": host, "Sec-Fetch-Site": "same-origin"})
            assert _assert_envelope(r, 403)["code"] == "host_not_allowed", (host, path)
    r = httpx.post(f"{guarded.url}/v1/messages", json={}, headers={"Host": "evil.example"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"  # Anthropic's shape
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "[::1]", "app.localhost", "10.1.2.3:80",
                 f"gpu-box.internal:{port}", "GPU-BOX.internal"):
        r = httpx.get(f"{guarded.url}/v1/models", headers={**_auth("key-one"), "Host": host})
        assert r.status_code == 200, (host, r.text)


def test_host_check_where_the_server_binds():
    """Bound to a loopback address the server checks Host (only local names without
    --allowed-hosts); bound to every interface, only where --allowed-hosts is given."""
    from pageserve.app.cli import build_parser
    from pageserve.app.serve import _allowed_hosts

    def hosts(*argv):
        return _allowed_hosts(build_parser().parse_args(["serve", "tiny", *argv]))

    assert hosts() == () and hosts("--host", "::1") == () and hosts("--host", "localhost") == ()
    assert hosts("--host", "0.0.0.0") is None
    assert hosts("--host", "0.0.0.0", "--allowed-hosts", "a.example,B.example") == ("a.example", "b.example")


def test_body_too_large_is_413(guarded):
    big = {"model": "tiny", "prompt": "x" * 20_000, "max_tokens": 1}
    err = _assert_envelope(httpx.post(f"{guarded.url}/v1/completions", json=big, headers=_auth("key-one")), 413)
    assert err["code"] == "request_too_large"
    # chunked, with no Content-Length: counted while it is read
    chunks = (json.dumps(big)[i:i + 1000].encode() for i in range(0, 20_100, 1000))
    r = httpx.post(f"{guarded.url}/v1/completions", content=chunks,
                   headers={**_auth("key-one"), "content-type": "application/json"})
    _assert_envelope(r, 413)


def test_queue_full_is_503_with_retry_after(guarded):
    """Two requests waiting (--max-num-queued-reqs 2): the next is refused with 503 and
    Retry-After. They wait for a grammar that takes long to compile (an automaton that grows
    exponentially), so they stay queued however fast the machine runs the tiny model."""
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True, "stream": True}
    waits = {**body, "guided_regex": "[ab]*a[ab]{40}"}
    with httpx.Client(headers=_auth("key-one"), timeout=120) as client, contextlib.ExitStack() as stack:
        for _ in range(2):  # a streamed answer's headers come once the request is queued
            r = stack.enter_context(client.stream("POST", f"{guarded.url}/v1/completions", json=waits))
            assert r.status_code == 200
        refused = client.post(f"{guarded.url}/v1/completions", json={**body, "stream": False})
        err = _assert_envelope(refused, 503)
        assert refused.headers["retry-after"] == "1" and err["code"] == "server_overloaded"
        # the whole batch of prompts counts against the limit too; one over it alone never fits
        many = client.post(f"{guarded.url}/v1/completions", json={**body, "prompt": [[5]] * 2})
        _assert_envelope(many, 503)
        too_many = client.post(f"{guarded.url}/v1/completions", json={**body, "prompt": [[5]] * 3})
        assert _assert_envelope(too_many, 400)["param"] == "prompt"
    # the streams were closed: once the server has noticed (their requests are aborted within
    # a step of that), it serves again
    deadline = time.monotonic() + 10
    while True:
        ok = httpx.post(f"{guarded.url}/v1/completions", headers=_auth("key-one"), timeout=60,
                        json={"model": "tiny", "prompt": [5], "max_tokens": 2})
        if ok.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert ok.status_code == 200


def test_engine_death_turns_health_503_and_requests_get_errors(tiny_model_dir):
    from pageserve.runtime.engine_args import EngineArgs
    from tests.live_server import InProcessServer

    srv = InProcessServer(EngineArgs(model=str(tiny_model_dir), dtype="float32", kv_cache_memory=0.01))
    try:
        body = {"model": srv.model, "prompt": [5, 6, 7], "max_tokens": 4}
        assert httpx.post(f"{srv.url}/v1/completions", json=body).status_code == 200

        def broken_step():
            raise RuntimeError("injected fault")
        srv.engine.step = broken_step
        with httpx.stream("POST", f"{srv.url}/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            events = [l[6:] for l in r.iter_lines() if l.startswith("data: ")]
        assert events[-1] == "[DONE]" and "injected fault" in json.loads(events[-2])["error"]["message"]
        _assert_envelope(httpx.get(f"{srv.url}/health"), 503)
        _assert_envelope(httpx.post(f"{srv.url}/v1/completions", json=body), 503)
    finally:
        srv.stop()


def test_a_failed_step_fails_only_its_requests(tiny_model_dir):
    from pageserve.runtime.engine_args import EngineArgs
    from tests.live_server import InProcessServer

    srv = InProcessServer(EngineArgs(model=str(tiny_model_dir), dtype="float32", kv_cache_memory=0.01))
    runner = srv.engine.runner
    real = runner.execute
    faults = {"left": 0}

    def faulty(out):
        if faults["left"] and out.requests:
            faults["left"] -= 1
            raise RuntimeError("injected fault")
        return real(out)
    runner.execute = faulty
    srv.state.engine.request_timeout = 600  # a failed request's deadline goes with it
    dead = []
    srv.state.engine.on_dead.append(lambda: dead.append(True))
    try:
        body = {"model": srv.model, "prompt": [5, 6, 7], "max_tokens": 500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(l for l in lines if l.startswith("data: {"))
            faults["left"] = 1  # the next step fails
            events = [l[6:] for l in lines if l.startswith("data: ")]
        assert events[-1] == "[DONE]" and "injected fault" in json.loads(events[-2])["error"]["message"]
        srv.wait_idle()
        srv.engine.check_integrity()
        assert not srv.state.engine._deadlines
        ok = httpx.post(f"{srv.url}/v1/completions", json={**body, "stream": False, "max_tokens": 4}, timeout=60)
        assert ok.status_code == 200 and httpx.get(f"{srv.url}/health").status_code == 200
        faults["left"] = 1  # a whole answer: the server's own error, as a 500 envelope
        err = httpx.post(f"{srv.url}/v1/completions", json={**body, "stream": False, "max_tokens": 4}, timeout=60)
        assert err.status_code == 500 and err.json()["error"]["code"] == "engine_error"
        assert not dead
        faults["left"] = 10 ** 9  # a broken engine: after a few failed steps it is dead
        for _ in range(3):
            httpx.post(f"{srv.url}/v1/completions", json={**body, "stream": False, "max_tokens": 4}, timeout=60)
        assert dead and httpx.get(f"{srv.url}/health").status_code == 503
    finally:
        srv.stop()


def test_request_timeout_stops_long_requests_and_frees_their_blocks(tiny_model_dir):
    from pageserve.runtime.engine_args import EngineArgs
    from tests.live_server import InProcessServer

    srv = InProcessServer(EngineArgs(model=str(tiny_model_dir), dtype="float32", kv_cache_memory=0.01))
    srv.state.engine.request_timeout = 0.3
    slow = srv.engine.runner.execute

    def execute(out):  # a slow model: ~20 ms a step
        time.sleep(0.02)
        return slow(out)
    srv.engine.runner.execute = execute
    try:
        body = {"model": srv.model, "prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True}
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        err = _assert_envelope(r, 408)
        assert err["code"] == "request_timeout" and "--request-timeout" in err["message"]
        with httpx.stream("POST", f"{srv.url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
            events = [l[6:] for l in s.iter_lines() if l.startswith("data: ")]
        assert events[-1] == "[DONE]" and "--request-timeout" in json.loads(events[-2])["error"]["message"]
        srv.wait_idle()
        srv.engine.check_integrity()
        assert srv.engine.kv.pool.counts()[2] == 0
        quick = httpx.post(f"{srv.url}/v1/completions", json={**body, "max_tokens": 3}, timeout=60)
        assert quick.status_code == 200
    finally:
        srv.stop()
