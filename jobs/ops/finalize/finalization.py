"""finalize: a job whose every input has a row (or that was cancelled) gets its final output.

1. Take the job's finalize lease (one finalizer at a time; a killed finalizer
   stops renewing it, the lease expires, and the sweep queues the job again).
2. Close the job (one atomic step): later commits of its rows are discarded,
   so the set of committed parts is frozen.
3. Write ``result.parquet`` and ``manifest.json`` (result.py), then mark the
   job completed (or cancelled): FINISH.
4. Clean up: free its share of its tenant's quotas (tenants.py), delete the part files the job's commits recorded and the job's
   own parts folder, then retire the job from the queue's active set. A
   finalize killed between 3 and 4 leaves the job terminal but still active;
   the sweep queues it again and the cleanup is redone.

A failure (the output cannot be written, say) is recorded on the job with a
retry time that backs off (``FinalizeSettings``); the sweep queues it again
then, for as long as it takes; ``batchgen finalize JOB`` runs it at once.
Re-running is harmless at every point.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass

import redis

from batchgen.jobs.backoff import backoff_delay
from batchgen.jobs.crashpoints import CrashPlan
from batchgen.jobs.environment import (
    FINALIZE_LEASE_S,
    FINALIZE_RETRY_CAP_S,
    FINALIZE_RETRY_S,
    FINALIZE_WINDOW_BYTES,
)
from batchgen.jobs.ops.fair_share import tenants
from batchgen.jobs.ops.finalize.result import (
    MANIFEST,
    WINDOW_BYTES,
    committed_parts,
    error_rows,
    manifest,
    write_result,
)
from batchgen.jobs.ops.job_record import load_job, queue_of_job
from batchgen.jobs.ops.lifecycle import CLOSE, FINISH, RETIRE, JobState
from batchgen.jobs.redis.keys import Keys, QueueKeys, text
from batchgen.jobs.redis.lease import Lease
from batchgen.jobs.schema.errors import BatchgenError
from batchgen.jobs.schema.rows import SUCCEEDED, FinishReason
from batchgen.jobs.storage.output_store import OutputDir

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FinalizeSettings:
    lease_s: float = FINALIZE_LEASE_S.default  # a finalizer silent this long is dead
    retry_s: float = FINALIZE_RETRY_S.default  # first retry after a failure; doubles each time
    retry_cap_s: float = FINALIZE_RETRY_CAP_S.default
    window_bytes: int = WINDOW_BYTES  # rows held in memory at once (about)

    @classmethod
    def from_env(cls) -> FinalizeSettings:
        """The ``BATCHGEN_FINALIZE_*`` variables (jobs/environment.py), else the defaults."""
        return cls(
            lease_s=FINALIZE_LEASE_S.get(),
            retry_s=FINALIZE_RETRY_S.get(),
            retry_cap_s=FINALIZE_RETRY_CAP_S.get(),
            window_bytes=int(FINALIZE_WINDOW_BYTES.get()),
        )

    def retry_delay(self, attempts: int) -> float:
        return backoff_delay(max(attempts - 1, 0), self.retry_s, self.retry_cap_s)


def finalize(
    conn: redis.Redis,
    keys: Keys,
    job_id: str,
    settings: FinalizeSettings | None = None,
    owner: str = "",
) -> str:
    """Write the job's output if it is ready; the job's state afterwards.

    Raises ``LeaseHeld`` when another finalizer is at it.
    """
    settings = settings or FinalizeSettings()
    qk = queue_of_job(conn, keys, job_id)
    jk = qk.job(job_id)
    with Lease(conn, jk.finalizer, settings.lease_s, owner or f"pid {os.getpid()}"):
        raw = CLOSE(conn, job=jk.job)
        if raw is None:
            return "missing"
        state = JobState(text(raw))
        if state.needs_finalize:
            state = _write(conn, keys, qk, job_id, settings)
            CrashPlan.from_env().reached("after_finalize_commit")
        if state.terminal:
            tenants.release(conn, keys, text(conn.hget(jk.job, "tenant")), job_id)
            _clean_up(conn, qk, job_id)
        return state.value


def _write(
    conn: redis.Redis, keys: Keys, qk: QueueKeys, job_id: str, settings: FinalizeSettings
) -> JobState:
    record = load_job(conn, keys, job_id)
    jk = qk.job(job_id)
    out = OutputDir.open(record.output)
    parts, errors = committed_parts(conn, qk, job_id), error_rows(conn, qk, job_id)
    counts = write_result(out, record, parts, errors, settings.window_bytes)
    finished_at = time.time()
    body = manifest(record, counts, finished_at)
    out.write_atomic((MANIFEST,), json.dumps(body, indent=2).encode())
    CrashPlan.from_env().reached("before_finalize_commit")
    failed = counts.rows - sum(counts.by_reason.get(reason, 0) for reason in SUCCEEDED)
    final = FINISH(
        conn, job=jk.job, done=jk.done, now=repr(finished_at), failed=failed,
        cancelled=counts.by_reason.get(FinishReason.CANCELLED.value, 0),
    )  # fmt: skip
    return JobState(text(final))


def _clean_up(conn: redis.Redis, qk: QueueKeys, job_id: str) -> None:
    """Delete the job's part files (only its own), then retire it from the active set."""
    jk = qk.job(job_id)
    record_output = text(conn.hget(jk.job, "output"))
    names = [text(name) for name in conn.hkeys(jk.parts)]
    out = OutputDir.open(record_output)
    for name in names:
        out.delete_file(*name.split("/"))
    out.delete_dir("parts", job_id)
    out.delete_empty_dir("parts")
    RETIRE(
        conn, job=jk.job, active=qk.active, parts=jk.parts, errors=jk.errors, dead=jk.dead,
        expiring=qk.expiring, job_id=job_id, now=repr(time.time()),
    )  # fmt: skip


def record_failure(
    conn: redis.Redis, keys: Keys, job_id: str, exc: BaseException, settings: FinalizeSettings
) -> float:
    """Note a failed finalize on the job (status shows it) and when to retry; the delay."""
    jk = queue_of_job(conn, keys, job_id).job(job_id)
    attempts = int(conn.hincrby(jk.job, "finalize_attempts", 1))
    delay = settings.retry_delay(attempts)
    reason = str(exc) if isinstance(exc, BatchgenError) else f"{type(exc).__name__}: {exc}"
    conn.hset(
        jk.job,
        mapping={
            "error": f"finalize failed (attempt {attempts}; retrying in {delay:.0f}s): {reason}",
            "finalize_retry_at": repr(time.time() + delay),
        },
    )
    log.error("finalize of job %s failed (attempt %d): %s", job_id, attempts, reason)
    return delay
