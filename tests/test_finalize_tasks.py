"""Finalize tasks: only batchgen's own function runs, per-model queues, retries that back off."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import redis
from click.testing import CliRunner
from rq import Callback, Queue
from rq.serializers import JSONSerializer

from batchgen.cli import main
from batchgen.jobs.ops.finalize import finalize_tasks as tasks
from batchgen.jobs.ops.job_record import load_job
from batchgen.jobs.ops.lifecycle import JobState
from batchgen.jobs.ops.maintenance import sweep
from batchgen.jobs.ops.submission import submit
from batchgen.jobs.redis.keys import Keys, QueueKeys
from batchgen.jobs.redis.lease import Lease
from batchgen.jobs.schema.rows import FinishReason, Row
from batchgen.jobs.schema.sampling import DEFAULTS
from batchgen.worker.consumer.commit import PartCommit, commit
from batchgen.worker.consumer.queue import read_new
from batchgen.worker.consumer.sink import PartSink

KEYS = Keys("bg")


def rconn(url: str) -> Any:
    return redis.Redis.from_url(url)


def ready_job(conn, tmp_path: Path, model: str, job_id: str, n: int = 2) -> tuple[Path, QueueKeys]:
    """A job of ``model`` whose every input has a committed row (state finalizing)."""
    src = tmp_path / f"{job_id}.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(n)))
    out = tmp_path / f"out-{job_id}"
    submit(conn, KEYS, source_path=str(src), model=model, output=str(out),
           defaults=dict(DEFAULTS), job_id=job_id)  # fmt: skip
    qk = KEYS.queue_for_model(model)
    sink = PartSink(qk, "w")
    for d in read_new(conn, qk, "w", n, None):
        row = Row(index=d.index, text=f"t{d.index}", finish_reason=FinishReason.LENGTH)
        sink.add(d, str(out), row)
    result = sink.flush(conn).commit
    assert result is not None and result.finished == [job_id]
    return out, qk


def test_only_batchgen_finalize_runs_anything_else_is_refused_and_never_imported(
    redis_url, tmp_path, monkeypatch, caplog
):
    """Anyone who can write to Redis could queue ``os.system``: rq would import and run it."""
    conn = rconn(redis_url)
    _, qk = ready_job(conn, tmp_path, "m", "j")
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "planted_mod.py").write_text(
        f"open({str(tmp_path / 'imported')!r}, 'w').write('x')\ndef run(*a, **k): pass\n"
    )
    monkeypatch.syspath_prepend(str(planted))
    queue = Queue(KEYS.finalize_queue(qk.tag), connection=conn, serializer=JSONSerializer)
    ran = tmp_path / "ran"
    queue.enqueue("os.system", f"touch {ran}", job_id="system")
    queue.enqueue("planted_mod.run", job_id="planted")
    queue.enqueue(tasks.FINALIZE_FUNC, "j", "bg", job_id="callback",
                  on_success=Callback("planted_mod.run"))  # fmt: skip
    queue.enqueue(tasks.FINALIZE_FUNC, "j", "bg", "extra", job_id="extra")
    # finalize_task under another dotted name (it once had one): refused all the same
    queue.enqueue("batchgen.jobs.tasks.finalize_task", "j", "bg", job_id="renamed")
    with caplog.at_level(logging.ERROR, logger="batchgen.jobs.ops.finalize.finalize_tasks"):
        tasks.run_pending(conn, KEYS, qk.tag)
    assert not ran.exists() and not (tmp_path / "imported").exists()
    assert "planted_mod" not in sys.modules
    refused = sorted(r.getMessage().split()[3] for r in caplog.records if "refused" in r.msg)
    assert refused == ["callback", "extra", "planted", "renamed", "system"]
    assert not any(conn.exists(f"rq:job:{name}") for name in refused)
    assert load_job(conn, KEYS, "j").state == JobState.FINALIZING  # none of them finalized it
    assert tasks.enqueue_finalize(conn, KEYS, qk, "j")
    assert tasks.run_pending(conn, KEYS, qk.tag) == 1
    assert load_job(conn, KEYS, "j").state == JobState.COMPLETED


def test_a_jobs_finalize_is_taken_only_by_workers_of_its_model(redis_url, tmp_path):
    conn = rconn(redis_url)
    _, qa = ready_job(conn, tmp_path, "model-a", "ja")
    _, qb = ready_job(conn, tmp_path, "model-b", "jb")
    assert tasks.enqueue_finalize(conn, KEYS, qa, "ja")
    assert tasks.enqueue_finalize(conn, KEYS, qb, "jb")
    assert tasks.run_pending(conn, KEYS, qa.tag) == 1  # a worker of model-a
    assert load_job(conn, KEYS, "ja").state == JobState.COMPLETED
    assert load_job(conn, KEYS, "jb").state == JobState.FINALIZING  # left to model-b's workers
    assert tasks.run_pending(conn, KEYS, qb.tag) == 1
    assert load_job(conn, KEYS, "jb").state == JobState.COMPLETED


def test_a_failing_finalize_backs_off_shows_in_status_and_never_gives_up(
    redis_url, tmp_path, monkeypatch
):
    monkeypatch.setenv("BATCHGEN_FINALIZE_RETRY_S", "0.2")
    conn = rconn(redis_url)
    out, qk = ready_job(conn, tmp_path, "m", "j")
    (out / "result.parquet").mkdir()  # the output cannot be written: a broken directory
    for attempt in range(1, 6):
        deadline = time.monotonic() + 10
        while not tasks.enqueue_finalize(conn, KEYS, qk, "j"):  # waits out the retry delay
            assert time.monotonic() < deadline
            time.sleep(0.02)
        before = time.time()
        tasks.run_pending(conn, KEYS, qk.tag)
        after = time.time()
        record = load_job(conn, KEYS, "j")
        assert (record.state, record.finalize_attempts) == (JobState.FINALIZING, attempt)
        delay = 0.2 * 2 ** (attempt - 1)  # doubles, from BATCHGEN_FINALIZE_RETRY_S
        retry_at = float(conn.hget(qk.job("j").job, "finalize_retry_at"))
        assert before + delay <= retry_at <= after + delay
        if time.time() < retry_at - 0.05:
            assert tasks.enqueue_finalize(conn, KEYS, qk, "j") is False  # too soon
        assert f"finalize failed (attempt {attempt}; retrying in" in record.error
        assert "result.parquet" in record.error
    assert attempt == 5 and record.state == JobState.FINALIZING  # never gives up
    status = CliRunner().invoke(main, ["status", "j", "--json", "--redis", redis_url])
    assert json.loads(status.output)["error"].startswith("finalize failed (attempt 5; retrying in")
    (out / "result.parquet").rmdir()  # fixed: `batchgen finalize` retries at once
    result = CliRunner().invoke(main, ["finalize", "j", "--redis", redis_url])
    assert result.exit_code == 0, result.output
    assert result.output == f"j: completed; output in {out}\n"
    record = load_job(conn, KEYS, "j")
    assert (record.state, record.error, record.done) == (JobState.COMPLETED, "", 2)
    assert pq.read_table(out / "result.parquet").column("text").to_pylist() == ["t0", "t1"]
    assert sorted(p.name for p in out.iterdir()) == [
        "batchgen-job.json",
        "manifest.json",
        "result.parquet",
    ]
    assert sweep(conn, KEYS, qk) == [] and not conn.sismember(qk.active, "j")


def test_batchgen_finalize_refuses_a_running_job_and_a_held_lease(redis_url, tmp_path):
    conn = rconn(redis_url)
    src = tmp_path / "r.jsonl"
    src.write_text('{"prompt": "p"}\n{"prompt": "q"}\n')
    submit(conn, KEYS, source_path=str(src), model="other", output=str(tmp_path / "o"),
           defaults=dict(DEFAULTS), job_id="running")  # fmt: skip
    result = CliRunner().invoke(main, ["finalize", "running", "--redis", redis_url])
    assert result.exit_code == 1
    assert "job 'running' is queued (0/2 rows); it is finalized once every input" in result.output
    _, qk = ready_job(conn, tmp_path, "m", "j")
    with Lease(conn, qk.job("j").finalizer, 30, "worker-7"):
        result = CliRunner().invoke(main, ["finalize", "j", "--redis", redis_url])
    assert result.exit_code == 1
    assert "job 'j' is being finalized right now by worker-7" in result.output
    assert load_job(conn, KEYS, "j").state == JobState.FINALIZING


@pytest.mark.parametrize("status", ["started", "finished", "failed"])
def test_a_task_whose_finalizer_is_gone_is_queued_again(redis_url, tmp_path, status):
    """rq's "started" lasts as long as the task's timeout; only the lease says who lives."""
    conn = rconn(redis_url)
    _, qk = ready_job(conn, tmp_path, "m", "j")
    assert tasks.enqueue_finalize(conn, KEYS, qk, "j")
    conn.hset("rq:job:bg-finalize-j", "status", status)
    conn.delete(KEYS.finalize_queue(qk.tag) and f"rq:queue:{KEYS.finalize_queue(qk.tag)}")
    lease = Lease(conn, qk.job("j").finalizer, 30, "alive")
    with lease:  # a finalizer at work: nothing is queued beside it
        assert tasks.enqueue_finalize(conn, KEYS, qk, "j") is False
    assert sweep(conn, KEYS, qk) == ["j"]  # no lease: the task is replaced and queued
    assert tasks.run_pending(conn, KEYS, qk.tag) == 1
    assert load_job(conn, KEYS, "j").state == JobState.COMPLETED


def test_commits_after_the_job_closed_are_discarded(redis_url, tmp_path):
    conn = rconn(redis_url)
    _, qk = ready_job(conn, tmp_path, "m", "j")
    assert tasks.enqueue_finalize(conn, KEYS, qk, "j")
    assert tasks.run_pending(conn, KEYS, qk.tag) == 1
    late = [Row(index=0, text="late", finish_reason=FinishReason.STOP)]
    result = commit(conn, qk, [PartCommit("j", "parts/j/late.parquet", late, ["1-1"])])
    assert result.closed == ["j"]
