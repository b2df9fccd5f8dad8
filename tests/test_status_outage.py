"""`batchgen status` says when Redis refuses writes (the outage workers and serve wait
out, connection.py's RedisRefused): an outage line first, provoked on a real server
(OOM under maxmemory, READONLY as a replica, MISCONF after a failed snapshot); a
server busy with a script (BUSY) refuses status's own reads: one line, no traceback."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.jobs.redis.redis_server import RedisServer, free_port

OOM = ("outage     Redis refuses writes (OOM: command not allowed when used memory > "
       "'maxmemory'.); workers and serve wait and resume on their own, nothing is lost; "
       "raise maxmemory or free memory")  # fmt: skip
READONLY = ("outage     Redis refuses writes (READONLY: You can't write against a read only "
            "replica.); workers and serve wait and resume on their own, nothing is lost; the "
            "server is a replica now: point --redis at the primary")  # fmt: skip


def cli(url: str, *args: str) -> Any:
    env = {"BATCHGEN_PREFIX": "bg", "BATCHGEN_REDIS_WAIT": "0.5"}
    return CliRunner().invoke(main, [*args, "--redis", url], env=env)


def test_status_says_redis_refuses_writes_and_never_fails_on_it(
    private_redis: RedisServer, tmp_path: Path
):
    url = private_redis.url
    admin: Any = redis.Redis.from_url(url)
    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "hi"}\n')
    out = cli(url, "submit", str(source), "--model", "m", "--job-id", "j", "--output",
              str(tmp_path / "out"))  # fmt: skip
    assert out.exit_code == 0, out.output
    keys_before = sorted(admin.keys())
    healthy = cli(url, "status", "j")
    assert healthy.exit_code == 0 and healthy.stdout.startswith("job        j  (m)\n")
    assert sorted(admin.keys()) == keys_before  # the probe writes nothing

    admin.config_set("maxmemory", 1)
    try:
        shown = cli(url, "status", "j")
        assert shown.exit_code == 0, shown.output
        assert shown.stdout.split("\n")[:2] == [OOM, "job        j  (m)"]
        table = cli(url, "status")
        assert table.stdout.split("\n")[:2] == [OOM, f"{'JOB':<28} {'STATE':<11} {'PROGRESS':<44} "
                                                f"{'TOK/S':>8} {'ETA':>7}"]  # fmt: skip
        as_json = cli(url, "status", "j", "--json")
        assert json.loads(as_json.stdout)["job_id"] == "j"
        assert as_json.stderr == "batchgen: warning: " + OOM.removeprefix("outage     ") + "\n"
    finally:
        admin.config_set("maxmemory", 0)

    admin.replicaof("127.0.0.1", free_port())  # a primary demoted to a replica
    try:
        assert cli(url, "status", "j").stdout.split("\n")[:2] == [READONLY, "job        j  (m)"]
    finally:
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
    try:
        first = cli(url, "status", "j").stdout.split("\n")[0]
        assert first.startswith("outage     Redis refuses writes (MISCONF: Redis is configured "
                                "to save RDB snapshots")  # fmt: skip
        assert first.endswith("its last snapshot or AOF write failed: see the Redis log "
                              "(a full disk?)")  # fmt: skip
    finally:
        admin.config_set("dir", before)
        admin.config_set("save", "")

    admin.config_set("lua-time-limit", 20)
    busy = threading.Thread(target=_killed_busy_script, args=(url,))
    busy.start()
    try:
        time.sleep(0.3)
        refused = cli(url, "status", "j")
    finally:
        admin.script_kill()
        busy.join(10)
    assert refused.exit_code != 0 and refused.stdout == ""
    assert refused.stderr == (
        f"batchgen: error: Redis at {url} cannot serve now (BUSY Redis is busy running a "
        "script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.); try again when it can\n"
    )
    assert "outage" not in cli(url, "status", "j").stdout  # writes taken again


def _killed_busy_script(url: str) -> None:
    with pytest.raises(redis.ResponseError, match="Script killed by user"):
        redis.Redis.from_url(url).eval("local i = 0 while true do i = i + 1 end", 0)
