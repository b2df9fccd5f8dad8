"""The Redis password reaches no command line, no environment, no log and no output.

A real ``batchgen worker --redis redis://:PASSWORD@...`` (a supervisor and its two
engine processes) serves a job against a real password-protected redis-server;
then every process of the worker's session is read from /proc while they run.
The engine processes get their settings through a pipe (stdin), which is read
once and gone: unlike the environment, it is not inherited by anything they
start and not left readable in /proc/PID/environ, so both are checked.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from batchgen.jobs.ops.job_record import JobState, load_job
from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.redis.redis_server import RedisServer


def wait_until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.05)
    return value


def role(pid: int) -> str:
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    if b"batchgen.worker.supervisor.finalizer" in cmdline:
        return "finalizer"
    return "engine" if b"batchgen.worker.loop" in cmdline else "supervisor"


def session_processes(sid: int) -> list[int]:
    """Every live process of session ``sid`` (a worker started with start_new_session)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        state, _ppid, _pgrp, session = stat.rsplit(")", 1)[1].split()[:4]
        if int(session) == sid and state != "Z":
            pids.append(int(entry.name))
    return sorted(pids)


def test_the_redis_password_shows_in_no_process_log_status_or_manifest(
    private_redis: RedisServer, toy_model, tmp_path: Path
):
    password = secrets.token_hex(16)
    admin: Any = redis.Redis.from_url(private_redis.url)
    admin.config_set("requirepass", password)  # not on redis-server's own command line
    admin = redis.Redis.from_url(private_redis.url, password=password)
    url = f"redis://:{password}@127.0.0.1:{private_redis.port}/0"
    env = {**os.environ, "BATCHGEN_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}  # fmt: skip
    env.pop("BATCHGEN_REDIS_URL", None)
    cli = [sys.executable, "-m", "batchgen"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"line {i}"}) + "\n" for i in range(3)))
    out = tmp_path / "out"
    submitted = subprocess.run(
        [*cli, "submit", str(prompts), "--model", str(toy_model("llama")), "--job-id", "j",
         "--output", str(out), "--max-tokens", "3"],
        env={**env, "BATCHGEN_REDIS_URL": url}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr

    log = tmp_path / "worker.log"
    with open(log, "wb") as sink:
        worker = subprocess.Popen(
            [*cli, "worker", "--model", str(toy_model("llama")), "--device", "cpu",
             "--workers", "2", "--redis", url],
            env=env, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    try:
        wait_until(lambda: load_job(admin, Keys("bg"), "j").state == JobState.COMPLETED, 240,
                   "the job to complete")  # fmt: skip
        wait_until(lambda: admin.zcard("bg:workers") == 2, 120, "both engine processes' heartbeats")
        tree = session_processes(worker.pid)
        roles = sorted(role(pid) for pid in tree)
        # the supervisor, its two engine processes, and a finalizer if it has not exited yet
        assert roles in (["engine", "engine", "supervisor"],
                         ["engine", "engine", "finalizer", "supervisor"]), roles  # fmt: skip
        for pid in tree:
            for view in ("cmdline", "environ"):
                seen = Path(f"/proc/{pid}/{view}").read_bytes()
                assert password.encode() not in seen, f"/proc/{pid}/{view} holds the password"
        beats = [
            admin.get(f"bg:worker:{name.decode()}") for name in admin.zrange("bg:workers", 0, -1)
        ]
        assert len(beats) == 2 and all(password.encode() not in beat for beat in beats)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(120)
    assert worker.returncode == 0, log.read_text()
    text = log.read_text()
    assert text.count("serving ") == 2  # both engine processes logged here
    assert password not in text

    for command in (["status", "j", "--json"], ["status", "j"], ["jobs"], ["jobs", "--json"]):
        shown = subprocess.run([*cli, *command, "--redis", url], env=env, capture_output=True,
                               text=True, timeout=60)  # fmt: skip
        assert shown.returncode == 0, shown.stderr
        assert "j" in shown.stdout and password not in shown.stdout + shown.stderr
    manifest = (out / "manifest.json").read_text()
    assert json.loads(manifest)["counts"]["rows"] == 3 and password not in manifest
