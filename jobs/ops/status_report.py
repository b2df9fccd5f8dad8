"""status: what a job (or every job) is doing, as data; the CLI renders it.

While a job runs, its tokens, rates and ETA are live: the live workers' heartbeats
carry, per job, the tokens of requests still generating or awaiting commit and
the tokens and rows made per second over the last minute (worker/loop/progress.py);
they are added to the committed counts of the job's record. Once the job stops
running, everything comes from its record (tok/s: its tokens over its run time).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import redis

from batchgen.jobs.ops import job_index
from batchgen.jobs.ops.fair_share.schedule import status_fields
from batchgen.jobs.ops.job_record import JobRecord, load_job
from batchgen.jobs.redis.heartbeat import live_workers
from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.storage.names import redact_uri


@dataclass(slots=True)
class JobStatus:
    record: JobRecord
    # requests live workers hold for this job: their heartbeats' counts, which lag by a
    # heartbeat, so never more than the job has unfinished, and none once it stops running
    in_flight: int = 0
    workers: list[str] = field(default_factory=list)  # live workers serving its queue
    rows_per_s: float = 0.0
    tokens_per_s: float = 0.0  # completion tokens
    eta_s: float | None = None  # None: finished, not started, or no live worker serves it
    # tokens of its rows not committed yet (generating, or awaiting commit), from heartbeats
    pending_prompt_tokens: int = 0
    pending_completion_tokens: int = 0

    @property
    def unserved(self) -> bool:
        """Requests wait, and no live worker reads the job's queue: nothing moves."""
        return self.record.state.live and not self.workers

    @property
    def refused_now(self) -> bool:
        """Requests wait, the last worker that met the job refused it (it holds other
        weights under the model's name: worker/loop/job_book.py) and no live worker
        holds any of its requests: nothing runs it until a worker that holds the
        weights it was submitted for reads it (that one clears the refusal)."""
        return self.record.state.live and bool(self.record.refused) and not self.in_flight

    now: float = 0.0  # when it was read (the deadline's state is relative to it)

    def to_dict(self) -> dict[str, Any]:
        r = self.record
        return {
            "job_id": r.id,
            "state": r.state.value,
            "model": r.model,
            "total": r.total,
            "enqueued": r.enqueued,
            "done": r.done,
            "failed": r.errors,  # error rows; cancelled ones are counted apart
            "cancelled": r.cancelled_rows,
            "in_flight": self.in_flight,
            "queued": max(r.enqueued - r.finished_rows - self.in_flight, 0),
            "skipped_invalid": r.skipped,
            # committed rows' and, while it runs, those of requests generating now
            "prompt_tokens": r.prompt_tokens + self.pending_prompt_tokens,
            "completion_tokens": r.completion_tokens + self.pending_completion_tokens,
            "cached_tokens": r.cached_tokens,
            "reasoning_parser": r.reasoning_parser or None,
            "tool_call_parser": r.tool_call_parser or None,
            "reasoning_tokens": r.reasoning_tokens,
            "tokens_per_s": round(self.tokens_per_s, 1),
            "rows_per_s": round(self.rows_per_s, 2),
            "eta_s": None if self.eta_s is None else round(self.eta_s, 1),
            "live_workers": len(self.workers),
            "workers": self.workers,
            "unserved": self.unserved,
            "output": redact_uri(r.output),
            "created_at": r.created_at,
            "started_at": r.started_at or None,
            "finished_at": r.finished_at or None,
            "error": r.error or None,
            "storage_error": r.storage_error or None,
            "refused": r.refused or None,
            "refused_now": self.refused_now,
            "finalize_attempts": r.finalize_attempts,
            "finalize_retry_at": r.finalize_retry_at or None,
            "submit_incomplete": not r.submitted,
            "retried": r.retried,  # rows re-queued by `batchgen retry`, every round
            "retry_rounds": r.retry_rounds,
            "retry_incomplete": r.retry_incomplete,
            **status_fields(r, self.now),  # tenant, priority, deadline, usage (schedule.py)
        }


def job_status(conn: redis.Redis, keys: Keys, job_id: str, now: float | None = None) -> JobStatus:
    record = load_job(conn, keys, job_id)
    return _status(record, live_workers(conn, keys, record.tag), now or time.time())


def listed_statuses(
    conn: redis.Redis,
    keys: Keys,
    api_tenant: str | None = None,
    offset: int = 0,
    limit: int | None = None,
) -> list[JobStatus]:
    """A page of the jobs, newest first (job_index.py): every job's (``api_tenant``
    None) or a serve tenant's, from the ``offset``-th on, ``limit`` at most (None: all)."""
    records = job_index.page(conn, keys, api_tenant, offset, limit)
    workers = live_workers(conn, keys)
    now = time.time()
    return [_status(r, [w for w in workers if w.get("tag") == r.tag], now) for r in records]


def all_statuses(conn: redis.Redis, keys: Keys) -> list[JobStatus]:
    """Every job, oldest first."""
    return sorted(listed_statuses(conn, keys), key=lambda s: s.record.created_at)


def _status(record: JobRecord, workers: list[dict[str, Any]], now: float) -> JobStatus:
    status = JobStatus(record, workers=[w["name"] for w in workers], now=now)
    if record.state.live:
        held = sum(int(w.get("in_flight", {}).get(record.id, 0)) for w in workers)
        status.in_flight = min(held, max(record.enqueued - record.finished_rows, 0))
        live = [w.get("progress", {}).get(record.id) or {} for w in workers]
        status.pending_prompt_tokens = sum(int(p.get("prompt_tokens", 0)) for p in live)
        status.pending_completion_tokens = sum(int(p.get("completion_tokens", 0)) for p in live)
        status.tokens_per_s = sum(float(p.get("tokens_per_s", 0)) for p in live)
        status.rows_per_s = sum(float(p.get("rows_per_s", 0)) for p in live)
        if status.workers:
            status.eta_s = _eta(status)
    elif record.started_at:
        end = record.finished_at if record.state.terminal and record.finished_at else now
        elapsed = max(end - record.started_at, 1e-6)
        status.rows_per_s = record.finished_rows / elapsed
        status.tokens_per_s = record.completion_tokens / elapsed
    return status


def _eta(status: JobStatus) -> float | None:
    """Seconds left at the live rate: the tokens its remaining rows take (as many per row
    as its committed rows took, less those generated already) over the tokens made per
    second; by rows per second when no committed row says how long a row is (an
    embedding job, or none committed yet). None before any rate was measured."""
    r = status.record
    remaining = max(r.total - r.finished_rows, 0)
    if remaining == 0:
        return 0.0
    if r.finished_rows and r.completion_tokens and status.tokens_per_s > 0:
        per_row = r.completion_tokens / r.finished_rows
        waiting = max(remaining - status.in_flight, 0)  # no token of theirs made yet
        left = max(remaining * per_row - status.pending_completion_tokens, waiting * per_row)
        return left / status.tokens_per_s
    if status.rows_per_s > 0:
        return remaining / status.rows_per_s
    return None
