"""The worker's sink: finished rows -> published Parquet parts -> one commit step.

Rows are buffered per job. ``flush`` writes one part per job (atomically,
jobs/storage/output_store.py) under the job's own folder ``parts/JOB/``, then commits every
written part and the entries to drop in ONE Lua step (commit.py). If Redis is
unreachable the written parts are kept and the same parts (same names) are
committed on the next try, which the commit step recognises, so a retry never
counts a row twice.

A part that cannot be written (a full disk, a path that is not a directory,
a store that is down, an output that cannot even be opened) is never charged
to its requests: the job's rows stay buffered (their entries held, so kept
fresh by the worker), the write is retried with backoff, and the other jobs'
rows flow on. ``failing`` says which jobs' outputs fail and since when; the
queue loop hands such a job's requests back, uncharged, after a bounded
outage.
"""

from __future__ import annotations

import io
import logging
import time
import uuid
from dataclasses import dataclass, field

import pyarrow.parquet as pq
import redis

from batchgen.jobs.backoff import backoff_delay
from batchgen.jobs.crashpoints import CrashPlan
from batchgen.jobs.redis.keys import QueueKeys
from batchgen.jobs.schema.errors import BatchgenError
from batchgen.jobs.schema.rows import Row, to_table
from batchgen.jobs.storage.output_store import OutputDir
from batchgen.worker.consumer.commit import CommitResult, PartCommit, commit
from batchgen.worker.consumer.queue import Delivery

log = logging.getLogger(__name__)

RETRY_FIRST_S = 0.5
RETRY_CAP_S = 30.0


@dataclass(slots=True)
class StorageFailure:
    """A job whose parts cannot be written, since when, and when to try again."""

    since: float  # time.time() of the first failure of this outage
    error: str
    attempts: int = 1
    retry_at: float = 0.0  # time.monotonic()


@dataclass(slots=True)
class _Buffer:
    output_uri: str
    rows: list[Row] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)  # the entry each row came from
    engine_us: list[int] = field(default_factory=list)  # each row's share of engine time
    indices: set[int] = field(default_factory=set)  # of the rows
    failure: StorageFailure | None = None

    @property
    def entry_ids(self) -> list[str]:
        return [d.entry_id for d in self.deliveries]


@dataclass(slots=True)
class FlushResult:
    commit: CommitResult | None  # None: nothing to commit, or Redis failed (kept for a retry)
    redis_failed: bool = False
    redis_error: str = ""  # why, when it failed (the worker's outage log says it once)
    recovered: list[str] = field(default_factory=list)  # jobs whose output works again
    parts: list[PartCommit] = field(default_factory=list)  # committed now (result cache)


