"""batchgen delete leaves no trace of a job in Redis; finished jobs' state expires."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner
from rq.job import Job
from rq.serializers import JSONSerializer

from batchgen.cli import main
from batchgen.jobs.ops.fair_share import backlog
from batchgen.jobs.ops.finalize import finalize_tasks as tasks
from batchgen.jobs.ops.job_record import load_job
from batchgen.jobs.ops.maintenance import forget_expired
from batchgen.jobs.ops.submission import submit
from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.schema.rows import FinishReason, Row
from batchgen.jobs.schema.sampling import DEFAULTS
from batchgen.worker.consumer.queue import dead_letter, read_new
from batchgen.worker.consumer.sink import PartSink

KEYS = Keys("bg")
QK = KEYS.queue_for_model("m")


def rconn(url: str) -> Any:
    return redis.Redis.from_url(url)


def cli(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))


def everything(conn) -> dict[str, str]:
    """Every key and a dump of its contents (names, fields, members, entries, values)."""
    out = {}
    for raw in conn.scan_iter(count=1000):
        key = raw.decode()
        kind = conn.type(key).decode()
        if kind == "hash":
            value: Any = conn.hgetall(key)
        elif kind == "set":
            value = sorted(conn.smembers(key))
        elif kind == "zset":
            value = conn.zrange(key, 0, -1)
        elif kind == "list":
            value = conn.lrange(key, 0, -1)
        elif kind == "stream":
            value = conn.xrange(key)
        else:
            value = conn.get(key)
        out[key] = repr(value)
    return out


def mentions(conn, job_id: str) -> list[str]:
    """Keys that name the job, but its tombstone (which says it was deleted)."""
    return [k for k, dump in everything(conn).items()
            if (job_id in k or job_id in dump) and k != KEYS.deleted(job_id)]  # fmt: skip


def finished_job(conn, tmp_path: Path, job_id: str, n: int = 4, retention: int | None = None):
    """A completed job with a committed part, a dead letter and a finalize task behind it."""
    src = tmp_path / f"{job_id}.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"{job_id} {i}"}) + "\n" for i in range(n)))
    out = tmp_path / f"out-{job_id}"
    submit(conn, KEYS, source_path=str(src), model="m", output=str(out), defaults=dict(DEFAULTS),
           job_id=job_id, retention_s=retention)  # fmt: skip
    first, *rest = read_new(conn, QK, "w", n, None)
    row = Row(index=first.index, finish_reason=FinishReason.ERROR, error="dead-lettered: poison")
    dead_letter(conn, QK, first, "poison", "w", json.dumps(row.to_dict()))
    sink = PartSink(QK, "w")
    for d in rest:
        sink.add(d, str(out), Row(index=d.index, text="t", finish_reason=FinishReason.LENGTH))
    assert sink.flush(conn).commit.finished == [job_id]  # type: ignore[union-attr]
    assert tasks.enqueue_finalize(conn, KEYS, QK, job_id)
    assert tasks.run_pending(conn, KEYS, QK.tag) == 1
    return out


def test_delete_removes_every_trace_of_the_job_and_nothing_else(redis_url, tmp_path):
    conn = rconn(redis_url)
    out = finished_job(conn, tmp_path, "gone-job")
    keep = finished_job(conn, tmp_path, "kept-job")
    assert mentions(conn, "gone-job")  # record, errors, dead letters, rq task, index ...
    before = everything(conn)
    result = cli("delete", "gone-job", "--redis", redis_url)
    assert result.exit_code == 0, result.output
    here = re.escape(str(out))
    assert re.fullmatch(
        rf"deleted job gone-job: \d+ keys, 0 queued entries; its output folder {here} is kept "
        rf"\(`rm -r {here}` removes it\)\n", result.output)  # fmt: skip
    assert mentions(conn, "gone-job") == []
    # status says it was deleted, not that Redis lost its state; the tombstone expires
    status = cli("status", "gone-job", "--redis", redis_url)
    assert status.exit_code == 1
    assert re.fullmatch(
        r"batchgen: error: job 'gone-job' was deleted \(`batchgen delete` at "
        rf"\d{{4}}-\d\d-\d\d \d\d:\d\d UTC; its output {here} was kept\)\n", status.output)  # fmt: skip
    assert 0 < conn.ttl(KEYS.deleted("gone-job")) <= 7 * 24 * 3600
    # the other job's keys are untouched
    after = everything(conn)
    assert {k: v for k, v in before.items() if "kept-job" in k} == {
        k: v for k, v in after.items() if "kept-job" in k
    }
    assert load_job(conn, KEYS, "kept-job").done == 3
    # outputs stay without --outputs
    assert sorted(p.name for p in out.iterdir()) == [
        "batchgen-job.json", "manifest.json", "result.parquet"
    ]  # fmt: skip
    # --outputs takes the files and the empty directory; a stranger's file is kept
    (keep / "notes.txt").write_text("mine")
    result = cli("delete", "kept-job", "--outputs", "--redis", redis_url)
    assert result.exit_code == 0, result.output
    assert result.output.endswith(", 3 output files\n")
    assert sorted(p.name for p in keep.iterdir()) == ["notes.txt"]
    assert mentions(conn, "kept-job") == [] and not out.joinpath("parts").exists()
    cli("delete", "gone-job", "--outputs", "--redis", redis_url)  # index gone: not found
    assert out.exists()


def test_a_running_job_is_refused_unless_forced_then_its_entries_go(redis_url, tmp_path):
    conn = rconn(redis_url)
    src = tmp_path / "r.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(10)))
    submit(conn, KEYS, source_path=str(src), model="m", output=str(tmp_path / "o"),
           defaults=dict(DEFAULTS), job_id="live")  # fmt: skip
    held = read_new(conn, QK, "w", 3, None)  # a worker holds 3 (so it runs), 7 are queued
    result = cli("delete", "live", "--redis", redis_url)
    assert result.exit_code == 1 and "job 'live' is running; cancel it first" in result.output
    assert conn.xlen(QK.stream) + len(backlog.queued(conn, QK, "live")) == 10
    result = cli("delete", "live", "--force", "--outputs", "--redis", redis_url)
    assert result.exit_code == 0, result.output
    assert "10 queued entries" in result.output
    assert conn.xlen(QK.stream) == 0 and conn.xpending(QK.stream, "workers")["pending"] == 0
    assert mentions(conn, "live") == [] and not (tmp_path / "o").exists()
    # the worker that held entries finds the job gone: its rows are refused, parts deleted
    sink = PartSink(QK, "w")
    for d in held:
        sink.add(d, str(tmp_path / "o"), Row(index=d.index, finish_reason=FinishReason.STOP))
    flushed = sink.flush(conn)
    assert flushed.commit is not None and flushed.commit.missing == ["live"]
    assert list((tmp_path / "o" / "parts" / "live").iterdir()) == []  # its refused part went


def test_a_finished_jobs_state_expires_after_its_retention(redis_url, tmp_path):
    conn = rconn(redis_url)
    finished_job(conn, tmp_path, "short", retention=120)
    finished_job(conn, tmp_path, "default")
    jk = QK.job("short")
    for key in (jk.job, jk.errors, jk.dead):
        assert 110 <= conn.ttl(key) <= 120, key
    assert conn.exists(jk.parts) == 0 and conn.exists(jk.done) == 0  # gone at once
    default = QK.job("default")
    assert 7 * 86400 - 10 <= conn.ttl(default.job) <= 7 * 86400
    assert forget_expired(conn, KEYS, QK, now=time.time() + 60) == 0
    assert forget_expired(conn, KEYS, QK, now=time.time() + 121) == 1
    assert conn.hget(KEYS.jobs, "short") is None and conn.hget(KEYS.jobs, "default")


@pytest.mark.parametrize("bad", ["0", "30s", "7x", "-1d", "11000d"])
def test_a_retention_that_makes_no_sense_is_a_usage_error(redis_url, tmp_path, bad):
    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "a"}\n')
    result = cli("submit", str(src), "--model", "m", "--output", str(tmp_path / "o"),
                 "--retention", bad, "--redis", redis_url)  # fmt: skip
    assert result.exit_code == 2 and "--retention" in result.output
    assert rconn(redis_url).dbsize() == 0


def test_delete_forgets_a_finalize_task_rq_moved_to_its_failed_registry(redis_url, tmp_path):
    """A finalize whose rq worker was killed is moved to rq's failed registry, and that entry
    outlives the task's own hash: delete takes it too (the soak found one left)."""
    conn = rconn(redis_url)
    finished_job(conn, tmp_path, "abandoned")
    queue = tasks.finalize_queue(conn, KEYS, QK.tag)
    job = Job.fetch(KEYS.finalize_task_id("abandoned"), connection=conn, serializer=JSONSerializer)
    queue.finished_job_registry.remove(job)
    queue.failed_job_registry.add(job, ttl=3600, exc_string="killed")
    conn.delete(job.key)  # its hash expired before the registry's entry
    assert [k for k in mentions(conn, "abandoned") if k.startswith("rq:failed:")]
    assert cli("delete", "abandoned", "--redis", redis_url).exit_code == 0
    assert mentions(conn, "abandoned") == []
