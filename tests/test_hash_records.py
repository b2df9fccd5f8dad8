"""Records kept as Redis hashes (jobs/redis/hash_codec.py): the job record, serve's batch
and file records, written and read by one codec; hashes the release before wrote still
read; serve's batch lifecycle refuses moves its table does not have."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from batchgen.jobs.ops.job_record import JobRecord
from batchgen.jobs.ops.lifecycle import JobState
from batchgen.jobs.redis import hash_codec
from batchgen.jobs.redis.keys import Keys
from batchgen.serve.api_keys import OPEN
from batchgen.serve.batch.batch_lifecycle import MOVES, BatchState, move
from batchgen.serve.batch.batch_record import BatchRecord, status
from batchgen.serve.files import FileObject, FileStore

JOB = JobRecord(
    id="20240101-000000-abcdef", state=JobState.RUNNING, model="m", queue="m", tag="t1",
    output="/out", output_token="tok", defaults={"top_p": 1.0, "max_tokens": 16},
    source="/in.jsonl", source_sha256="ab", total=10, enqueued=10, done=3, failed=1, skipped=2,
    prompt_tokens=30, completion_tokens=40, cached_tokens=5, created_at=1700000000.25,
    started_at=1700000001.5, storage_error="disk full", last_id="1-0", closed=True,
    retention_s=604800, finalize_attempts=1, finalize_retry_at=1700000002.125,
    model_fingerprint="sha256:ff", cache="/cache", retried=1, retry_rounds=1, retry_cursor=4,
    input_format="parquet", table='{"prompt_column": "q"}', kept_columns=["a", "b"],
)  # fmt: skip
# JOB's hash as the release before the codec wrote it (its to_hash, captured); it had
# no "id" field (the submit script added one).
JOB_HASH_BEFORE = {
    "cache": "/cache", "cached_tokens": "5", "closed": "1", "completion_tokens": "40",
    "created_at": "1700000000.25", "defaults": '{"max_tokens": 16, "top_p": 1.0}', "done": "3",
    "enqueued": "10", "error": "", "failed": "1", "finalize_attempts": "1",
    "finalize_retry_at": "1700000002.125", "finished_at": "0.0", "input_format": "parquet",
    "kept_columns": '["a", "b"]', "last_id": "1-0", "model": "m",
    "model_fingerprint": "sha256:ff", "output": "/out", "output_token": "tok",
    "prompt_tokens": "30", "queue": "m", "refused": "", "retention_s": "604800", "retried": "1",
    "retry_cursor": "4", "retry_rounds": "1", "skipped": "2", "source": "/in.jsonl",
    "source_sha256": "ab", "started_at": "1700000001.5", "state": "running",
    "storage_error": "disk full", "table": '{"prompt_column": "q"}', "tag": "t1", "total": "10",
}  # fmt: skip


# fields added since, at their defaults (cancelled rows; fair share, deadlines and usage;
# reasoning; tools)
JOB_HASH_ADDED = {
    "cancelled_rows": "0", "tenant": "", "priority": "0", "deadline": "0.0", "expire": "0",
    "est_input_tokens": "0", "cost": "0.0", "backlog": "0", "vtime": "0.0", "urgent": "0", "late": "0",
    "eta": "0.0", "engine_us": "0", "failed_prompt_tokens": "0",
    "reasoning_parser": "", "reasoning_tokens": "0", "tool_call_parser": "",
}  # fmt: skip


def test_the_job_record_writes_the_hash_it_wrote_before_and_reads_it_back() -> None:
    assert JOB.to_hash() == {**JOB_HASH_BEFORE, "id": JOB.id, **JOB_HASH_ADDED}
    as_redis = {k.encode(): v.encode() for k, v in JOB_HASH_BEFORE.items()}
    assert JobRecord.from_hash(JOB.id, as_redis) == JOB


def test_fields_a_hash_lacks_take_their_defaults() -> None:
    assert JobRecord.from_hash("j", {b"state": b"queued", b"total": b"", b"model": b""}) == (
        JobRecord(id="j")
    )
    # an HF model's fingerprint is left for the first worker to set (HSETNX)
    assert "model_fingerprint" not in JobRecord(id="j").to_hash()


BATCH = BatchRecord(
    id="batch_1", endpoint="/v1/chat/completions", input_file_id="file-1",
    metadata={"b": "2", "a": "1"}, created_at=100, expires_at=200, state=BatchState.EXPIRING,
    model="m", output="/o", errors=[{"code": "x", "message": "y", "param": None, "line": 3}],
    total=5, completed=4, failed=1, in_progress_at=101,
)  # fmt: skip
# BATCH as the release before states wrote it: a phase, a final status and two flags.
BATCH_HASH_BEFORE = {
    "cached_tokens": "0", "cancel_requested": "0", "cancelled_at": "0", "cancelling_at": "0",
    "completed": "4", "completed_at": "0", "completion_tokens": "0", "completion_window": "24h",
    "created_at": "100", "endpoint": "/v1/chat/completions", "error_file_id": "",
    "errors": '[{"code": "x", "message": "y", "param": null, "line": 3}]', "expired_at": "0",
    "expires_at": "200", "expiring": "1", "failed": "1", "failed_at": "0", "final_status": "",
    "finalizing_at": "0", "id": "batch_1", "in_progress_at": "101", "input_file_id": "file-1",
    "metadata": '{"b": "2", "a": "1"}', "model": "m", "output": "/o", "output_file_id": "",
    "phase": "submitted", "prompt_tokens": "0", "total": "5",
}  # fmt: skip


def test_a_batch_round_trips_and_one_written_before_states_reads_in_its_state() -> None:
    assert BatchRecord.from_hash(BATCH.to_hash()) == BATCH
    assert BatchRecord.from_hash(BATCH_HASH_BEFORE) == BATCH
    assert list(BatchRecord.from_hash(BATCH_HASH_BEFORE).metadata or {}) == ["b", "a"]


@pytest.mark.parametrize(
    ("old", "state"),
    [
        ({"phase": "validating"}, BatchState.VALIDATING),
        ({"phase": "validating", "cancel_requested": "1"}, BatchState.CANCELLING),
        ({"phase": "validating", "cancel_requested": "1", "final_status": "cancelled"},
         BatchState.CANCELLED),
        ({"phase": "failed", "cancel_requested": "1"}, BatchState.FAILED),
        ({"phase": "submitted", "expiring": "0"}, BatchState.SUBMITTED),
        ({"phase": "submitted", "expiring": "1"}, BatchState.EXPIRING),
        ({"phase": "submitted", "expiring": "1", "final_status": "expired"}, BatchState.EXPIRED),
        ({"phase": "submitted", "final_status": "completed"}, BatchState.COMPLETED),
    ],
)  # fmt: skip
def test_the_state_of_a_batch_written_before_states(old: dict, state: BatchState) -> None:
    assert BatchRecord.from_hash({"id": "b", **old}).state == state


def _job(state: JobState) -> JobRecord:
    return JobRecord(id="b", state=state)


@pytest.mark.parametrize(
    ("state", "job", "shown"),
    [
        (BatchState.VALIDATING, None, "validating"),
        (BatchState.CANCELLING, None, "cancelling"),
        (BatchState.FAILED, None, "failed"),
        (BatchState.SUBMITTED, None, "failed"),  # its job is gone
        (BatchState.SUBMITTED, JobState.QUEUED, "in_progress"),
        (BatchState.SUBMITTED, JobState.RUNNING, "in_progress"),
        (BatchState.SUBMITTED, JobState.FINALIZING, "finalizing"),
        (BatchState.SUBMITTED, JobState.COMPLETED, "finalizing"),
        (BatchState.SUBMITTED, JobState.CANCELLING, "cancelling"),
        (BatchState.SUBMITTED, JobState.CANCELLED, "cancelling"),
        (BatchState.EXPIRING, JobState.CANCELLING, "finalizing"),
        (BatchState.EXPIRING, JobState.CANCELLED, "finalizing"),
        (BatchState.COMPLETED, None, "completed"),
        (BatchState.CANCELLED, None, "cancelled"),
        (BatchState.EXPIRED, None, "expired"),
    ],
)
def test_openai_sees_the_status_strings_it_saw_before(
    state: BatchState, job: JobState | None, shown: str
) -> None:
    record = BatchRecord(id="b", state=state)
    assert status(record, None if job is None else _job(job)) == shown


def test_every_state_has_its_moves_and_the_final_ones_none() -> None:
    assert set(MOVES) == set(BatchState)
    assert {s for s, moves in MOVES.items() if not moves} == {
        BatchState.COMPLETED, BatchState.CANCELLED, BatchState.EXPIRED, BatchState.FAILED
    }  # fmt: skip


def rconn(url: str) -> Any:
    return redis.Redis.from_url(url)


def test_a_move_the_table_lacks_is_refused_and_changes_nothing(redis_url: str) -> None:
    conn = rconn(redis_url)
    key = Keys("bg").batch("batch_moves")
    conn.delete(key)
    conn.hset(key, mapping=BatchRecord(id="batch_moves").to_hash())
    assert move(conn, key, BatchState.EXPIRING, {"failed_at": "5"}) == (
        False, BatchState.VALIDATING)  # fmt: skip
    assert move(conn, key, BatchState.CANCELLING, {"cancelling_at": "7"}) == (
        True, BatchState.VALIDATING)  # fmt: skip
    assert move(conn, key, BatchState.SUBMITTED, {}) == (True, BatchState.CANCELLING)
    assert move(conn, key, BatchState.COMPLETED, {"completed_at": "9"}) == (
        True, BatchState.SUBMITTED)  # fmt: skip
    assert move(conn, key, BatchState.FAILED, {"failed_at": "10"}) == (False, BatchState.COMPLETED)
    stored = BatchRecord.from_hash(conn.hgetall(key))
    assert (stored.state, stored.cancelling_at, stored.completed_at, stored.failed_at) == (
        BatchState.COMPLETED, 7, 9, 0)  # fmt: skip
    assert move(conn, Keys("bg").batch("none"), BatchState.FAILED, {}) == (False, None)


def test_a_file_record_round_trips(redis_url: str, tmp_path) -> None:
    store = FileStore(rconn(redis_url), Keys("bg"), str(tmp_path))
    obj = store.register("file-x", "in.jsonl", "batch", 12, "team-a", 99)
    assert store.get("file-x", OPEN) == obj == FileObject(
        "file-x", 12, obj.created_at, "in.jsonl", "batch", "team-a", str(tmp_path), 99)  # fmt: skip
    # a file stored before tenants, stores and expiry: no tenant, store or expiry
    old = {"bytes": "3", "created_at": "5", "filename": "a", "purpose": "batch"}
    assert hash_codec.from_hash(FileObject, old, id="f") == FileObject("f", 3, 5, "a", "batch")


def test_a_batch_stored_before_states_is_served_and_moves_on(redis_url: str, tmp_path) -> None:
    """An upgraded server reads it in its state and stores that state, so that its moves
    (cancelling it, here) start from there."""
    from batchgen.serve.batch.batches import Batches
    from batchgen.serve.settings import ServeConfig

    conn = rconn(redis_url)
    keys = Keys("bg")
    config = ServeConfig(str(tmp_path / "files"), str(tmp_path / "out"), redis_url)
    batches = Batches(conn, keys, config, FileStore(conn, keys, config.files_dir))
    old = {**BATCH_HASH_BEFORE, "id": "batch_old", "phase": "validating", "expiring": "0"}
    conn.delete(keys.batch("batch_old"))
    conn.hset(keys.batch("batch_old"), mapping=old)
    assert batches.get("batch_old", OPEN)["status"] == "validating"
    assert conn.hget(keys.batch("batch_old"), "state") == b"validating"
    assert batches.cancel("batch_old", OPEN)["status"] == "cancelling"
    assert conn.hget(keys.batch("batch_old"), "state") == b"cancelling"
