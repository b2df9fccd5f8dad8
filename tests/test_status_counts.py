"""``batchgen status`` and ``jobs`` show counts that add up, as a user watches them: real
worker processes on a private Redis. In flight never exceeds what is not done and is 0
once the job stops running, whatever a stale heartbeat says; with no live worker the
ETA says so instead of climbing; cancelled rows are counted apart from failed ones; and
the count lines fit an 80-column terminal."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from batchgen.cli.status import _render
from batchgen.jobs.ops.job_record import JobRecord
from batchgen.jobs.ops.lifecycle import JobState
from batchgen.jobs.ops.status_report import JobStatus
from batchgen.jobs.redis.keys import Keys
from tests.cli_session import Shell, shells, wait_for, write_jsonl
from tests.hooks import hook_env

UNSERVED = "eta        - (no live worker serves the model)\n"


@pytest.fixture
def shell(tmp_path: Path, toy_model, private_redis) -> Iterator[Shell]:
    (tmp_path / "tiny").symlink_to(toy_model("llama"))
    yield from shells(tmp_path, tmp_path / "home", private_redis.url)


def submit(shell: Shell, job_id: str, n: int, max_tokens: int) -> None:
    write_jsonl(shell.cwd / f"{job_id}.jsonl",
                [{"prompt": f"tell me about {i}", "max_tokens": max_tokens} for i in range(n)])  # fmt: skip
    shell.ok("submit", f"{job_id}.jsonl", "--model", "tiny", "--job-id", job_id,
             "--output", str(shell.cwd / f"out-{job_id}"))  # fmt: skip


def ghost(shell: Shell, job_id: str, held: int) -> None:
    """The heartbeat a worker leaves when it was just killed: it still claims ``held``."""
    conn = redis.Redis.from_url(shell.env["BATCHGEN_REDIS_URL"])
    tag = Keys("bg").queue_for_model(str(shell.cwd / "tiny")).tag
    payload = {"name": "ghost", "tag": tag, "model": str(shell.cwd / "tiny"),
               "in_flight": {job_id: held}}  # fmt: skip
    conn.set("bg:worker:ghost", json.dumps(payload), ex=60)
    conn.zadd("bg:workers", {"ghost": time.time()})


def counts_of(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(("rows ", "requests "))]


def test_counts_add_up_while_workers_come_and_go(shell):
    # paced (a step >= 30 ms, a row >= 1.9 s, one at a time): the SIGTERM lands mid-job
    # however fast the machine (in tokens alone, each faster engine finished it first)
    submit(shell, "c", 8, 64)
    text = shell.ok("status", "c")
    assert counts_of(text) == ["rows       done 0, failed 0, cancelled 0",
                               "requests   in flight 0, queued 8"]  # fmt: skip
    assert UNSERVED in text  # nothing will move until a worker starts
    assert shell.status("c")["eta_s"] is None and shell.status("c")["unserved"] is True

    worker = shell.start("worker", "--model", "tiny", "--device", "cpu", "--max-num-seqs", "1",
                         extra_env=hook_env(step_s=0.03))  # fmt: skip
    wait_for(lambda: shell.status("c")["done"] >= 1, "a first row")
    worker.send_signal(signal.SIGTERM)  # gone mid-job: it hands back what it holds
    assert worker.wait(timeout=120) == 0
    status = shell.status("c")
    done = status["done"]
    assert status["state"] == "running" and 1 <= done < 8
    assert (status["in_flight"], status["queued"], status["eta_s"]) == (0, 8 - done, None)
    assert UNSERVED in shell.ok("status", "c")  # not an ETA that climbs as time passes
    assert "no worker" in shell.ok("status")

    ghost(shell, "c", 119)  # a stale heartbeat claims more than the job has left
    status = shell.status("c")
    assert (status["in_flight"], status["queued"]) == (8 - done, 0)

    burst = shell.start("worker", "--model", "tiny", "--device", "cpu", "--burst")
    assert burst.wait(timeout=300) == 0, (shell.cwd / "worker.log").read_text()[-3000:]
    ghost(shell, "c", 119)  # and again after the job finished
    text = shell.ok("status", "c")
    assert "state      completed\n" in text
    assert f"progress   [{'#' * 30}] 8/8 done\n" in text
    assert counts_of(text) == ["rows       done 8, failed 0, cancelled 0",
                               "requests   in flight 0, queued 0"]  # fmt: skip
    fixed = ("state", "progress", "rows", "requests", "eta")  # paths and names vary in length
    assert all(len(line) <= 80 for line in text.splitlines() if line.startswith(fixed))


def test_cancelled_rows_are_not_failed_ones(shell):
    submit(shell, "x", 5, 4)
    assert shell.ok("cancel", "x") == "x cancelling (a worker finalizes it)\n"
    shell.ok("finalize", "x")
    status = shell.status("x")
    assert (status["state"], status["done"], status["failed"], status["cancelled"]) == (
        "cancelled", 0, 0, 5)  # fmt: skip
    text = shell.ok("status", "x")
    assert counts_of(text) == ["rows       done 0, failed 0, cancelled 5",
                               "requests   in flight 0, queued 0"]  # fmt: skip
    # the bar shows done rows: cancelled ones are a segment of their own, not a full bar
    assert f"progress   [{'-' * 30}] 0/5 done\n" in text
    assert f"[{'-' * 20}] 0/5 done" in shell.ok("status").splitlines()[1]
    jobs = shell.ok("jobs").splitlines()
    assert jobs[0].split() == ["JOB", "STATE", "DONE", "FAILED", "CANCELLED", "TOTAL", "MODEL"]
    assert jobs[1].split()[:6] == ["x", "cancelled", "0", "0", "5", "5"]


def test_the_count_lines_fit_80_columns_at_a_billion_rows():
    big = 999_999_999
    record = JobRecord(id="j", state=JobState.RUNNING, model="m", total=big, enqueued=big,
                       done=big // 3, failed=big // 3, cancelled_rows=0, skipped=big // 10,
                       created_at=1.0, started_at=1.0)  # fmt: skip
    text = _render(JobStatus(record, in_flight=123_456_789, workers=["w"]))
    lines = [line for line in text.splitlines() if line.startswith(("rows", "requests", "invalid"))]
    assert len(lines) == 3 and all(len(line) <= 80 for line in lines), lines
