"""Batches over batchgen jobs: create (validate in the background, then submit), get,
list, cancel, and the sweep that expires late batches and writes finished ones' files.

A batch's job has the batch's id, so a validation cut short (the server stopped)
is simply run again: submit resumes a job it already created, nothing twice.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import redis

from batchgen.jobs.ops.cancellation import cancel as cancel_job
from batchgen.jobs.ops.job_record import JobRecord, load_job
from batchgen.jobs.ops.lifecycle import JobState
from batchgen.jobs.ops.schedule import PRIORITY_LIMIT, Schedule, check_priority
from batchgen.jobs.ops.submission import submit
from batchgen.jobs.redis.heartbeat import live_workers
from batchgen.jobs.redis.keys import Keys, queue_name, text, text_hash
from batchgen.jobs.schema.errors import (
    BatchgenError,
    InvalidInput,
    JobConflict,
    JobNotFound,
    QuotaExceeded,
    UsageError,
)
from batchgen.jobs.schema.sampling import job_defaults
from batchgen.jobs.storage.names import check_output
from batchgen.serve import batch_lifecycle
from batchgen.serve.batch_lifecycle import BatchState
from batchgen.serve.batch_record import BatchRecord, to_openai
from batchgen.serve.files import FileStore
from batchgen.serve.input_checks import check_batch_lines
from batchgen.serve.openai_errors import APIError, not_found
from batchgen.serve.results import write_outputs
from batchgen.serve.settings import ServeConfig

log = logging.getLogger(__name__)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
WINDOWS = {"24h": 24 * 3600}
LOCK_S = 3600
MAX_METADATA_KEYS = 16


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


def job_output(root: str, batch_id: str) -> str:
    if "://" in root:
        return check_output(f"{root.rstrip('/')}/{batch_id}")
    return check_output(os.path.join(os.path.abspath(os.path.expanduser(root)), batch_id))


class Batches:
    def __init__(self, conn: redis.Redis, keys: Keys, config: ServeConfig, store: FileStore):
        self.conn, self.keys, self.config, self.store = conn, keys, config, store
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="batchgen-validate")

    # -- records ----------------------------------------------------------------

    def load(self, batch_id: str) -> BatchRecord:
        key = self.keys.batch(batch_id)
        data = text_hash(self.conn.hgetall(key))
        if not data:
            raise not_found("batch", batch_id)
        record = BatchRecord.from_hash(data)
        if "state" not in data:  # written before states: store the one it is in, for moves
            self.conn.hsetnx(key, "state", record.state.value)
        return record

    def save(self, record: BatchRecord, **changes: Any) -> None:
        """Set fields other than the state (``move`` changes that)."""
        assert "state" not in changes
        for name, value in changes.items():
            setattr(record, name, value)
        full = record.to_hash()
        self.conn.hset(self.keys.batch(record.id), mapping={k: full[k] for k in changes})

    def move(self, record: BatchRecord, to: BatchState, **changes: Any) -> BatchState | None:
        """Move the batch to ``to`` and set ``changes``, where its lifecycle allows that from
        the state stored now: the state it moved from (``record`` updated), else None."""
        full = replace(record, **changes).to_hash()
        stored = {name: full[name] for name in changes}
        moved, was = batch_lifecycle.move(self.conn, self.keys.batch(record.id), to, stored)
        if not moved:
            record.state = was or record.state  # what it became meanwhile
            return None
        for name, value in changes.items():
            setattr(record, name, value)
        record.state = to
        return was

    def job(self, record: BatchRecord) -> JobRecord | None:
        if not record.state.has_job:
            return None
        try:
            return load_job(self.conn, self.keys, record.id)
        except JobNotFound:
            return None

    def view(self, record: BatchRecord) -> dict[str, Any]:
        return to_openai(record, self.job(record))

    # -- the API ------------------------------------------------------------------

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        file_id = body.get("input_file_id")
        endpoint = body.get("endpoint")
        window = body.get("completion_window")
        metadata = body.get("metadata")
        if not isinstance(file_id, str) or not file_id:
            raise APIError(400, "input_file_id is required", "invalid_request", "input_file_id")
        if endpoint not in ENDPOINTS:
            raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}",
                           "invalid_request", "endpoint")  # fmt: skip
        if window not in WINDOWS:
            raise APIError(400, "completion_window must be 24h", "invalid_request",
                           "completion_window")  # fmt: skip
        if metadata is not None and not (
            isinstance(metadata, dict) and len(metadata) <= MAX_METADATA_KEYS
            and all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                    for k, v in metadata.items())
        ):  # fmt: skip
            raise APIError(400, "metadata must be at most 16 string keys (64 chars) with "
                           "string values (512 chars)", "invalid_request", "metadata")  # fmt: skip
        priority_of(metadata)  # refused here, not after validation
        if self.store.get(file_id).purpose != "batch":
            raise APIError(400, f"file {file_id!r} was not uploaded with purpose 'batch'",
                           "invalid_request", "input_file_id")  # fmt: skip
        now = int(time.time())
        record = BatchRecord(
            id=new_batch_id(), endpoint=endpoint, input_file_id=file_id,
            completion_window=window, metadata=metadata or None, created_at=now,
            expires_at=now + WINDOWS[window],
        )  # fmt: skip
        pipe = self.conn.pipeline(transaction=True)
        pipe.hset(self.keys.batch(record.id), mapping=dict[Any, Any](record.to_hash()))
        pipe.zadd(self.keys.batches, {record.id: time.time()})
        pipe.sadd(self.keys.open_batches, record.id)
        pipe.execute()
        self.pool.submit(self.validate, record.id)
        return self.view(record)

    def get(self, batch_id: str) -> dict[str, Any]:
        return self.view(self.load(batch_id))

    def page(self, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        start = 0
        if after:
            rank = self.conn.zrevrank(self.keys.batches, after)
            if rank is None:
                raise not_found("batch", after)
            start = int(rank) + 1  # type: ignore[arg-type]
        ids = [text(i) for i in self.conn.zrevrange(self.keys.batches, start, start + limit)]
        page = []
        for batch_id in ids[:limit]:
            try:
                page.append(self.get(batch_id))
            except APIError:
                continue  # deleted meanwhile
        return page, len(ids) > limit

    def cancel(self, batch_id: str) -> dict[str, Any]:
        record = self.load(batch_id)
        current = self.view(record)["status"]
        if current in ("cancelling", "cancelled"):
            return self.view(record)
        if record.state == BatchState.VALIDATING:
            if self.move(record, BatchState.CANCELLING, cancelling_at=int(time.time())):
                return self.view(record)
            return self.cancel(batch_id)  # its validation ended meanwhile: cancel what it made
        if current not in ("in_progress",):
            raise APIError(400, f"Cannot cancel a batch with status {current!r}.",
                           "invalid_request")  # fmt: skip
        try:
            cancel_job(self.conn, self.keys, batch_id)
        except (JobConflict, JobNotFound) as exc:
            raise APIError(400, f"Cannot cancel the batch: {exc}", "invalid_request") from None
        self.save(record, cancelling_at=int(time.time()))
        return self.view(record)

    # -- validation (background) ----------------------------------------------------

    def validate(self, batch_id: str) -> None:
        token = secrets.token_hex(8)
        lock = self.keys.batch_lock(batch_id)
        if not self.conn.set(lock, token, nx=True, ex=LOCK_S):
            return  # another thread or server has it
        try:
            self._validate(self.load(batch_id))
        except Exception as exc:  # never leave a batch validating forever
            log.exception("validating batch %s failed", batch_id)
            record = self.load(batch_id)
            if record.state.validating:
                self._fail(record, [{"code": "server_error", "message": str(exc)[:500],
                                     "param": None, "line": None}])  # fmt: skip
        finally:
            if text(self.conn.get(lock)) == token:
                self.conn.delete(lock)

    def _validate(self, record: BatchRecord) -> None:
        if not record.state.validating:
            return
        with self.store.as_local_file(record.input_file_id) as path:
            checked = check_batch_lines(path, record.endpoint)
            errors = checked.errors
            if not errors and checked.lines == 0:
                errors = [_error("empty_file", "the input file holds no requests")]
            if not errors and not self._served(checked.model):
                errors = [_error("model_not_found", f"no live worker serves the model "
                                 f"{checked.model[:200]!r} (start one: batchgen worker --model "
                                 "MODEL)", "body.model")]  # fmt: skip
            if errors:
                self._fail(record, errors)
                return
            if self.load(record.id).state == BatchState.CANCELLING:
                self._finish_unsubmitted(record)
                return
            output = job_output(self.config.output_root, record.id)
            schedule = Schedule(priority=priority_of(record.metadata),
                                deadline=float(record.expires_at))  # fmt: skip
            try:
                result = submit(self.conn, self.keys, source_path=path, model=checked.model,
                                output=output, defaults=job_defaults({}), job_id=record.id,
                                input_format="jsonl", schedule=schedule)  # fmt: skip
            except QuotaExceeded as exc:  # OpenAI's batch queue limit: the batch fails with it
                self._fail(record, [_error(exc.code, str(exc))])
                return
            except InvalidInput as exc:
                data = [_error("invalid_request", e.message, None, e.line)
                        for e in exc.line_errors] or [_error("invalid_request", str(exc))]  # fmt: skip
                self._fail(record, data)
                return
            except BatchgenError as exc:
                self._fail(record, [_error("batchgen_error", str(exc))])
                return
        was = self.move(record, BatchState.SUBMITTED, model=checked.model, output=output,
                        total=result.total, in_progress_at=int(time.time()))  # fmt: skip
        if was != BatchState.VALIDATING:  # cancelled meanwhile (or ended): its job is not run
            with contextlib.suppress(JobConflict, JobNotFound):
                cancel_job(self.conn, self.keys, record.id)

    def _served(self, model: str) -> bool:
        name = queue_name(model)
        return any(w.get("queue") == name for w in live_workers(self.conn, self.keys))

    def _fail(self, record: BatchRecord, errors: list[dict[str, Any]]) -> None:
        self.move(record, BatchState.FAILED, errors=errors, failed_at=int(time.time()))
        self.conn.srem(self.keys.open_batches, record.id)  # refused only when already ended

    def _finish_unsubmitted(self, record: BatchRecord) -> None:
        self.move(record, BatchState.CANCELLED, cancelled_at=int(time.time()))
        self.conn.srem(self.keys.open_batches, record.id)

    # -- the sweep (a background thread calls it) -----------------------------------

    def sweep(self) -> None:
        for batch_id in [text(i) for i in self.conn.smembers(self.keys.open_batches)]:
            try:
                self._sweep_one(self.load(batch_id))
            except APIError:
                self.conn.srem(self.keys.open_batches, batch_id)  # its record is gone
            except (redis.ConnectionError, redis.TimeoutError):
                raise
            except Exception:
                log.exception("sweeping batch %s", batch_id)

    def _sweep_one(self, record: BatchRecord) -> None:
        now = int(time.time())
        if record.state.validating:
            if not self.conn.exists(self.keys.batch_lock(record.id)):
                self.pool.submit(self.validate, record.id)  # a server stopped mid-validation
            return
        if not record.state.has_job:
            self.conn.srem(self.keys.open_batches, record.id)
            return
        job = self.job(record)
        if job is None:
            self._fail(record, [_error("job_lost", "the batch's job is gone from Redis "
                                       "(deleted, or Redis lost its state)")])  # fmt: skip
            return
        if job.state.live and now >= record.expires_at:
            if record.state == BatchState.SUBMITTED:
                self.move(record, BatchState.EXPIRING)
            if record.state == BatchState.EXPIRING:  # (also where a server stopped right here)
                with contextlib.suppress(JobConflict, JobNotFound):
                    cancel_job(self.conn, self.keys, record.id)
                job = self.job(record) or job
        if job.state in (JobState.FINALIZING, JobState.COMPLETED) and not record.finalizing_at:
            self.save(record, finalizing_at=now)
        if job.state.terminal:
            self._write_files(record, job)

    def _write_files(self, record: BatchRecord, job: JobRecord) -> None:
        token = secrets.token_hex(8)
        lock = self.keys.batch_lock(record.id)
        if not self.conn.set(lock, token, nx=True, ex=LOCK_S):
            return
        try:
            outputs = write_outputs(self.store, record, job)
            now = int(time.time())
            if job.state == JobState.COMPLETED:
                final, stamp = BatchState.COMPLETED, "completed_at"
            elif record.state == BatchState.EXPIRING:
                final, stamp = BatchState.EXPIRED, "expired_at"
            else:
                final, stamp = BatchState.CANCELLED, "cancelled_at"
            self.move(record, final, output_file_id=outputs.output_file_id,
                      error_file_id=outputs.error_file_id, total=job.total,
                      completed=outputs.completed, failed=outputs.failed,
                      prompt_tokens=job.prompt_tokens, completion_tokens=job.completion_tokens,
                      cached_tokens=job.cached_tokens, finalizing_at=record.finalizing_at or now,
                      **{stamp: now})  # fmt: skip
            self.conn.srem(self.keys.open_batches, record.id)
        finally:
            if text(self.conn.get(lock)) == token:
                self.conn.delete(lock)


def priority_of(metadata: dict[str, str] | None) -> int:
    """The job's priority class from the batch's metadata ``priority`` (0 without one)."""
    raw = (metadata or {}).get("priority")
    if raw is None:
        return 0
    try:
        return check_priority(int(raw))
    except (ValueError, UsageError):
        raise APIError(400, f"metadata.priority must be a whole number from -{PRIORITY_LIMIT} "
                       f"to {PRIORITY_LIMIT}", "invalid_request", "metadata") from None  # fmt: skip


def _error(code: str, message: str, param: str | None = None,
           line: int | None = None) -> dict[str, Any]:  # fmt: skip
    return {"code": code, "message": message, "param": param, "line": line}
