"""Output directories belong to one job: claimed and probed at submit, cleaned of its own parts only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import redis
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.jobs.ops.fair_share import backlog
from batchgen.jobs.ops.finalize.finalization import finalize
from batchgen.jobs.ops.job_record import load_job
from batchgen.jobs.ops.submission import submit
from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.schema.errors import JobConflict
from batchgen.jobs.schema.rows import FinishReason, Row
from batchgen.jobs.schema.sampling import DEFAULTS
from batchgen.worker.consumer.queue import read_new
from batchgen.worker.consumer.sink import PartSink

KEYS = Keys("bg")
QK = KEYS.queue_for_model("m")


def rconn(url: str) -> Any:
    return redis.Redis.from_url(url)


def prompts(tmp_path: Path, n: int, name: str = "p") -> Path:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{name} {i}"}) + "\n" for i in range(n)))
    return path


def cli(*args: str) -> Any:
    return CliRunner().invoke(main, list(args))


def test_a_second_job_is_refused_a_directory_that_holds_another(redis_url, tmp_path):
    conn = rconn(redis_url)
    out = tmp_path / "shared"
    a = cli("submit", str(prompts(tmp_path, 3, "a")), "--model", "m", "--output", str(out),
            "--job-id", "A", "--redis", redis_url)  # fmt: skip
    assert a.exit_code == 0, a.output
    b = cli("submit", str(prompts(tmp_path, 2, "b")), "--model", "m", "--output", str(out),
            "--job-id", "B", "--redis", redis_url)  # fmt: skip
    assert b.exit_code == 1
    assert f"output directory {out} already belongs to job 'A'; give this job" in b.output
    assert conn.hget(KEYS.jobs, "B") is None and not conn.exists(QK.job("B").job)
    assert len(backlog.queued(conn, QK, "A")) == 3 and conn.hget(QK.job("B").job, "backlog") is None
    again = cli("submit", str(tmp_path / "a.jsonl"), "--model", "m", "--output", str(out),
                "--job-id", "A", "--json", "--redis", redis_url)  # fmt: skip
    assert json.loads(again.stdout)["resumed"] is True and len(backlog.queued(conn, QK, "A")) == 3
    # the same job id from another Redis (here: another key prefix) is another job
    with pytest.raises(JobConflict, match="the same job id, submitted to another Redis"):
        submit(conn, Keys("elsewhere"), source_path=str(tmp_path / "a.jsonl"), model="m",
               output=str(out), defaults=dict(DEFAULTS), job_id="A")  # fmt: skip
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "result.parquet").write_text("someone's data")
    c = cli("submit", str(prompts(tmp_path, 1, "c")), "--model", "m", "--output",
            str(tmp_path / "data"), "--redis", redis_url)  # fmt: skip
    assert c.exit_code == 1 and "is not empty (result.parquet, ...) and belongs to no" in c.output
    assert (tmp_path / "data" / "result.parquet").read_text() == "someone's data"


def test_resubmitting_a_job_with_another_output_is_refused(redis_url, tmp_path):
    src = str(prompts(tmp_path, 2))
    first = cli("submit", src, "--model", "m", "--output", str(tmp_path / "o1"), "--job-id",
                "j", "--redis", redis_url)  # fmt: skip
    assert first.exit_code == 0
    second = cli("submit", src, "--model", "m", "--output", str(tmp_path / "o2"), "--job-id",
                 "j", "--json", "--redis", redis_url)  # fmt: skip
    assert second.exit_code == 1
    assert f"job 'j' exists with output {tmp_path / 'o1'}, not {tmp_path / 'o2'}" in second.output
    assert not (tmp_path / "o2").exists()
    assert load_job(rconn(redis_url), KEYS, "j").output == str(tmp_path / "o1")


@pytest.mark.parametrize(
    "output, message",
    [
        ("{file}/out", "cannot write to output directory"),
        ("{file}", "exists and is not a directory"),
        ("s3://bucket/out?endpoint_override=127.0.0.1:1&scheme=http", "Could not connect"),
    ],
    ids=["under-a-file", "a-file", "store-down"],
)
def test_an_output_that_cannot_be_written_is_refused_before_anything_is_queued(
    redis_url, tmp_path, output, message
):
    (tmp_path / "file").write_text("x")
    out = output.format(file=tmp_path / "file")
    result = cli("submit", str(prompts(tmp_path, 2)), "--model", "m", "--output", out,
                 "--redis", redis_url)  # fmt: skip
    assert result.exit_code == 1 and message in result.output, result.output
    assert "Traceback" not in result.output
    assert rconn(redis_url).keys() == [KEYS.identity.encode()]  # this Redis's, no job's


def test_run_with_a_shared_redis_needs_the_jobs_output_directory(redis_url, tmp_path, toy_model):
    result = cli("run", str(prompts(tmp_path, 1)), "--model", str(toy_model("llama")), "-o",
                 str(tmp_path / "r.parquet"), "--redis", redis_url)  # fmt: skip
    assert result.exit_code == 2
    assert "run --job-output" in result.output and rconn(redis_url).dbsize() == 0


def commit_rows(conn, job_id: str, out: Path, n: int) -> None:
    sink = PartSink(QK, f"w-{job_id}")
    for d in read_new(conn, QK, "w", n, None):
        assert d.job_id == job_id
        sink.add(d, str(out), Row(index=d.index, text=f"{job_id}{d.index}",
                                  finish_reason=FinishReason.LENGTH))  # fmt: skip
    flushed = sink.flush(conn)
    assert flushed.commit is not None and flushed.commit.finished == [job_id]


def test_finalize_deletes_only_its_own_parts_even_when_two_jobs_share_a_directory(
    redis_url, tmp_path
):
    """Defense in depth: two jobs in one directory (a race on an object store, where
    the marker cannot be created atomically) still never delete each other's rows."""
    conn = rconn(redis_url)
    out = tmp_path / "shared"
    for job_id, n in (("A", 3), ("B", 2)):
        submit(conn, KEYS, source_path=str(prompts(tmp_path, n, job_id)), model="m",
               output=str(tmp_path / f"own-{job_id}"), defaults=dict(DEFAULTS), job_id=job_id)  # fmt: skip
        conn.hset(QK.job(job_id).job, "output", str(out))  # as if both had claimed it
    commit_rows(conn, "A", out, 3)
    commit_rows(conn, "B", out, 2)
    b_parts = sorted(p.name for p in (out / "parts" / "B").iterdir())
    assert finalize(conn, KEYS, "A") == "completed"
    assert pq.read_table(out / "result.parquet").column("text").to_pylist() == ["A0", "A1", "A2"]
    assert not (out / "parts" / "A").exists()
    assert sorted(p.name for p in (out / "parts" / "B").iterdir()) == b_parts  # untouched
    assert finalize(conn, KEYS, "B") == "completed"
    assert pq.read_table(out / "result.parquet").column("text").to_pylist() == ["B0", "B1"]
    assert load_job(conn, KEYS, "B").done == 2 and not (out / "parts").exists()


def test_s3_requests_give_up_on_a_store_that_does_not_answer():
    """Outputs and prompts on S3 get request timeouts the URI cannot carry; without them
    a hung store held a worker's part write for over a minute (test_object_store.py)."""
    from batchgen.jobs.storage.output_store import (
        S3_CONNECT_TIMEOUT_S,
        S3_REQUEST_TIMEOUT_S,
        open_uri,
    )

    fs, path = open_uri("s3://bucket/out?endpoint_override=127.0.0.1:1&scheme=http")
    options = fs.__reduce__()[1][0]
    assert (options["connect_timeout"], options["request_timeout"]) == (
        S3_CONNECT_TIMEOUT_S, S3_REQUEST_TIMEOUT_S
    ) == (5.0, 10.0)  # fmt: skip
    assert (options["endpoint_override"], options["scheme"], path) == (
        "127.0.0.1:1", "http", "bucket/out"
    )  # fmt: skip
