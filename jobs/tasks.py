"""rq glue: the finalize task, enqueued idempotently, run with the JSON serializer.

rq carries job-level tasks only (never one task per prompt). Both sides use
rq's JSONSerializer, so nothing read from Redis is ever unpickled; a task is
the dotted name of our own function plus JSON arguments.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from rq import Queue, SimpleWorker, get_current_job
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from batchgen.jobs.finalize import finalize
from batchgen.jobs.keys import Keys
from batchgen.jobs.lifecycle import JobState
from batchgen.jobs.records import queue_of_job

log = logging.getLogger(__name__)

FINALIZE_FUNC = "batchgen.jobs.tasks.finalize_task"
MAX_FINALIZE_ATTEMPTS = 3
_LIVE = (JobStatus.QUEUED, JobStatus.STARTED, JobStatus.DEFERRED, JobStatus.SCHEDULED)


def finalize_queue(conn: redis.Redis, keys: Keys) -> Queue:
    return Queue(keys.finalize_queue, connection=conn, serializer=JSONSerializer)


def enqueue_finalize(conn: redis.Redis, keys: Keys, job_id: str) -> bool:
    """Queue the job's finalize task unless one is queued, running or finished."""
    task_id = keys.finalize_task_id(job_id)
    try:
        existing = Job.fetch(task_id, connection=conn, serializer=JSONSerializer)
        status = existing.get_status()
    except NoSuchJobError:
        existing, status = None, None
    except Exception:  # an unreadable task record (e.g. planted): replace it
        log.warning("finalize task %s is unreadable; replacing it", task_id)
        conn.delete(f"rq:job:{task_id}")
        existing, status = None, None
    if existing is not None and (status in _LIVE or status == JobStatus.FINISHED):
        return False
    if existing is not None:
        existing.delete()
    finalize_queue(conn, keys).enqueue(
        FINALIZE_FUNC,
        job_id,
        keys.prefix,
        job_id=task_id,
        job_timeout=6 * 3600,
        result_ttl=86400,
        failure_ttl=7 * 86400,
        description=f"finalize {job_id}",
    )
    return True


def finalize_task(job_id: str, prefix: str) -> dict[str, Any]:
    """The rq entry point (JSON arguments in, a JSON result out)."""
    current = get_current_job()
    assert current is not None, "runs inside an rq worker"
    conn = current.connection
    keys = Keys(prefix)
    try:
        state = finalize(conn, keys, job_id)
    except Exception as exc:
        job_key = queue_of_job(conn, keys, job_id).job(job_id).job
        attempts = conn.hincrby(job_key, "finalize_attempts", 1)
        message = f"finalize failed: {exc}"
        if attempts >= MAX_FINALIZE_ATTEMPTS:
            conn.hset(
                job_key,
                mapping={
                    "state": JobState.FAILED.value,
                    "error": f"{message} (after {attempts} attempts; committed rows are kept)",
                },
            )
        else:
            conn.hset(job_key, "error", f"{message} (attempt {attempts}; will retry)")
        raise
    return {"job_id": job_id, "state": state}


class _TaskRunner(SimpleWorker):
    """rq's SimpleWorker without its own SIGINT/SIGTERM handlers.

    It runs inside a worker or supervisor that has handlers of its own; rq's
    would take a SIGTERM that arrives while a task runs and keep it from ours
    (the process then never stopped). A task in progress finishes either way.
    """

    def _install_signal_handlers(self) -> None:
        pass


def run_pending(conn: redis.Redis, keys: Keys) -> int:
    """Run every queued finalize task in this process; how many ran."""
    queue = finalize_queue(conn, keys)
    if queue.count == 0:
        return 0
    before = queue.count
    worker = _TaskRunner([queue], connection=conn, serializer=JSONSerializer)
    worker.work(burst=True, logging_level="WARNING", with_scheduler=False)
    return before - queue.count
