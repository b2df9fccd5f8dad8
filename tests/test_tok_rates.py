"""A finished job's tok/s is its tokens over its run, which starts at the first read of
one of its requests, not at its first commit. (While it runs, its tok/s and the chart's
are the workers' live rates: test_live_progress.py.)"""

from __future__ import annotations

from typing import Any

import redis

from batchgen.jobs.ops.job_record import JobRecord
from batchgen.jobs.ops.lifecycle import JobState
from batchgen.jobs.redis.keys import Keys

KEYS = Keys("bg")


def put(conn: Any, record: JobRecord) -> None:
    qk = KEYS.queue_for_model(record.model)
    record.tag = qk.tag
    conn.hset(KEYS.jobs, record.id, qk.tag)
    conn.hset(qk.job(record.id).job, mapping=record.to_hash())


def test_a_commit_dates_the_jobs_start_by_its_first_read(redis_url):
    """The rows of a commit were read before it: the job started then, not at the commit."""
    from batchgen.jobs.schema.rows import FinishReason, Row
    from batchgen.worker.consumer.commit import PartCommit, commit

    conn: Any = redis.Redis.from_url(redis_url)
    qk = KEYS.queue_for_model("m")
    put(conn, JobRecord(id="j", model="m", total=2, enqueued=2, created_at=1.0))
    rows = [Row(index=i, finish_reason=FinishReason.LENGTH, completion_tokens=5) for i in (0, 1)]
    commit(conn, qk, [PartCommit("j", "parts/j/a.parquet", rows, [], started=1000.25)])
    record = JobRecord.from_hash("j", conn.hgetall(qk.job("j").job))
    assert (record.state, record.started_at) == (JobState.FINALIZING, 1000.25)
