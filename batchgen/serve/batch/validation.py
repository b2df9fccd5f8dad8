"""A new batch's validation, in the background: its input file checked, then submitted as
a job with the batch's id.

The validating server holds the batch's lease (``P:batch:ID:lock``,
jobs/redis/lease.py), renewed while it lives: a server killed mid-validation
stops renewing, the lease expires within ``lease_s``, and the sweep of any
server on the same files dir validates the batch again (submit resumes a job it
already created: nothing twice). A cancel while validating is seen before
submitting and while waiting for a model.

A model that no live worker serves fails the batch (``model_not_found``), unless
a worker supervisor is starting for it (it announces itself before its engines
load and hash the weights): then the batch waits, up to ``model_wait_s``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import redis

from batchgen.interface_errors import APIError
from batchgen.jobs.crashpoints import CrashPlan
from batchgen.jobs.ops.cancellation import cancel as cancel_job
from batchgen.jobs.ops.fair_share.schedule import Schedule
from batchgen.jobs.ops.submission import submit
from batchgen.jobs.redis.heartbeat import live_workers, starting_queues
from batchgen.jobs.redis.keys import queue_name
from batchgen.jobs.redis.lease import Lease
from batchgen.jobs.schema.errors import (
    BatchgenError,
    InvalidInput,
    JobConflict,
    JobNotFound,
    LeaseHeld,
    QuotaExceeded,
)
from batchgen.jobs.schema.sampling import job_defaults
from batchgen.serve.batch.batch_lifecycle import BatchState
from batchgen.serve.batch.batch_record import BatchRecord
from batchgen.serve.batch.batch_request import priority_of
from batchgen.serve.batch.batches import Batches, job_output
from batchgen.serve.batch.input_checks import check_batch_lines

log = logging.getLogger(__name__)
POLL_S = 1.0  # how often a batch waiting for a starting worker looks again


def error(code: str, message: str, param: str | None = None,
          line: int | None = None) -> dict[str, Any]:  # fmt: skip
    return {"code": code, "message": message, "param": param, "line": line}


class Validator:
    def __init__(self, batches: Batches, owner: str) -> None:
        self.batches = batches
        self.conn, self.keys, self.config = batches.conn, batches.keys, batches.config
        self.owner = owner  # who holds a lease: this server
        self.crash = CrashPlan.from_env()

    def validate(self, batch_id: str) -> None:
        """Validate (and submit) the batch, unless another thread or server does."""
        try:
            with Lease(self.conn, self.keys.batch_lock(batch_id), self.config.lease_s,
                       self.owner):  # fmt: skip
                self.crash.reached("serve_validating")
                try:
                    self._validate(self.batches.load(batch_id))
                except APIError:
                    return  # its record is gone (deleted)
                except (redis.ConnectionError, redis.TimeoutError):
                    raise  # an outage, not a bad batch
                except Exception as exc:  # never leave a batch validating for ever
                    log.exception("validating batch %s failed", batch_id)
                    record = self.batches.load(batch_id)
                    if record.state.validating:
                        self.batches.fail(record, [error("server_error", str(exc)[:500])])
        except LeaseHeld:
            return
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            # still validating: once its lease expires, the sweep validates it again
            log.warning("validating batch %s waits for Redis: %s", batch_id, exc)

    def _validate(self, record: BatchRecord) -> None:
        if not record.state.validating:
            return
        store = self.batches.store
        if not store.exists(record.input_file_id):
            self.batches.fail(record, [error("input_file_missing", "the input file was "
                              "deleted before the batch was checked", "input_file_id")])  # fmt: skip
            return
        with store.as_local_file(record.input_file_id) as path:
            checked = check_batch_lines(path, record.endpoint)
            errors = checked.errors
            if not errors and checked.lines == 0:
                errors = [error("empty_file", "the input file holds no requests")]
            if not errors:
                errors = self._wait_for_model(record, checked.model)
            if errors:
                self.batches.fail(record, errors)
                return
            if self.batches.load(record.id).state == BatchState.CANCELLING:
                self.batches.end(record, BatchState.CANCELLED, cancelled_at=int(time.time()))
                return
            output = job_output(self.config.output_root, record.id)
            schedule = Schedule(tenant=record.tenant, priority=priority_of(record.metadata),
                                deadline=float(record.expires_at))  # fmt: skip
            try:
                result = submit(self.conn, self.keys, source_path=path, model=checked.model,
                                output=output, defaults=job_defaults({}), job_id=record.id,
                                input_format="jsonl", schedule=schedule,
                                api_tenant=record.tenant)  # fmt: skip
            except QuotaExceeded as exc:  # OpenAI's batch queue limit: the batch fails with it
                self.batches.fail(record, [error(exc.code, str(exc))])
                return
            except InvalidInput as exc:
                data = [error("invalid_request", e.message, None, e.line)
                        for e in exc.line_errors] or [error("invalid_request", str(exc))]  # fmt: skip
                self.batches.fail(record, data)
                return
            except BatchgenError as exc:
                self.batches.fail(record, [error("batchgen_error", str(exc))])
                return
        was = self.batches.move(record, BatchState.SUBMITTED, model=checked.model, output=output,
                                total=result.total, in_progress_at=int(time.time()))  # fmt: skip
        if was != BatchState.VALIDATING:  # cancelled meanwhile (or ended): its job is not run
            with contextlib.suppress(JobConflict, JobNotFound):
                cancel_job(self.conn, self.keys, record.id)

    def _wait_for_model(self, record: BatchRecord, model: str) -> list[dict[str, Any]]:
        """[] once a live worker serves ``model``; the batch's errors when none will."""
        name = queue_name(model)
        served: Callable[[], bool] = lambda: any(  # noqa: E731
            w.get("queue") == name for w in live_workers(self.conn, self.keys)
        )
        deadline = time.monotonic() + self.config.model_wait_s
        waited = False
        while not served():
            if name not in starting_queues(self.conn, self.keys):
                how = (
                    "the worker starting for it stopped"
                    if waited
                    else "start one: batchgen worker --model MODEL"
                )
                return [error("model_not_found", f"no live worker serves the model "
                              f"{model[:200]!r} ({how})", "body.model")]  # fmt: skip
            if time.monotonic() >= deadline:
                return [error("model_not_found", f"a worker was starting for the model "
                              f"{model[:200]!r} but none served it within "
                              f"{self.config.model_wait_s:g} s", "body.model")]  # fmt: skip
            if self.batches.load(record.id).state == BatchState.CANCELLING:
                return []  # the caller finishes it as cancelled
            if not waited:
                log.info("batch %s waits for a worker starting for %s", record.id, model)
            waited = True
            time.sleep(POLL_S)
        return []
