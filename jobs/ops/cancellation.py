"""cancel: stop a job; finished rows are kept, the rest become ``cancelled`` rows.

One atomic step marks the job ``cancelling``, drops its backlog (requests no
worker took yet), adds it to the queue's cancelled set and publishes ``cancel:JOB`` on the queue's events channel. Workers hear
it at once (their keeper thread listens; they also poll the set, and read it
again after every read of new entries): no request of the job is started after
that, and its in-flight requests are aborted before the next engine step; rows
of requests that finished in the step under way are kept. The job leaves the
cancelled set only once none of its entries remain in the stream. The
finalize task, queued here, closes the job (a commit that arrives later is
discarded and its part deleted) and writes the output with a ``cancelled`` row
for every input that has no committed row.
"""

from __future__ import annotations

import time

import redis

from batchgen.jobs.ops.finalize.finalize_tasks import enqueue_finalize
from batchgen.jobs.ops.job_record import queue_of_job
from batchgen.jobs.ops.lifecycle import CANCEL, JobState
from batchgen.jobs.redis.keys import Keys, text
from batchgen.jobs.schema.errors import JobConflict, JobNotFound


def cancel(conn: redis.Redis, keys: Keys, job_id: str) -> JobState:
    qk = queue_of_job(conn, keys, job_id)
    jk = qk.job(job_id)
    raw = CANCEL(conn, job=jk.job, cancelled=qk.cancelled, ready=qk.ready, backlogs=jk.backlogs,
                 job_id=job_id, events=qk.events, now=repr(time.time()))  # fmt: skip
    if not raw:
        raise JobNotFound(f"job {job_id!r} has no record (Redis lost its state?)")
    state = JobState(text(raw))
    if state == JobState.COMPLETED:
        raise JobConflict(f"job {job_id!r} is already {state.value}; nothing to cancel")
    if state == JobState.FINALIZING:
        raise JobConflict(
            f"job {job_id!r} already has every row and is being finalized; nothing to cancel"
        )
    if state == JobState.CANCELLING:
        enqueue_finalize(conn, keys, qk, job_id)
    return state
