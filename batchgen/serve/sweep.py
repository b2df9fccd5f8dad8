"""The sweep a background thread runs every tick, over what this server's files dir holds.

- A validating batch nobody validates (its lease expired: the server validating
  it died) is validated again.
- A batch past its window has its job cancelled (it becomes ``expired``).
- A batch whose job ended gets its output files (results.py), under the batch's
  lease, renewed while the writing lasts: a server killed mid-write is taken over
  once the lease expires. A write that fails is tried again with growing delays,
  ``FINISH_ATTEMPTS`` times, then the batch fails with the reason: it never
  loops, and only one server (the lease holder) tries at a time.
- Ended batches past their expiry go with their output files (batch_removal.py);
  files past theirs go (files.py), as do temp files of uploads whose server died.

Batches and files of another files dir (another server's) are left alone: this
server could not read or write their files.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import redis

from batchgen.interface_errors import APIError
from batchgen.jobs.backoff import backoff_delay
from batchgen.jobs.crashpoints import CrashPlan
from batchgen.jobs.ops.cancellation import cancel as cancel_job
from batchgen.jobs.ops.job_record import JobRecord
from batchgen.jobs.ops.lifecycle import JobState
from batchgen.jobs.redis.keys import text
from batchgen.jobs.redis.lease import Lease
from batchgen.jobs.schema.errors import JobConflict, JobNotFound, LeaseHeld
from batchgen.serve.batch.batch_lifecycle import BatchState
from batchgen.serve.batch.batch_record import BatchRecord
from batchgen.serve.batch.batch_removal import remove_batch
from batchgen.serve.batch.batches import Batches
from batchgen.serve.batch.results import write_outputs
from batchgen.serve.batch.validation import error

log = logging.getLogger(__name__)
FINISH_ATTEMPTS = 8  # failed output writes before the batch fails
FINISH_DELAY_S = (2.0, 300.0)  # the first retry's delay, doubled each time up to the second


class Sweep:
    def __init__(self, batches: Batches, validate: Callable[[str], None], owner: str,
                 pool: ThreadPoolExecutor) -> None:  # fmt: skip
        self.batches = batches
        self.conn, self.keys, self.config = batches.conn, batches.keys, batches.config
        self.store = batches.store
        self.validate, self.owner, self.pool = validate, owner, pool
        self.crash = CrashPlan.from_env()

    def run(self) -> None:
        for batch_id in [text(i) for i in self.conn.smembers(self.keys.open_batches)]:
            try:
                record = self.batches.load(batch_id)
            except APIError:
                self.conn.srem(self.keys.open_batches, batch_id)  # its record is gone
                continue
            if record.store and record.store != self.store.uri:
                continue  # another server's: it cannot be finished here
            try:
                self.one(record)
            except (redis.ConnectionError, redis.TimeoutError):
                raise
            except Exception:
                log.exception("sweeping batch %s", batch_id)
        self.expire()

    def one(self, record: BatchRecord) -> None:
        now = int(time.time())
        if record.state.validating:
            if not self.conn.exists(self.keys.batch_lock(record.id)):
                self.pool.submit(self.validate, record.id)  # a server stopped mid-validation
            return
        if not record.state.has_job:
            self.conn.srem(self.keys.open_batches, record.id)
            return
        job = self.batches.job(record)
        if job is None:
            self.batches.fail(record, [error("job_lost", "the batch's job is gone from Redis "
                                             "(deleted, or Redis lost its state)")])  # fmt: skip
            return
        if job.state.live and now >= record.expires_at:
            if record.state == BatchState.SUBMITTED:
                self.batches.move(record, BatchState.EXPIRING)
            if record.state == BatchState.EXPIRING:  # (also where a server stopped right here)
                with contextlib.suppress(JobConflict, JobNotFound):
                    cancel_job(self.conn, self.keys, record.id)
                job = self.batches.job(record) or job
        if job.state in (JobState.FINALIZING, JobState.COMPLETED) and not record.finalizing_at:
            self.batches.save(record, finalizing_at=now)
        if job.state.terminal and time.time() >= record.finish_retry_at:
            with (
                contextlib.suppress(LeaseHeld),
                Lease(self.conn, self.keys.batch_lock(record.id), self.config.lease_s, self.owner),
            ):
                self.finish(self.batches.load(record.id), job)

    def finish(self, record: BatchRecord, job: JobRecord) -> None:
        """Write the output files and end the batch; a failed try is retried later."""
        if not record.state.has_job:
            return  # ended meanwhile (another server)
        try:
            outputs = write_outputs(self.store, record, job,
                                    lambda: self.crash.reached("serve_writing_outputs"))  # fmt: skip
        except Exception as exc:
            self.failed_to_finish(record, exc)
            return
        now = int(time.time())
        if job.state == JobState.COMPLETED:
            final, stamp = BatchState.COMPLETED, "completed_at"
        elif record.state == BatchState.EXPIRING:
            final, stamp = BatchState.EXPIRED, "expired_at"
        else:
            final, stamp = BatchState.CANCELLED, "cancelled_at"
        self.batches.end(
            record, final, output_file_id=outputs.output_file_id,
            error_file_id=outputs.error_file_id, total=job.total, completed=outputs.completed,
            failed=outputs.failed, prompt_tokens=job.prompt_tokens,
            completion_tokens=job.completion_tokens, cached_tokens=job.cached_tokens,
            failed_prompt_tokens=job.failed_prompt_tokens,
            reasoning_tokens=job.reasoning_tokens,
            finalizing_at=record.finalizing_at or now, **{stamp: now},
        )  # fmt: skip

    def failed_to_finish(self, record: BatchRecord, exc: Exception) -> None:
        attempts = record.finish_attempts + 1
        reason = f"{type(exc).__name__}: {exc}"[:500]
        if attempts >= FINISH_ATTEMPTS:
            log.error("batch %s: writing its output files failed %d times (%s); it fails",
                      record.id, attempts, reason)  # fmt: skip
            self.batches.fail(record, [error("output_failed", "its output files could not be "
                                             f"written ({attempts} tries): {reason}")])  # fmt: skip
            return
        first, most = FINISH_DELAY_S
        delay = backoff_delay(attempts - 1, first, most)
        log.warning("batch %s: writing its output files failed (%s); try %d of %d in %.0f s",
                    record.id, reason, attempts, FINISH_ATTEMPTS, delay)  # fmt: skip
        self.batches.save(record, finish_attempts=attempts, finish_retry_at=time.time() + delay)

    def expire(self, now: float | None = None) -> None:
        """Ended batches and files of this files dir past their expiry."""
        now = time.time() if now is None else now
        index = self.keys.expiring_batches(self.store.uri)
        for batch_id in [text(i) for i in self.conn.zrangebyscore(index, 0, now, 0, 100)]:
            remove_batch(self.conn, self.keys, batch_id)
        self.store.sweep(self.batches.uses_file, now)
