"""The dashboard's session, cross-site requests, DNS rebinding and the security headers,
against a live ``batchgen serve`` with raw HTTP requests (every header as a browser or
an attacker would send it)."""

from __future__ import annotations

import http.client
import json
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from batchgen.jobs.ops.job_record import load_job
from batchgen.jobs.ops.lifecycle import JobState
from batchgen.jobs.ops.submission import submit
from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.schema.sampling import DEFAULTS
from tests.serve_stack import KEY, Stack

EVIL = "http://evil.example"


@pytest.fixture
def stack(redis_url: str, tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(redis_url, tmp_path)
    try:
        stack.serve("--keys-file", str(_keys_file(tmp_path)))
        yield stack
    finally:
        stack.stop()


def _keys_file(tmp_path: Path) -> Path:
    (tmp_path / "keys.txt").write_text(f"{KEY} ops admin\n")
    return tmp_path / "keys.txt"


def call(stack: Stack, method: str, path: str, headers: dict[str, str] | None = None,
         body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=10)
    conn.request(method, path, body=body, headers=headers or {})
    reply = conn.getresponse()
    data = reply.read()
    conn.close()
    return reply.status, {k.lower(): v for k, v in reply.getheaders()}, data


def sign_in(stack: Stack) -> str:
    status, headers, _ = call(stack, "POST", "/login", {
        "Content-Type": "application/x-www-form-urlencoded", "Origin": stack.base,
    }, urllib.parse.urlencode({"key": KEY}).encode())  # fmt: skip
    assert status == 303
    cookie = headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie
    return cookie.split(";")[0]


def cli_job(stack: Stack, tmp_path: Path, job_id: str) -> Any:
    conn: Any = redis.Redis.from_url(stack.redis_url)
    (tmp_path / f"{job_id}.jsonl").write_text('{"prompt": "hi"}\n')
    submit(conn, Keys("bg"), source_path=str(tmp_path / f"{job_id}.jsonl"), model="m",
           output=str(tmp_path / f"out-{job_id}"), defaults=dict(DEFAULTS), job_id=job_id)  # fmt: skip
    return conn


def test_the_session_cookie_is_not_the_key_and_dies_at_sign_out(stack):
    cookie = sign_in(stack)
    assert KEY not in cookie
    assert call(stack, "GET", "/api/jobs", {"Cookie": cookie})[0] == 200
    conn: Any = redis.Redis.from_url(stack.redis_url)
    stored = [k for k in conn.keys("bg:serve:session:*")]
    assert len(stored) == 1 and cookie.split("=", 1)[1].encode() not in stored[0]  # a hash
    assert call(stack, "POST", "/logout", {"Cookie": cookie, "Origin": stack.base})[0] == 303
    status, _, body = call(stack, "GET", "/api/jobs", {"Cookie": cookie})
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    status, _, page = call(stack, "GET", "/", {"Cookie": cookie})
    assert status == 200 and b'id="login"' in page  # the sign-in form again
    assert conn.keys("bg:serve:session:*") == []
    # the raw key as a cookie (the old scheme) is no session
    assert call(stack, "GET", "/api/jobs", {"Cookie": f"batchgen_session={KEY}"})[0] == 401


def test_a_cross_site_request_changes_nothing(stack, tmp_path):
    conn = cli_job(stack, tmp_path, "victim")
    cookie = sign_in(stack)
    cancel = "/api/jobs/victim/cancel"
    for headers in (
        {"Cookie": cookie, "Origin": EVIL},  # a page on another site posts with the cookie
        {"Cookie": cookie, "Referer": EVIL + "/page"},  # a browser that sent no Origin
        {"Cookie": cookie},  # says nothing of where it comes from
        {"Authorization": f"Bearer {KEY}", "Origin": "null"},  # a sandboxed frame
        {"Cookie": cookie, "Origin": f"http://localhost:{stack.port}.evil.example"},
    ):
        status, headers_back, body = call(stack, "POST", cancel, headers)
        error = json.loads(body)["error"]
        assert (status, error["code"], error["type"]) == (
            403, "cross_site_request", "invalid_request_error"), headers  # fmt: skip
        assert headers_back["x-frame-options"] == "DENY"
    status, _, _ = call(stack, "POST", "/login", {"Origin": EVIL, "Content-Type":
                        "application/x-www-form-urlencoded"}, f"key={KEY}".encode())  # fmt: skip
    assert status == 403  # no signing a victim in to the attacker's session either
    assert load_job(conn, Keys("bg"), "victim").state == JobState.QUEUED
    # the dashboard's own request (same origin), and an API client (a key, no Origin)
    assert call(stack, "POST", cancel, {"Cookie": cookie, "Origin": stack.base})[0] == 200
    assert load_job(conn, Keys("bg"), "victim").state == JobState.CANCELLING
    cli_job(stack, tmp_path, "victim2")
    assert call(stack, "POST", "/api/jobs/victim2/cancel", {"Authorization": f"Bearer {KEY}"})[
        0] == 200  # fmt: skip


def test_every_response_carries_the_security_headers(stack):
    for method, path, headers in (("GET", "/", {}), ("GET", "/static/app.js", {}),
                                  ("GET", "/v1/files", {"Authorization": f"Bearer {KEY}"}),
                                  ("GET", "/v1/files", {})):  # fmt: skip
        _, got, _ = call(stack, method, path, headers)
        csp = got["content-security-policy"]
        assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp
        assert "'unsafe-inline'" not in csp
        assert (got["x-frame-options"], got["x-content-type-options"]) == ("DENY", "nosniff")
        assert got["referrer-policy"] == "same-origin"


def test_without_a_key_only_a_loopback_host_is_answered(redis_url: str, tmp_path: Path):
    """A page whose DNS name is rebound to 127.0.0.1 sends its own name as Host: refused."""
    stack = Stack(redis_url, tmp_path, env={"BATCHGEN_API_KEYS": ""})
    try:
        stack.serve()
        for host in ("evil.example", f"evil.example:{stack.port}", "127.0.0.1.evil.example",
                     f"192.168.1.7:{stack.port}"):  # fmt: skip
            status, _, body = call(stack, "GET", "/v1/files", {"Host": host})
            assert (status, json.loads(body)["error"]["code"]) == (421, "misdirected_request")
            assert call(stack, "POST", "/api/jobs/x/cancel", {"Host": host})[0] == 421
        for host in (f"127.0.0.1:{stack.port}", f"localhost:{stack.port}", "localhost",
                     f"[::1]:{stack.port}"):  # fmt: skip
            assert call(stack, "GET", "/v1/files", {"Host": host})[0] == 200, host
        # and a page on another site cannot post to it either
        status, _, _ = call(stack, "POST", "/api/jobs/x/cancel", {"Origin": EVIL})
        assert status == 403
    finally:
        stack.stop()


def test_a_session_lasts_a_day_at_most_and_ends_with_its_key(stack, tmp_path):
    status, headers, _ = call(stack, "POST", "/login", {
        "Content-Type": "application/x-www-form-urlencoded", "Origin": stack.base,
    }, urllib.parse.urlencode({"key": KEY}).encode())  # fmt: skip
    assert status == 303 and "Max-Age=86400" in headers["set-cookie"]
    cookie = headers["set-cookie"].split(";")[0]
    conn: Any = redis.Redis.from_url(stack.redis_url)
    (session,) = conn.keys("bg:serve:session:*")
    assert 86390 < conn.ttl(session) <= 86400
    assert call(stack, "GET", "/api/jobs", {"Cookie": cookie})[0] == 200
    stack.kill_server()  # the same server, its key taken out of its keys file
    (tmp_path / "keys.txt").write_text("sk-other ops admin\n")
    stack.serve("--keys-file", str(tmp_path / "keys.txt"), name="serve-2")
    assert conn.exists(session)  # the session is still stored, but its key is not served
    assert call(stack, "GET", "/api/jobs", {"Cookie": cookie})[0] == 401
