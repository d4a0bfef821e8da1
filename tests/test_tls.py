"""HTTPS with the --ssl-* flags (vLLM's): the server's certificate from a test CA, and mutual TLS
where a client must show a certificate of that CA. The certificates are made here with the
openssl command."""

from __future__ import annotations

import argparse
import shutil
import ssl
import subprocess
from pathlib import Path

import httpx
import pytest

from pageserve.app.serve import add_args, tls_options
from tests.live_server import SubprocessServer

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _signed(name: str, subject: str, ca: str, cwd: Path, ext: str | None = None) -> None:
    """name.key and name.pem, signed by ca.key / ca.pem."""
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=cwd)
    extra = []
    if ext is not None:
        (cwd / f"{name}.ext").write_text(ext)
        extra = ["-extfile", f"{name}.ext"]
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", *extra, cwd=cwd)


def _ca(name: str, cwd: Path) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}", cwd=cwd)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tls")
    _ca("ca", d)
    _ca("other-ca", d)
    _signed("server", "/CN=127.0.0.1", "ca", d, "subjectAltName=IP:127.0.0.1\n")
    _signed("client", "/CN=a-client", "ca", d)
    _signed("stranger", "/CN=a-stranger", "other-ca", d)
    return d


def _client_context(certs: Path, cert: str | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    if cert is not None:
        context.load_cert_chain(str(certs / f"{cert}.pem"), str(certs / f"{cert}.key"))
    return context


def _ns(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_args(parser)
    return parser.parse_args(list(flags))


@pytest.mark.unit
def test_the_flags_are_checked_before_the_model_loads(certs):
    key, cert, ca = (str(certs / f) for f in ("server.key", "server.pem", "ca.pem"))
    assert tls_options(_ns()) == {}
    assert tls_options(_ns("--ssl-keyfile", key, "--ssl-certfile", cert))["ssl_certfile"] == cert
    for flags, words in (
            (["--ssl-keyfile", key], "--ssl-keyfile and --ssl-certfile go together"),
            (["--ssl-ca-certs", ca], "need HTTPS"),
            (["--ssl-keyfile", key, "--ssl-certfile", cert, "--ssl-cert-reqs", "2"], "needs --ssl-ca-certs"),
            (["--ssl-keyfile", key, "--ssl-certfile", str(certs / "none.pem")], "is not a file"),
            # a key that is not the certificate's
            (["--ssl-keyfile", str(certs / "client.key"), "--ssl-certfile", cert], "cannot be used")):
        with pytest.raises(ValueError, match=words):
            tls_options(_ns(*flags))


@pytest.mark.server
@pytest.mark.slow
def test_https_with_client_certificates(certs, tiny_model_dir):
    srv = SubprocessServer(str(tiny_model_dir), "--dtype", "float32", "--kv-cache-memory", "0.01",
                           "--ssl-keyfile", str(certs / "server.key"), "--ssl-certfile", str(certs / "server.pem"),
                           "--ssl-ca-certs", str(certs / "ca.pem"), "--ssl-cert-reqs", "2",
                           verify=_client_context(certs, "client"))
    try:
        assert srv.url.startswith("https://")
        body = {"model": str(tiny_model_dir), "prompt": "hello", "max_tokens": 3, "temperature": 0}
        ok = httpx.post(srv.url + "/v1/completions", json=body, verify=_client_context(certs, "client"), timeout=60)
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 3
        for refused in (_client_context(certs),  # no client certificate
                        _client_context(certs, "stranger"),  # one from another CA
                        ssl.create_default_context()):  # a client that does not trust the server's CA
            with pytest.raises(httpx.HTTPError):
                httpx.post(srv.url + "/v1/completions", json=body, verify=refused, timeout=30)
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the HTTPS port
            httpx.post(srv.url.replace("https", "http") + "/v1/completions", json=body, timeout=30)
        again = httpx.get(srv.url + "/health", verify=_client_context(certs, "client"), timeout=30)
        assert again.status_code == 200
        assert "on https://127.0.0.1" in srv.output()
    finally:
        assert srv.stop() == 0
