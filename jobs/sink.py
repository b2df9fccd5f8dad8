"""The worker's sink: finished rows -> published Parquet parts -> one commit step.

Rows are buffered per job. ``flush`` writes one part per job (atomically,
storage.py), then commits every written part and the entries to drop in ONE
Lua step (commit.py). If Redis is unreachable the written parts are kept and
the same parts (same names) are committed on the next try, which the commit
step recognises, so a retry never counts a row twice.
"""

from __future__ import annotations

import io
import logging
import time
import uuid
from dataclasses import dataclass, field

import pyarrow.parquet as pq
import redis

from batchgen.jobs.commit import CommitResult, PartCommit, commit
from batchgen.jobs.crashpoints import CrashPlan
from batchgen.jobs.errors import BatchgenError
from batchgen.jobs.keys import QueueKeys
from batchgen.jobs.rows import Row, to_table
from batchgen.jobs.storage import OutputDir

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Buffer:
    rows: list[Row] = field(default_factory=list)
    entry_ids: list[str] = field(default_factory=list)


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

    def add(self, job_id: str, output_uri: str, entry_id: str, row: Row) -> None:
        buf = self.buffers.get(job_id)
        if buf is None:
            buf = self.buffers[job_id] = _Buffer()
            if job_id not in self.outputs:
                self.outputs[job_id] = OutputDir.open(output_uri)
        buf.rows.append(row)
        buf.entry_ids.append(entry_id)
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

    def entry_ids(self) -> list[str]:
        """Entries whose rows are here but not committed (still pending: keep them fresh)."""
        ids = [e for b in self.buffers.values() for e in b.entry_ids]
        return ids + [e for p in self.written for e in p.entry_ids]

    def due(self, idle: bool) -> bool:
        if self.empty:
            return False
        if idle or self.written or self.buffered >= self.flush_rows:
            return True
        return self.oldest is not None and time.monotonic() - self.oldest >= self.flush_interval_s

    def flush(self, conn: redis.Redis) -> CommitResult | None:
        """Publish buffered rows and commit; None if Redis failed (kept for a retry)."""
        for job_id, buf in self.buffers.items():
            self._publish(job_id, buf)
        self.buffers.clear()
        try:
            result = commit(conn, self.qk, self.written, self.drops)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("commit failed (%s); will retry with the same parts", exc)
            return None
        self.crash.reached("after_commit")
        self.written.clear()
        self.drops.clear()
        self.oldest = None
        return result

    def _publish(self, job_id: str, buf: _Buffer) -> None:
        self.crash.reached("before_part_write")
        self.seq += 1
        name = f"{self.worker}-{self.seq:06d}-{uuid.uuid4().hex[:8]}.parquet"
        sink = io.BytesIO()
        pq.write_table(to_table(buf.rows), sink, compression="zstd")
        out = self.outputs[job_id]
        try:
            out.write_atomic(
                ("parts", name),
                sink.getvalue(),
                halfway=lambda: self.crash.reached("mid_part_write"),
            )
        except BatchgenError as exc:
            # Unwritable output: the rows stay uncommitted, their entries pending;
            # another worker (or this one, later) retries after the claim timeout.
            log.error("job %s: cannot write part: %s; leaving its entries pending", job_id, exc)
            return
        self.crash.reached("after_publish")
        self.written.append(PartCommit(job_id, f"parts/{name}", buf.rows, buf.entry_ids))
