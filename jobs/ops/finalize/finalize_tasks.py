"""rq glue: finalize tasks, queued per model, run by workers of that model only.

rq carries job-level tasks only (never one task per prompt), with its JSON
serializer on both sides: nothing read from Redis is unpickled. A task names a
function, and rq imports whatever dotted name it reads; anyone who can write
to Redis could name ``os.system``. ``FinalizeRunner`` therefore runs one
function only, ``finalize_task``, with exactly its arguments, and no
callbacks: any other task is refused, logged, marked failed and never
imported.

Each model's finalize tasks go to their own queue (``Keys.finalize_queue``),
so a job is finalized by a worker that serves its model, which reaches the
output the job's rows were written to.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis
from rq import Queue, SimpleWorker, get_current_job
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from batchgen.jobs.ops.finalize.finalization import FinalizeSettings, finalize, record_failure
from batchgen.jobs.redis.keys import Keys, QueueKeys
from batchgen.jobs.schema.errors import LeaseHeld

log = logging.getLogger(__name__)

FINALIZE_FUNC = "batchgen.jobs.ops.finalize.finalize_tasks.finalize_task"
_WAITING = (JobStatus.QUEUED, JobStatus.DEFERRED, JobStatus.SCHEDULED)


def finalize_queue(conn: redis.Redis, keys: Keys, tag: str) -> Queue:
    return Queue(keys.finalize_queue(tag), connection=conn, serializer=JSONSerializer)


def enqueue_finalize(conn: redis.Redis, keys: Keys, qk: QueueKeys, job_id: str) -> bool:
    """Queue the job's finalize unless it is queued, running (its lease is held) or
    waiting out a retry delay after a failure; whether it was queued.

    A task rq still calls "started" whose lease is gone belongs to a finalizer
    that died: it is replaced.
    """
    jk = qk.job(job_id)
    if conn.exists(jk.finalizer):
        return False
    retry_at = conn.hget(jk.job, "finalize_retry_at")
    if retry_at and float(retry_at) > time.time():
        return False
    task_id = keys.finalize_task_id(job_id)
    try:
        status = Job.fetch(task_id, connection=conn, serializer=JSONSerializer).get_status()
    except NoSuchJobError:
        status = None
    except Exception:  # unreadable (e.g. planted): replaced below, never run
        log.warning("finalize task %s is unreadable; replacing it", task_id)
        status = None
    if status in _WAITING:
        return False
    forget_task(conn, task_id)
    finalize_queue(conn, keys, qk.tag).enqueue(
        FINALIZE_FUNC,
        job_id,
        keys.prefix,
        job_id=task_id,
        job_timeout=-1,  # the lease says whether a finalizer lives, not a timeout
        result_ttl=3600,
        failure_ttl=3600,
        description=f"finalize {job_id}",
    )
    return True


def forget_task(conn: redis.Redis, task_id: str) -> None:
    """Delete a finalize task with rq's ``Job.delete``: its hash, its place in its queue
    and registries, its results stream (which outlives the hash)."""
    try:
        Job.fetch(task_id, connection=conn, serializer=JSONSerializer).delete()
        return
    except Exception:  # NoSuchJobError, or unreadable (planted): deleted by id, below
        pass
    task = Job(task_id, connection=conn, serializer=JSONSerializer)  # nothing read
    task.set_status(
        JobStatus.FAILED
    )  # rq deletes a task by its status (a planted one may have none)
    task.delete(remove_from_queue=False)


def finalize_task(job_id: str, prefix: str) -> dict[str, Any]:
    """The one function ``FinalizeRunner`` runs (JSON arguments in, a JSON result out)."""
    current = get_current_job()
    assert current is not None, "runs inside an rq worker"
    conn = current.connection
    keys = Keys(prefix)
    settings = FinalizeSettings.from_env()
    try:
        state = finalize(conn, keys, job_id, settings, owner=f"task {current.id}")
    except LeaseHeld as held:
        return {"job_id": job_id, "state": "busy", "holder": held.holder}
    except (redis.ConnectionError, redis.TimeoutError):
        raise  # an outage, not a failed finalize: the sweep queues the job again
    except Exception as exc:
        record_failure(conn, keys, job_id, exc, settings)
        raise
    return {"job_id": job_id, "state": state}


class FinalizeRunner(SimpleWorker):
    """rq's SimpleWorker that runs ``finalize_task`` and nothing else.

    It has no SIGINT/SIGTERM handlers of its own: it runs inside processes that
    have theirs (rq's would keep a SIGTERM from them while a task runs).
    """

    def _install_signal_handlers(self) -> None:
        pass

    def subscribe(self) -> None:
        """No command channel: nothing sends rq commands to a burst runner, and its
        listener thread cost each run up to 60 s at the end. rq 3 unsubscribes, then
        stops the thread, which redis-py 8.2 joins; a thread that read the unsubscribe
        first waits out rq's sleep_time=60 for a subscription that never comes."""

    def execute_job(self, job: Job, queue: Queue) -> None:
        problem = _refusal(job)
        if problem is None:
            super().execute_job(job, queue)
            return
        log.error("refused rq task %s on %s: %s (never imported, never run)", job.id,
                  queue.name, problem)  # fmt: skip
        job.set_status(JobStatus.FAILED)
        job.delete(remove_from_queue=True)


def _refusal(job: Job) -> str | None:
    """Why ``job`` is not one of ours, or None. Reads only stored strings: imports nothing."""
    try:
        func_name, args, kwargs = job.func_name, job.args, job.kwargs
    except Exception as exc:  # not JSON (a planted pickle), or malformed
        return f"unreadable task data ({type(exc).__name__})"
    if func_name != FINALIZE_FUNC:
        return f"function {func_name!r} is not {FINALIZE_FUNC}"
    if kwargs or len(args) != 2 or not all(isinstance(a, str) for a in args):
        return "finalize_task takes two strings (job id, key prefix)"
    stored = job.to_dict(include_meta=False, include_result=False)  # names, never imported
    if any(stored[f"{kind}_callback_name"] for kind in ("success", "failure", "stopped")):
        return "tasks with callbacks are not run"
    return None


def run_pending(conn: redis.Redis, keys: Keys, tag: str) -> int:
    """Run every queued finalize task of one model's queue in this process; how many ran."""
    queue = finalize_queue(conn, keys, tag)
    if queue.count == 0:
        return 0
    before = queue.count
    worker = FinalizeRunner([queue], connection=conn, serializer=JSONSerializer)
    worker.work(burst=True, logging_level="WARNING", with_scheduler=False)
    return before - queue.count
