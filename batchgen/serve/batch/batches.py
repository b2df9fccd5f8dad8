"""Batches over batchgen jobs: the records, and create, get, list and cancel.

Validating a new batch (validation.py) and finishing a batch whose job ended
(sweep.py) run in the background. A batch's job has the batch's id. Each batch
belongs to the tenant of the key that made it (api_keys.py): another tenant's
batch is a 404, as one never made.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from dataclasses import replace
from typing import Any

import redis

from batchgen.interface_errors import APIError
from batchgen.jobs.ops.cancellation import cancel as cancel_job
from batchgen.jobs.ops.fair_share import tenants
from batchgen.jobs.ops.job_record import JobRecord, load_job
from batchgen.jobs.redis.keys import Keys, text, text_hash
from batchgen.jobs.schema.errors import JobConflict, JobNotFound, UsageError
from batchgen.jobs.storage.names import check_output
from batchgen.serve.api_keys import Principal
from batchgen.serve.batch import batch_lifecycle
from batchgen.serve.batch.batch_lifecycle import BatchState
from batchgen.serve.batch.batch_record import BatchRecord, to_openai
from batchgen.serve.batch.batch_request import WINDOW_S, CreateBatch, priority_of
from batchgen.serve.files import FileStore
from batchgen.serve.openai_errors import not_found
from batchgen.serve.settings import ServeConfig


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(12)}"


def job_output(root: str, batch_id: str) -> str:
    if "://" in root:
        return check_output(f"{root.rstrip('/')}/{batch_id}")
    return check_output(os.path.join(os.path.abspath(os.path.expanduser(root)), batch_id))


class Batches:
    def __init__(self, conn: redis.Redis, keys: Keys, config: ServeConfig, store: FileStore):
        self.conn, self.keys, self.config, self.store = conn, keys, config, store

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

    def visible(self, batch_id: str, who: Principal) -> BatchRecord:
        """The batch as ``who`` may see it: 404 for another tenant's."""
        record = self.load(batch_id)
        if not who.sees(record.tenant):
            raise not_found("batch", batch_id)
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

    def end(self, record: BatchRecord, to: BatchState, **changes: Any) -> bool:
        """Move the batch to a state it stays in (final, or failed): it leaves the open
        batches, its record (with its output files) expires after ``output_expiry_s``, and
        its input file goes if it was deleted or expired meanwhile. Whether it moved."""
        if self.move(record, to, **changes) is None:
            if record.state.final or record.state == BatchState.FAILED:
                self.conn.srem(self.keys.open_batches, record.id)  # ended before: tidy up
            return False
        pipe = self.conn.pipeline(transaction=False)
        pipe.srem(self.keys.open_batches, record.id)
        if record.output_expiry_s:
            pipe.zadd(self.keys.expiring_batches(self.store.uri),
                      {record.id: time.time() + record.output_expiry_s})  # fmt: skip
        pipe.execute()
        self.release(record.input_file_id)
        return True

    def release(self, file_id: str) -> None:
        """Remove a hidden (deleted or expired) file once no open batch reads it."""
        obj = self.store.record(file_id)
        if obj is not None and obj.hidden and not self.uses_file(file_id):
            self.store.remove(obj)

    def uses_file(self, file_id: str) -> bool:
        """Whether an open batch (its output files not written) reads ``file_id``."""
        ids = [text(i) for i in self.conn.smembers(self.keys.open_batches)]
        pipe = self.conn.pipeline(transaction=False)
        for batch_id in ids:
            pipe.hget(self.keys.batch(batch_id), "input_file_id")
        return any(text(f) == file_id for f in pipe.execute())

    def fail(self, record: BatchRecord, errors: list[dict[str, Any]]) -> None:
        self.end(record, BatchState.FAILED, errors=errors, failed_at=int(time.time()))

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

    def create(self, request: CreateBatch, who: Principal) -> BatchRecord:
        """Record a new batch (``validating``); the caller starts its validation. FastAPI
        checked the body (batch_request.py); its input file is checked here."""
        file_id, window = request.input_file_id, request.completion_window
        output_expiry = (request.output_expires_after.seconds if request.output_expires_after
                         else self.config.output_expiry_s)  # fmt: skip
        if self.store.get(file_id, who).purpose != "batch":
            raise APIError(400, f"file {file_id!r} was not uploaded with purpose 'batch'",
                           "invalid_request", "input_file_id")  # fmt: skip
        try:  # a priority class above the tenant's limit: refused, never lowered silently
            tenants.check_priority(self.conn, self.keys, who.tenant,
                                   priority_of(request.metadata), keyed=not who.admin)  # fmt: skip
        except UsageError as exc:
            raise APIError(400, str(exc), "invalid_priority", "metadata") from None
        now = int(time.time())
        record = BatchRecord(
            id=new_batch_id(), endpoint=request.endpoint, input_file_id=file_id,
            completion_window=window, metadata=request.metadata or None, created_at=now,
            expires_at=now + WINDOW_S[window], tenant=who.tenant, store=self.store.uri,
            output_expiry_s=output_expiry,
        )  # fmt: skip
        pipe = self.conn.pipeline(transaction=True)
        pipe.hset(self.keys.batch(record.id), mapping=dict[Any, Any](record.to_hash()))
        pipe.zadd(self.keys.batches, {record.id: time.time()})
        if record.tenant:
            pipe.zadd(self.keys.tenant_batches(record.tenant), {record.id: time.time()})
        pipe.sadd(self.keys.open_batches, record.id)
        pipe.execute()
        return record

    def get(self, batch_id: str, who: Principal) -> dict[str, Any]:
        return self.view(self.visible(batch_id, who))

    def page(self, who: Principal, after: str | None, limit: int) -> tuple[list[dict], bool]:
        index = self.keys.batches if who.admin else self.keys.tenant_batches(who.tenant)
        start = 0
        if after:
            rank = self.conn.zrevrank(index, after)
            if rank is None:
                raise not_found("batch", after)
            start = int(rank) + 1  # type: ignore[arg-type]
        ids = [text(i) for i in self.conn.zrevrange(index, start, start + limit)]
        page = []
        for batch_id in ids[:limit]:
            with contextlib.suppress(APIError):  # deleted meanwhile
                page.append(self.get(batch_id, who))
        return page, len(ids) > limit

    def cancel(self, batch_id: str, who: Principal) -> dict[str, Any]:
        record = self.visible(batch_id, who)
        current = self.view(record)["status"]
        if current in ("cancelling", "cancelled"):
            return self.view(record)
        if record.state == BatchState.VALIDATING:
            if self.move(record, BatchState.CANCELLING, cancelling_at=int(time.time())):
                return self.view(record)
            return self.cancel(batch_id, who)  # its validation ended meanwhile: cancel its job
        if current not in ("in_progress",):
            raise APIError(400, f"Cannot cancel a batch with status {current!r}.",
                           "invalid_request")  # fmt: skip
        try:
            cancel_job(self.conn, self.keys, batch_id)
        except (JobConflict, JobNotFound) as exc:
            raise APIError(400, f"Cannot cancel the batch: {exc}", "invalid_request") from None
        self.save(record, cancelling_at=int(time.time()))
        return self.view(record)
