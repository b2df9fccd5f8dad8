"""The loop's periodic Redis chores, each on its own interval.

- heartbeat: a key with a TTL carrying what status and metrics show
- refresh: XCLAIM JUSTID on the entries we hold (in flight or awaiting commit)
  so no one reclaims live work; entries another worker took are aborted here
- reclaim: XAUTOCLAIM entries idle past the claim timeout (a dead worker's);
  deleted ones are counted as lost (maintenance.sweep turns them into rows)
- cancel poll: abort and drop the requests of cancelled jobs
- sweep: lost requests and stuck finalizes (jobs/maintenance.py)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis

from batchgen.jobs import heartbeat
from batchgen.jobs.keys import queue_name, text
from batchgen.jobs.maintenance import sweep
from batchgen.jobs.modelinfo import fingerprint
from batchgen.jobs.queue import Delivery, dead_letter, reclaim, recreate_group, refresh
from batchgen.jobs.tasks import enqueue_finalize
from batchgen.worker.loop.flight import error_row

if TYPE_CHECKING:
    from batchgen.worker.loop.runner import QueueLoop

log = logging.getLogger(__name__)
_REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)


@dataclass(slots=True)
class JobInfo:
    output: str


class Upkeep:
    def __init__(self, loop: QueueLoop) -> None:
        self.loop = loop
        self.config = loop.config
        self.queue_name = queue_name(self.config.model)
        self.cancelled: set[str] = set()
        self.jobs: dict[str, JobInfo | None] = {}  # None: the job's record is gone
        self.fingerprint = fingerprint(self.config.model)
        self.started_at = time.time()
        self._next: dict[str, float] = {}

    def due(self, name: str, interval: float) -> bool:
        now = time.monotonic()
        if now < self._next.get(name, 0.0):
            return False
        self._next[name] = now + interval
        return True

    def run(self) -> None:
        c = self.config
        try:
            if self.due("cancel", c.cancel_poll_s):
                self.poll_cancelled()
            if self.due("heartbeat", c.heartbeat_s):
                self.beat()
            if self.due("refresh", c.refresh_s):
                self.refresh()
            if not self.loop.stopping and self.due("reclaim", c.reclaim_s):
                self.reclaim()
            if self.due("sweep", c.sweep_interval_s):
                sweep(self.loop.conn, self.loop.keys, self.loop.qk)
        except _REDIS_DOWN as exc:
            log.warning("upkeep skipped: Redis unavailable (%s)", exc)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            recreate_group(self.loop.conn, self.loop.qk)

    def job(self, job_id: str) -> JobInfo | None:
        if job_id not in self.jobs:
            conn, jk = self.loop.conn, self.loop.qk.job(job_id)
            output = conn.hget(jk.job, "output")
            self.jobs[job_id] = JobInfo(text(output)) if output is not None else None
            if output is not None and self.fingerprint:
                conn.hsetnx(jk.job, "model_fingerprint", self.fingerprint)
        return self.jobs[job_id]

    def poll_cancelled(self) -> None:
        members = self.loop.conn.smembers(self.loop.qk.cancelled)
        self.cancelled = {text(m) for m in members}
        if not self.cancelled:
            return
        doomed = [e for e, f in self.loop.inflight.items() if f.delivery.job_id in self.cancelled]
        for entry_id in doomed:
            self.loop.abort(entry_id)
        doomed += [d.entry_id for g in self.loop.alone for d in g if d.job_id in self.cancelled]
        self.loop.alone = self.loop.keep_alone(lambda d: d.job_id not in self.cancelled)
        if doomed:
            self.loop.sink.drop(doomed)
            self.loop._count("dropped", len(doomed))

    def held(self) -> list[str]:
        alone = [d.entry_id for group in self.loop.alone for d in group]
        return list(self.loop.inflight) + alone + self.loop.sink.entry_ids()

    def refresh(self) -> None:
        gone = refresh(self.loop.conn, self.loop.qk, self.config.name, self.held())
        if gone:
            self.loop.alone = self.loop.keep_alone(lambda d: d.entry_id not in gone)
        for entry_id in gone:
            # Another worker claimed it while we were stalled: it is theirs now.
            self.loop.abort(entry_id)
        if gone:
            self.loop._count("stolen", len(gone))

    def reclaim(self) -> None:
        capacity = self.loop.engine.free_capacity()
        if capacity <= 0 or self.loop.alone or self.loop.alone_running:
            return  # full, or a set must run alone: claimed work would run beside it
        claimed = reclaim(
            self.loop.conn,
            self.loop.qk,
            self.config.name,
            int(self.config.claim_timeout_s * 1000),
            capacity,
            known=set(self.held()),
        )
        if claimed.lost_ids:
            log.error(
                "%d pending entries were deleted from the stream before a row was committed "
                "(was it trimmed?); their jobs will report them as lost rows",
                len(claimed.lost_ids),
            )
            self.loop._count("lost_entries", len(claimed.lost_ids))
        if claimed.deliveries:
            self.loop._count("reclaimed", len(claimed.deliveries))
            self.loop.admit(claimed.deliveries)

    def dead_letter(self, d: Delivery, reason: str) -> None:
        row = error_row(d, f"dead-lettered: {reason}", self.config.name)
        finished = dead_letter(
            self.loop.conn, self.loop.qk, d, reason, self.config.name, _row_json(row)
        )
        self.loop._count("dead_lettered")
        if finished:
            enqueue_finalize(self.loop.conn, self.loop.keys, d.job_id)

    def drained(self) -> bool:
        """Burst mode: the stream holds no entry at all (none queued, none pending)."""
        if not self.due("drained", 0.2):
            return False
        try:
            if self.loop.conn.xlen(self.loop.qk.stream) > 0:
                return False
            sweep(self.loop.conn, self.loop.keys, self.loop.qk)  # lost entries -> finalize
        except _REDIS_DOWN:
            return False
        return True

    def payload(self) -> dict[str, Any]:
        in_flight: dict[str, int] = {}
        for flight in self.loop.inflight.values():
            job_id = flight.delivery.job_id
            in_flight[job_id] = in_flight.get(job_id, 0) + 1
        stats = self.loop.engine.stats()
        engine = (
            dataclasses.asdict(stats)
            if dataclasses.is_dataclass(stats) and not isinstance(stats, type)
            else {}
        )
        return {
            "name": self.config.name,
            "model": self.config.model,
            "queue": self.queue_name,
            "tag": self.loop.qk.tag,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "supervisor": self.config.supervisor,
            "started_at": self.started_at,
            "in_flight": in_flight,
            "buffered_rows": self.loop.sink.buffered,
            "counters": dict(self.loop.counters),
            "engine": engine,
        }

    def beat(self) -> None:
        ttl = max(int(self.config.heartbeat_s * 3), 2)
        heartbeat.beat(self.loop.conn, self.loop.keys, self.config.name, self.payload(), ttl)

    def retire(self) -> None:
        with contextlib.suppress(*_REDIS_DOWN):
            heartbeat.retire(self.loop.conn, self.loop.keys, self.config.name)


def _row_json(row) -> str:
    return json.dumps(row.to_dict(), ensure_ascii=False)