@dataclass(slots=True)
class PartSink:
    qk: QueueKeys
    worker: str
    crash: CrashPlan = field(default_factory=CrashPlan.from_env)
    flush_rows: int = 4096
    flush_interval_s: float = 5.0
    buffers: dict[str, _Buffer] = field(default_factory=dict)
    written: list[PartCommit] = field(default_factory=list)  # published, not yet committed
    drops: list[str] = field(default_factory=list)  # entries to ack+delete without a row
    outputs: dict[str, OutputDir] = field(default_factory=dict)  # job id -> its output dir
    oldest: float | None = None  # monotonic time the oldest buffered row arrived
    seq: int = 0

    def add(self, delivery: Delivery, output_uri: str, row: Row, engine_us: int = 0) -> None:
        """Buffer a row (``engine_us``: its share of engine time, for usage). A second row
        for an input index already buffered is dropped (its entry acked with the part): a
        part holds one row per index, because the commit records the indices a part lost,
        not which of its rows."""
        buf = self.buffers.get(delivery.job_id)
        if buf is None:
            buf = self.buffers[delivery.job_id] = _Buffer(output_uri)
        if row.index in buf.indices:
            log.warning("job %s: a second row for input %d here; keeping the first",
                        delivery.job_id, row.index)  # fmt: skip
            if delivery.entry_id not in buf.entry_ids:
                self.drop([delivery.entry_id])
            return
        buf.indices.add(row.index)
        buf.rows.append(row)
        buf.deliveries.append(delivery)
        buf.engine_us.append(engine_us)
        if self.oldest is None:
            self.oldest = time.monotonic()

    def drop(self, entry_ids: list[str]) -> None:
        self.drops += entry_ids
        if self.oldest is None:
            self.oldest = time.monotonic()

    @property
    def buffered(self) -> int:
        return sum(len(b.rows) for b in self.buffers.values())

    @property
    def empty(self) -> bool:
        return not self.buffers and not self.written and not self.drops

    @property
    def failing(self) -> dict[str, StorageFailure]:
        """Jobs whose output cannot be written now."""
        return {job: b.failure for job, b in self.buffers.items() if b.failure is not None}

    def entry_ids(self) -> list[str]:
        """Entries whose rows are here but not committed (still pending: keep them fresh)."""
        ids = [e for b in self.buffers.values() for e in b.entry_ids]
        return ids + [e for p in self.written for e in p.entry_ids]

    def uncommitted_tokens(self) -> dict[str, list[int]]:
        """Per job, [prompt, completion] tokens of its rows here not committed yet."""
        tokens: dict[str, list[int]] = {}
        held = [(job_id, b.rows) for job_id, b in self.buffers.items()]
        for job_id, rows in held + [(p.job_id, p.rows) for p in self.written]:
            counts = tokens.setdefault(job_id, [0, 0])
            for row in rows:
                counts[0] += row.prompt_tokens
                counts[1] += row.completion_tokens
        return tokens

    def rows(self, job_id: str) -> list[tuple[Delivery, Row]]:
        """A job's buffered rows, with the entries they came from."""
        buf = self.buffers.get(job_id)
        return list(zip(buf.deliveries, buf.rows)) if buf is not None else []

    def take(self, job_id: str) -> list[tuple[Delivery, Row]]:
        """Remove a job's buffered rows (handed back), with the entries they came from."""
        rows = self.rows(job_id)
        self.buffers.pop(job_id, None)
        return rows

    def due(self, idle: bool) -> bool:
        now = time.monotonic()
        ready = [b for b in self.buffers.values() if b.failure is None or b.failure.retry_at <= now]
        if not ready and not self.written and not self.drops:
            return False
        if idle or self.written or any(b.failure for b in ready):
            return True
        if sum(len(b.rows) for b in ready) >= self.flush_rows:
            return True
        return self.oldest is not None and now - self.oldest >= self.flush_interval_s

    def flush(self, conn: redis.Redis) -> FlushResult:
        """Publish the buffered rows whose output works (or is due a retry), and commit."""
        now = time.monotonic()
        recovered = []
        for job_id, buf in list(self.buffers.items()):
            if buf.failure is not None and buf.failure.retry_at > now:
                continue
            if self._publish(job_id, buf):
                if buf.failure is not None:
                    recovered.append(job_id)
                del self.buffers[job_id]
        if not self.written and not self.drops:
            return FlushResult(None, recovered=recovered)
        try:
            result = commit(conn, self.qk, self.written, self.drops)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.debug("commit failed (%s); will retry with the same parts", exc)
            return FlushResult(None, redis_failed=True, redis_error=str(exc), recovered=recovered)
        self.crash.reached("after_commit")
        refused = set(result.closed) | set(result.missing)
        for part in self.written:
            if part.job_id in refused:  # finalized (or gone) meanwhile: the part is an orphan
                self._delete_part(part)
        parts = [part for part in self.written if part.job_id not in refused]
        self.written.clear()
        self.drops.clear()
        self.oldest = time.monotonic() if self.buffers else None
        return FlushResult(result, recovered=recovered, parts=parts)

    def _delete_part(self, part: PartCommit) -> None:
        try:
            self.outputs[part.job_id].delete_file(*part.name.split("/"))
        except BatchgenError as exc:
            log.warning("job %s: could not remove refused part %s: %s", part.job_id, part.name, exc)

    def _publish(self, job_id: str, buf: _Buffer) -> bool:
        """Write one part of the job's buffered rows; False (rows kept) if storage fails."""
        self.crash.reached("before_part_write")
        self.seq += 1
        name = f"{self.worker}-{self.seq:06d}-{uuid.uuid4().hex[:8]}.parquet"
        sink = io.BytesIO()
        table = to_table(buf.rows)
        pq.write_table(table, sink, compression="zstd")
        try:
            out = self.outputs.get(job_id) or OutputDir.open(buf.output_uri)
            self.outputs[job_id] = out
            out.write_atomic(
                ("parts", job_id, name),
                sink.getvalue(),
                halfway=lambda: self.crash.reached("mid_part_write"),
            )
        except (BatchgenError, OSError) as exc:
            self._failed(job_id, buf, str(exc))
            return False
        self.crash.reached("after_publish")
        started = min(d.read_at for d in buf.deliveries)
        part = PartCommit(
            job_id,
            f"parts/{job_id}/{name}",
            buf.rows,
            buf.entry_ids,
            table.nbytes,
            started,
            buf.engine_us,
        )
        self.written.append(part)
        return True

    def _failed(self, job_id: str, buf: _Buffer, error: str) -> None:
        failure = buf.failure
        if failure is None:
            failure = buf.failure = StorageFailure(time.time(), error, attempts=0)
        failure.attempts += 1
        failure.error = error
        delay = backoff_delay(failure.attempts - 1, RETRY_FIRST_S, RETRY_CAP_S)
        failure.retry_at = time.monotonic() + delay
        log.error(
            "job %s: cannot write its part (%s); keeping its %d rows and retrying in %.1fs "
            "(failing for %.0fs)", job_id, error, len(buf.rows), delay, time.time() - failure.since,
        )  # fmt: skip
