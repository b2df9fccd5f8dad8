"""Periodic checks a worker runs for its queue: lost requests, stuck finalizes.

- A job whose stream holds no entry up to its ``last_id`` any more, but has
  fewer rows than inputs, lost entries (deleted while pending or before being
  read, e.g. by XTRIM). It moves to ``finalizing``; finalize writes error rows
  for the missing indices, so done + failed = total still holds.
- A job in ``finalizing`` or ``cancelling``, or finished but not yet cleaned up,
  gets its finalize task queued again unless one is queued or running (its
  lease is held) or it waits out a retry delay: the worker that completed it
  may have died before queuing it, a finalizer may have been killed mid-run,
  or the last attempt failed.
- A cancelled job leaves the cancelled set once none of its entries remain.
- Finished jobs whose state expired (their retention) leave the job index.
- Consumers of dead workers (no heartbeat, nothing pending, idle for long) are
  removed from the group, so restarts do not pile them up. Never one with
  pending entries: XGROUP DELCONSUMER would drop those for good.
"""

from __future__ import annotations

import time
from typing import Any

import redis

from batchgen.jobs.ops import job_index
from batchgen.jobs.ops.finalize.finalize_tasks import enqueue_finalize
from batchgen.jobs.ops.lifecycle import MARK_LOST, JobState
from batchgen.jobs.redis.keys import GROUP, Keys, QueueKeys, text

# States of an active job that need its finalize task: writing, or cleaning up after.
FINALIZE_STATES = {s.value for s in JobState if s.needs_finalize or s.terminal}


def sweep(conn: redis.Redis, keys: Keys, qk: QueueKeys) -> list[str]:
    """One pass over the queue's unfinished jobs; the jobs whose finalize was enqueued."""
    enqueued = []
    for raw in conn.smembers(qk.active):
        job_id = text(raw)
        jk = qk.job(job_id)
        state = text(MARK_LOST(conn, stream=qk.stream, job=jk.job))
        if state == "missing":
            conn.srem(qk.active, job_id)
            continue
        wants = state == "lost" or state in FINALIZE_STATES
        if wants and enqueue_finalize(conn, keys, qk, job_id):
            enqueued.append(job_id)
    for raw in conn.smembers(qk.cancelled):
        job_id = text(raw)
        last_id = text(conn.hget(qk.job(job_id).job, "last_id"))
        leftover = last_id and conn.xrange(qk.stream, "-", last_id, count=1)
        if not leftover and not conn.sismember(qk.active, job_id):
            conn.srem(qk.cancelled, job_id)
    forget_expired(conn, keys, qk)
    prune_consumers(conn, keys, qk)
    return enqueued


def forget_expired(conn: redis.Redis, keys: Keys, qk: QueueKeys, now: float | None = None) -> int:
    """Drop index entries of finished jobs whose state has expired (retention.py)."""
    gone = [text(j) for j in conn.zrangebyscore(qk.expiring, 0, now or time.time())]
    if not gone:
        return 0
    job_index.forget(conn, keys, gone)
    conn.hdel(keys.jobs, *gone)
    conn.zrem(qk.expiring, *gone)
    return len(gone)


def prune_consumers(
    conn: redis.Redis, keys: Keys, qk: QueueKeys, idle_ms: int = 600_000
) -> list[str]:
    """Remove dead workers' consumer entries that hold nothing; their names."""
    try:
        consumers: Any = conn.xinfo_consumers(qk.stream, GROUP)
    except redis.ResponseError:
        return []  # no stream or group yet
    removed = []
    for consumer in consumers:
        name = text(consumer["name"])
        if int(consumer["pending"]) or int(consumer["idle"]) < idle_ms:
            continue
        if conn.exists(keys.worker(name)):
            continue  # alive, just quiet
        conn.xgroup_delconsumer(qk.stream, GROUP, name)
        removed.append(name)
    return removed
