"""A job's tok/s and the dashboard's chart agree: the chart's point for an interval is a
rate over the part of it the job ran, so a job shorter than an interval is not shown
slower than it ran (the chart peaked at 6,194 while the job read 9,251), and a job's
start is the first read of one of its requests, not its first commit."""

from __future__ import annotations

from typing import Any

import redis

from batchgen.jobs.ops.job_record import JobRecord
from batchgen.jobs.ops.lifecycle import JobState
from batchgen.jobs.ops.status_report import job_status
from batchgen.jobs.redis.keys import Keys
from batchgen.serve.series import RateSampler

KEYS = Keys("bg")


def put(conn: Any, record: JobRecord) -> None:
    qk = KEYS.queue_for_model(record.model)
    record.tag = qk.tag
    conn.hset(KEYS.jobs, record.id, qk.tag)
    conn.hset(qk.job(record.id).job, mapping=record.to_hash())


def test_a_job_shorter_than_an_interval_peaks_at_its_own_rate(redis_url):
    conn: Any = redis.Redis.from_url(redis_url)
    sampler = RateSampler(conn, KEYS, interval_s=5.0)
    put(conn, JobRecord(id="short", model="m", total=3, enqueued=3, created_at=90.0))
    assert sampler.sample(now=100.0) is None  # the first sample only sets the baseline
    # it ran from 100.5 (its first request read) to 103.5 and made 900 tokens
    put(conn, JobRecord(id="short", model="m", state=JobState.COMPLETED, total=3, enqueued=3,
                        done=3, completion_tokens=900, created_at=90.0, started_at=100.5,
                        finished_at=103.5))  # fmt: skip
    point = sampler.sample(now=105.0)
    assert point is not None
    assert point["jobs"] == {"short": 300.0} and point["fleet"] == 300.0  # not 900 / 5 s
    assert job_status(conn, KEYS, "short").tokens_per_s == 300.0


def test_a_job_made_and_finished_between_two_samples_has_its_point(redis_url):
    """A job created after the last sample (so not in its baseline) still gets its point."""
    conn: Any = redis.Redis.from_url(redis_url)
    sampler = RateSampler(conn, KEYS, interval_s=5.0)
    assert sampler.sample(now=100.0) is None
    put(conn, JobRecord(id="quick", model="m", state=JobState.COMPLETED, total=1, enqueued=1,
                        done=1, completion_tokens=50, created_at=101.0, started_at=101.5,
                        finished_at=102.0))  # fmt: skip
    point = sampler.sample(now=105.0)
    assert point is not None
    assert point["jobs"] == {"quick": 100.0} and point["fleet"] == 100.0
    assert job_status(conn, KEYS, "quick").tokens_per_s == 100.0
    # and nothing more once it made no more tokens
    assert sampler.sample(now=110.0) == {"t": 110.0, "fleet": 0, "jobs": {}, "workers": {}}


def test_a_commit_dates_the_jobs_start_by_its_first_read(redis_url):
    """The rows of a commit were read before it: the job started then, not at the commit."""
    from batchgen.jobs.consumer.commit import PartCommit, commit
    from batchgen.jobs.schema.rows import FinishReason, Row

    conn: Any = redis.Redis.from_url(redis_url)
    qk = KEYS.queue_for_model("m")
    put(conn, JobRecord(id="j", model="m", total=2, enqueued=2, created_at=1.0))
    rows = [Row(index=i, finish_reason=FinishReason.LENGTH, completion_tokens=5) for i in (0, 1)]
    commit(conn, qk, [PartCommit("j", "parts/j/a.parquet", rows, [], started=1000.25)])
    record = JobRecord.from_hash("j", conn.hgetall(qk.job("j").job))
    assert (record.state, record.started_at) == (JobState.FINALIZING, 1000.25)
