"""A hostile prompts file costs `batchgen submit` bounded memory: the peak of the real
process (and of its validator processes), measured by the kernel or by polling
the whole process tree, against a real redis-server."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import redis

from batchgen.jobs.intake.inputs import MAX_LINE_BYTES
from batchgen.jobs.ops.fair_share import backlog
from batchgen.jobs.redis.keys import Keys, queue_tag

MiB = 1 << 20

# what submit says on stderr when no worker serves the model (and nothing else)
NO_WORKER_NOTE = ("batchgen: note: no worker serves m yet, so the job waits; start one with "
                  "`batchgen worker --model m`\n")  # fmt: skip

# Runs a command and records its exit status and the kernel's high-water RSS of the
# largest process below it (the submit, which waits for its validators).
WATCH = """
import json, resource, subprocess, sys

rc = subprocess.run(sys.argv[2:]).returncode
with open(sys.argv[1], "w") as f:
    json.dump({"rc": rc, "peak": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}, f)
"""


def submit_command(path: Path, redis_url: str, tmp_path: Path) -> list[str]:
    return [sys.executable, "-m", "batchgen", "submit", str(path), "--model", "m",
            "--output", str(tmp_path / "out"), "--redis", redis_url, "--json"]  # fmt: skip


def run_watched(command: list[str], tmp_path: Path, **env: str) -> tuple[int, int, str, str]:
    """(exit status, peak RSS in bytes, stdout, stderr) of ``command``."""
    record = tmp_path / "watch.json"
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        subprocess.run([sys.executable, "-c", WATCH, str(record), *command], check=True,
                       stdout=stdout, stderr=stderr, env={**os.environ, **env}, timeout=120)  # fmt: skip
    watched = json.loads(record.read_text())
    return watched["rc"], watched["peak"], out.read_text(), err.read_text()


def queued_entries(redis_url: str) -> list[dict]:
    conn: Any = redis.Redis.from_url(redis_url)
    qk = Keys("bg").queue(queue_tag("m"))
    return [json.loads(r) for job in conn.smembers(qk.active)
            for _, _, r in backlog.queued(conn, qk, job.decode())]  # fmt: skip


def test_an_8_mib_line_of_brackets_in_a_string_is_queued_in_bounded_memory(redis_url, tmp_path):
    path = tmp_path / "brackets.jsonl"
    head, tail = b'{"prompt": "', b'"}'
    body = (b"[{" * (MAX_LINE_BYTES // 2))[: MAX_LINE_BYTES - len(head) - len(tail)]
    path.write_bytes(head + body + tail + b"\n")  # exactly at the line limit
    rc, peak, out, err = run_watched(submit_command(path, redis_url, tmp_path), tmp_path)
    assert (rc, err) == (0, NO_WORKER_NOTE)
    assert json.loads(out)["total"] == 1
    [entry] = queued_entries(redis_url)
    assert entry["p"] == body.decode()
    assert peak < 400 * MiB, f"peak RSS {peak / MiB:.0f} MiB"  # was ~1 GB


def test_a_200_mb_file_without_a_newline_is_refused_in_bounded_memory(redis_url, tmp_path):
    path = tmp_path / "one-line.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"prompt": "')
        chunk = b"x" * MiB
        for _ in range(200):
            f.write(chunk)
    size = path.stat().st_size
    command = submit_command(path, redis_url, tmp_path)
    # several validator processes: the file is then cut at line boundaries first
    rc, peak, out, err = run_watched(command, tmp_path, BATCHGEN_SUBMIT_PROCS="8")
    assert (rc, out) == (2, "")
    assert err.splitlines() == [
        f"batchgen: error: {path}: 1 invalid line(s); nothing was enqueued. Fix them, or "
        "pass --skip-invalid to submit only the valid lines.",
        f"  line 1, column 1: line is {size:,} bytes, over the limit of {MAX_LINE_BYTES:,} bytes",
    ]
    assert peak < 200 * MiB, f"peak RSS {peak / MiB:.0f} MiB"  # was ~230 MiB
    assert queued_entries(redis_url) == []


def tree_memory(pid: int, stop: subprocess.Popen) -> int:
    """Peak of the summed proportional set size (shared pages split between the
    processes that share them) of ``pid`` and its descendants, polled until
    ``stop`` exits."""
    root, peak = psutil.Process(pid), 0
    while stop.poll() is None:
        total = 0
        try:
            processes = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                total += process.memory_full_info().pss
        peak = max(peak, total)
        time.sleep(0.005)
    return peak


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PSS is Linux's")
def test_validator_processes_parse_one_big_line_at_a_time(redis_url, tmp_path):
    # Five 8 MiB lines whose text Python holds at 4 bytes a character (one emoji,
    # escaped), each ~100 MB to parse, cut into five ranges for five processes.
    # Parsed at once they held ~500 MB; one at a time, ~175 MB (the processes' own
    # ~20 MB each, one parse, the lines waiting as bytes).
    path = tmp_path / "wide.jsonl"
    line = b'{"prompt": "\\ud83d\\ude00' + b"x" * (MAX_LINE_BYTES - 30) + b'"}\n'
    path.write_bytes(line * 5)
    command = submit_command(path, redis_url, tmp_path)
    env = {**os.environ, "BATCHGEN_SUBMIT_PROCS": "8"}
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) as p:
        peak = tree_memory(p.pid, p)
        out, err = p.communicate(timeout=120)
    assert (p.returncode, err.decode()) == (0, NO_WORKER_NOTE)
    assert json.loads(out)["total"] == 5
    assert [entry["p"][:2] for entry in queued_entries(redis_url)] == ["\U0001f600x"] * 5
    assert peak < 300 * MiB, f"peak PSS of the process tree {peak / MiB:.0f} MiB"
