"""delete: every trace of a job in Redis, and with ``outputs`` its files too.

Redis: the job's keys (record, done-marks, parts, error rows, dead letters,
finalize lease, backlog), its entries in the model's stream (queued or held by a
worker: acked and deleted; a worker holding one finds it gone and drops it),
its place in the queue's sets and the job index, and its finalize task (rq's
keys and registries). Outputs: the files batchgen wrote in the job's output
directory (result, manifest, marker, kept columns, ``parts/JOB/``), and the directory if
nothing else is left in it.

A job that still runs (or is being finalized) is refused unless ``force``:
then it is cancelled first. Delete holds the job's finalize lease, so no
finalize runs meanwhile. Every step can be re-run: a delete cut short is
finished by running it again (the index entry, which finds the job, goes last).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis
from rq import Queue

from batchgen.jobs.intake.kept import KEPT
from batchgen.jobs.ops import job_index
from batchgen.jobs.ops.cancellation import cancel
from batchgen.jobs.ops.fair_share import fair_index, tenants
from batchgen.jobs.ops.finalize.finalize_tasks import finalize_queue, forget_task
from batchgen.jobs.ops.finalize.result import MANIFEST, RESULT
from batchgen.jobs.ops.job_record import JobRecord, queue_of_job
from batchgen.jobs.redis.keys import GROUP, Keys, QueueKeys, text
from batchgen.jobs.redis.lease import Lease
from batchgen.jobs.schema.entry import job_of
from batchgen.jobs.schema.errors import JobConflict, LeaseHeld
from batchgen.jobs.storage.output_store import OutputDir
from batchgen.jobs.storage.ownership import MARKER

SCAN_BATCH = 2000
TOMBSTONE_S = 7 * 24 * 3600  # how long status says a deleted job was deleted


@dataclass(slots=True)
class Deleted:
    keys: int = 0  # Redis keys removed
    entries: int = 0  # requests removed from its backlog and the model's stream
    files: int = 0  # output files removed
    kept_output: str = ""  # the job's output directory, left in place (no ``outputs``)


def delete(
    conn: redis.Redis, keys: Keys, job_id: str, *, outputs: bool = False, force: bool = False
) -> Deleted:
    qk = queue_of_job(conn, keys, job_id)
    jk = qk.job(job_id)
    raw = conn.hgetall(jk.job)
    record = JobRecord.from_hash(job_id, raw) if raw else None
    if record is not None and not record.state.terminal and not force:
        raise JobConflict(
            f"job {job_id!r} is {record.state.value}; cancel it first (batchgen cancel "
            f"{job_id}), or pass --force to cancel and delete it at once"
        )
    report = Deleted()
    if record is not None and record.state.live:
        cancel(conn, keys, job_id)
        report.entries = record.backlog  # the cancel dropped its backlog
    try:
        with Lease(conn, jk.finalizer, 60, f"batchgen delete {job_id}"):
            if outputs and record is not None:
                report.files = _delete_outputs(record)
            elif record is not None:
                report.kept_output = record.output
            report.entries += delete_entries(conn, qk, job_id)
            _forget_task(conn, finalize_queue(conn, keys, qk.tag), keys.finalize_task_id(job_id))
            pipe = conn.pipeline(transaction=True)
            pipe.delete(*[k for k in jk.all() if k != jk.finalizer])  # the lease goes on exit
            pipe.srem(qk.active, job_id)
            pipe.srem(qk.cancelled, job_id)
            pipe.zrem(qk.expiring, job_id)
            report.keys = int(pipe.execute()[0])
    except LeaseHeld as held:
        raise JobConflict(
            f"job {job_id!r} is being finalized right now by {held.holder}; try again once it "
            "is done"
        ) from None
    if record is not None:
        tenants.release(conn, keys, record.tenant, job_id)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    kept = f"; its output {report.kept_output} was kept" if report.kept_output else ""
    conn.set(keys.deleted(job_id), f"`batchgen delete` at {when}{kept}", ex=TOMBSTONE_S)
    job_index.forget(conn, keys, [job_id])
    conn.hdel(keys.jobs, job_id)  # last: it is how a re-run finds what is left
    return report


def _forget_task(conn: redis.Redis, queue: Queue, task: str) -> None:
    """The job's finalize task and every rq registry that names it: a task whose worker
    was killed is moved to the failed registry by rq's cleanup, and that entry outlives
    the task's own hash (its failure TTL), so deleting the task alone can leave it."""
    forget_task(conn, task)  # its hash and results stream (which outlives the hash)
    # (rq 3's started registry tracks executions and cannot remove by id; a running
    # finalize holds the job's lease, which delete takes first)
    for registry in (queue.failed_job_registry, queue.finished_job_registry,
                     queue.canceled_job_registry, queue.deferred_job_registry,
                     queue.scheduled_job_registry):  # fmt: skip
        registry.remove(task)


def delete_entries(conn: redis.Redis, qk: QueueKeys, job_id: str) -> int:
    """Drop the job's backlog, and ack and delete its entries in the model's stream
    (scanned in batches)."""
    jk = qk.job(job_id)
    fair_index.leave(conn, qk, job_id)
    pipe = conn.pipeline(transaction=True)
    for key in jk.backlogs:
        pipe.llen(key)
    pipe.delete(*jk.backlogs)
    pipe.srem(qk.ready, job_id)
    removed = sum(pipe.execute()[: len(jk.backlogs)])
    if removed and conn.exists(jk.job):
        conn.hset(jk.job, "backlog", 0)
    start = "-"
    mine = job_id.encode()
    while True:
        batch: Any = conn.xrange(qk.stream, start, "+", count=SCAN_BATCH)
        if not batch:
            return removed
        ids = [eid for eid, fields in batch if fields and job_of(fields) == mine]
        if ids:
            pipe = conn.pipeline(transaction=True)
            pipe.xack(qk.stream, GROUP, *ids)
            pipe.xdel(qk.stream, *ids)
            removed += int(pipe.execute()[1])
        last = text(batch[-1][0])
        start = f"({last}"


def _delete_outputs(record: JobRecord) -> int:
    """The files batchgen wrote for the job; the directory too if it is left empty."""
    out = OutputDir.open(record.output)
    removed = out.delete_temp_files()
    for name in (RESULT, MANIFEST, KEPT, MARKER):
        if out.exists(name):
            out.delete_file(name)
            removed += 1
    if out.exists("parts", record.id):
        removed += 1
        out.delete_dir("parts", record.id)
    out.delete_empty_dir("parts")
    out.delete_empty_dir()
    return removed
