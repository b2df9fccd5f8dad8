"""A batch whose output files cannot be written is tried again with growing delays, by one
server at a time, and fails with the reason after FINISH_ATTEMPTS: it never loops. Real
Redis, the serve's own Batches and Sweep in this process, a job whose result is gone."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import redis

from batchgen.jobs.ops.job_record import JobRecord
from batchgen.jobs.ops.lifecycle import JobState
from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.redis.lease import Lease
from batchgen.serve.batch.batch_lifecycle import BatchState
from batchgen.serve.batch.batch_record import BatchRecord
from batchgen.serve.batch.batches import Batches
from batchgen.serve.files import FileStore
from batchgen.serve.settings import ServeConfig, expiry
from batchgen.serve.sweep import FINISH_ATTEMPTS, Sweep


def sweeper(redis_url: str, tmp_path: Path) -> tuple[Any, Keys, ServeConfig, Batches, Sweep]:
    """A server's Batches and Sweep on ``tmp_path``'s files dir (it validates nothing)."""
    conn: Any = redis.Redis.from_url(redis_url)
    keys = Keys("bg")
    config = ServeConfig(str(tmp_path / "files"), str(tmp_path / "out"), redis_url)
    batches = Batches(conn, keys, config, FileStore(conn, keys, config.files_dir))
    with ThreadPoolExecutor(1) as pool:
        sweep = Sweep(batches, lambda _: None, "test", pool)
    return conn, keys, config, batches, sweep


def test_a_batch_whose_outputs_cannot_be_written_fails_after_its_tries(redis_url, tmp_path):
    conn, keys, config, batches, sweep = sweeper(redis_url, tmp_path)
    record = BatchRecord(id="batch_broken", input_file_id="file-x", state=BatchState.SUBMITTED,
                         store=config.files_dir)  # fmt: skip
    conn.hset(keys.batch(record.id), mapping=record.to_hash())
    conn.sadd(keys.open_batches, record.id)
    job = JobRecord(
        id=record.id, state=JobState.COMPLETED, total=3, output=str(tmp_path / "no-such-output")
    )  # its result.parquet is gone
    delays = []
    for attempt in range(1, FINISH_ATTEMPTS):
        before = time.time()
        sweep.finish(batches.load(record.id), job)
        stored = batches.load(record.id)
        assert (stored.state, stored.finish_attempts) == (BatchState.SUBMITTED, attempt)
        delays.append(round(stored.finish_retry_at - before))
    assert delays == [2, 4, 8, 16, 32, 64, 128]  # growing, then the last try
    sweep.finish(batches.load(record.id), job)
    failed = batches.load(record.id)
    assert failed.state == BatchState.FAILED and failed.failed_at
    (error,) = failed.errors
    assert error["code"] == "output_failed"
    assert error["message"].startswith("its output files could not be written (8 tries): ")
    assert "no-such-output" in error["message"]
    assert not conn.sismember(keys.open_batches, record.id)


def test_only_the_lease_holder_writes_and_a_retry_waits_its_delay(redis_url, tmp_path):
    conn, keys, config, batches, sweep = sweeper(redis_url, tmp_path)
    record = BatchRecord(id="batch_held", state=BatchState.SUBMITTED, store=config.files_dir,
                         finish_retry_at=time.time() + 3600)  # fmt: skip
    conn.hset(keys.batch(record.id), mapping=record.to_hash())
    job = JobRecord(id=record.id, state=JobState.COMPLETED, total=1, output=str(tmp_path))
    conn.hset(keys.jobs, record.id, "t")
    conn.hset(keys.queue("t").job(record.id).job, mapping=job.to_hash())
    sweep.one(batches.load(record.id))  # its retry is an hour away: not tried
    assert batches.load(record.id).finish_attempts == 0
    conn.hset(keys.batch(record.id), "finish_retry_at", "0")
    with Lease(conn, keys.batch_lock(record.id), 30, "another server"):
        sweep.one(batches.load(record.id))  # another server holds the batch: not tried
    assert batches.load(record.id).finish_attempts == 0
    sweep.one(batches.load(record.id))  # now it is tried (and fails: no result.parquet)
    assert batches.load(record.id).finish_attempts == 1


def test_never_keeps_files_and_outputs():
    assert expiry("never", "--file-expiry") == 0 and expiry("30d", "--file-expiry") == 2592000
    from batchgen.serve.files import FileObject

    assert FileObject("f", 1, 2, "a", "batch").to_openai()["expires_at"] is None
