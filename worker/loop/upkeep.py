"""The loop's periodic Redis chores on the main thread, each on its own interval.

- reclaim: take over entries idle past the claim timeout (a dead worker's);
  deleted ones are counted as lost (maintenance.sweep turns them into rows)
- sweep: lost requests and stuck finalizes (jobs/ops/maintenance.py)
- deadlines: jobs that would miss theirs go first; expired ones are cancelled
  (jobs/ops/deadlines.py)
- the heartbeat's payload, which the keeper thread sends (keeper.py also keeps
  the claims fresh and hears cancels, off the main thread)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from batchgen.jobs.consumer.queue import Delivery, dead_letter, reclaim, recreate_group
from batchgen.jobs.ops import deadlines
from batchgen.jobs.ops.finalize_tasks import enqueue_finalize
from batchgen.jobs.ops.maintenance import sweep
from batchgen.jobs.ops.modelinfo import fingerprint
from batchgen.jobs.redis import heartbeat
from batchgen.jobs.redis.keys import Keys, QueueKeys, text
from batchgen.worker.loop.flight import error_row
from batchgen.worker.loop.loop_config import LoopConfig

log = logging.getLogger(__name__)
_REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)


@dataclass(slots=True)
class JobInfo:
    output: str
    cache: str = ""  # the result cache's location when the job uses it
    refused: str = ""  # why this worker will not run the job's requests (other weights)


@dataclass(slots=True)
class LoopView:
    """What upkeep may see of the queue loop and ask of it."""

    admit: Callable[[list[Delivery]], None]  # entries taken over from a dead worker
    capacity: Callable[[], int]  # how many entries to take over now
    count: Callable[[str, int], None]  # bump a metrics counter
    activity: Callable[[], dict[str, Any]]  # the loop's part of the heartbeat
    stopping: Callable[[], bool]


class Upkeep:
    def __init__(
        self, conn: redis.Redis, keys: Keys, qk: QueueKeys, config: LoopConfig, loop: LoopView
    ) -> None:
        self.conn = conn
        self.keys = keys
        self.qk = qk
        self.config = config
        self.loop = loop
        self.queue_name = config.queue_name
        self.jobs: dict[str, JobInfo | None] = {}  # None: the job's record is gone
        self.fingerprint = fingerprint(config.model)
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
            if not self.loop.stopping() and self.due("reclaim", c.reclaim_s):
                self.reclaim()
            if self.due("sweep", c.sweep_interval_s):
                sweep(self.conn, self.keys, self.qk)
            if self.due("deadlines", c.deadline_check_s):
                deadlines.check(self.conn, self.keys, self.qk)
        except _REDIS_DOWN as exc:
            log.warning("upkeep skipped: Redis unavailable (%s)", exc)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            recreate_group(self.conn, self.qk)

    def job(self, job_id: str) -> JobInfo | None:
        """The job's output, and whether this worker holds the weights it was submitted
        for (the job's fingerprint, set at submit or else by the first worker)."""
        if job_id not in self.jobs:
            jk = self.qk.job(job_id)
            pipe = self.conn.pipeline(transaction=False)
            pipe.hmget(jk.job, ["output", "cache"])
            if self.fingerprint:
                pipe.hsetnx(jk.job, "model_fingerprint", self.fingerprint)
            pipe.hget(jk.job, "model_fingerprint")
            (output, cache), *_, expected = pipe.execute()
            if output is None:
                self.jobs[job_id] = None
                return None
            refused = self._refusal(job_id, text(expected))
            self.jobs[job_id] = JobInfo(text(output), text(cache), refused)
        return self.jobs[job_id]

    def _refusal(self, job_id: str, expected: str) -> str:
        """Why this worker must not run the job (it holds other weights under the same
        name), said on the job for status; "" when it may."""
        if not self.fingerprint or not expected or expected == self.fingerprint:
            return ""
        reason = (
            f"worker {self.config.name} on {socket.gethostname()} holds other weights for "
            f"{self.config.model} (fingerprint {self.fingerprint}; the job was submitted for "
            f"{expected}): it leaves the job's requests to workers that hold those"
        )
        log.error("refusing job %s: %s", job_id, reason)
        self.conn.hset(self.qk.job(job_id).job, "refused", reason)
        return reason

    def reclaim(self) -> None:
        capacity = self.loop.capacity()
        if capacity <= 0:
            return
        claimed = reclaim(
            self.conn,
            self.qk,
            self.config.name,
            int(self.config.claim_timeout_s * 1000),
            capacity,
        )
        if claimed.lost_ids:
            log.error(
                "%d pending entries were deleted from the stream before a row was committed "
                "(was it trimmed?); their jobs will report them as lost rows",
                len(claimed.lost_ids),
            )
            self.loop.count("lost_entries", len(claimed.lost_ids))
        if claimed.deliveries:
            self.loop.count("reclaimed", len(claimed.deliveries))
            self.loop.admit(claimed.deliveries)

    def dead_letter(self, d: Delivery, reason: str) -> None:
        row = error_row(d, f"dead-lettered: {reason}", self.config.name)
        finished = dead_letter(self.conn, self.qk, d, reason, self.config.name, _row_json(row))
        self.loop.count("dead_lettered", 1)
        if finished:
            enqueue_finalize(self.conn, self.keys, self.qk, d.job_id)

    def drained(self) -> bool:
        """Burst mode: no backlog holds a request and the stream no entry (none queued,
        none pending)."""
        if not self.due("drained", 0.2):
            return False
        try:
            if self.conn.xlen(self.qk.stream) > 0 or self.conn.scard(self.qk.ready) > 0:
                return False
            sweep(self.conn, self.keys, self.qk)  # lost entries -> finalize
        except _REDIS_DOWN:
            return False
        return True

    def payload(self) -> dict[str, Any]:
        return {
            "name": self.config.name,
            "model": self.config.model,
            "queue": self.queue_name,
            "tag": self.qk.tag,
            "host": socket.gethostname(),
            "device": self.config.engine.device or "auto",
            "pid": os.getpid(),
            "supervisor": self.config.supervisor,
            "started_at": self.started_at,
            **self.loop.activity(),
        }

    def retire(self) -> None:
        with contextlib.suppress(*_REDIS_DOWN):
            heartbeat.retire(self.conn, self.keys, self.config.name)


def _row_json(row) -> str:
    return json.dumps(row.to_dict(), ensure_ascii=False)
