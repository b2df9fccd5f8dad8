"""The loop's periodic Redis chores on the main thread, each on its own interval.

- reclaim: take over entries idle past the claim timeout (a dead worker's) and
  admit them (requests.py); deleted ones are counted as lost (maintenance.sweep
  turns them into rows)
- sweep: lost requests and stuck finalizes (jobs/ops/maintenance.py)
- deadlines: jobs that would miss theirs go first; expired ones are cancelled
  (jobs/ops/fair_share/deadlines.py)
- the heartbeat's payload, which the keeper thread sends (keeper.py also keeps
  the claims fresh and hears cancels, off the main thread)
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import redis

from batchgen.jobs.ops.fair_share import deadlines
from batchgen.jobs.ops.maintenance import sweep
from batchgen.jobs.redis import heartbeat
from batchgen.jobs.redis.keys import Keys, QueueKeys
from batchgen.jobs.redis.outage_probe import OutageLog
from batchgen.worker.consumer.queue import reclaim, recreate_group
from batchgen.worker.loop.keeper import Keeper
from batchgen.worker.loop.loop_config import LoopConfig
from batchgen.worker.loop.requests import Requests

log = logging.getLogger(__name__)
_REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)


class Upkeep:
    def __init__(
        self,
        conn: redis.Redis,
        keys: Keys,
        qk: QueueKeys,
        config: LoopConfig,
        requests: Requests,
        keeper: Keeper,
        count: Callable[[str, int], None],
        outage: OutageLog,
    ) -> None:
        self.outage = outage  # the worker's: an outage is logged once, whoever meets it
        self.conn = conn
        self.keys = keys
        self.qk = qk
        self.config = config
        self.requests = requests
        self.keeper = keeper
        self.count = count
        self.queue_name = config.queue_name
        self.started_at = time.time()
        self._next: dict[str, float] = {}

    def due(self, name: str, interval: float) -> bool:
        now = time.monotonic()
        if now < self._next.get(name, 0.0):
            return False
        self._next[name] = now + interval
        return True

    def run(self, stopping: bool) -> None:
        c = self.config
        try:
            if not stopping and self.due("reclaim", c.reclaim_s):
                self.reclaim()
            if self.due("sweep", c.sweep_interval_s):
                sweep(self.conn, self.keys, self.qk)
            if self.due("deadlines", c.deadline_check_s):
                deadlines.check(self.conn, self.keys, self.qk)
        except _REDIS_DOWN as exc:  # skipped; the loop's next read or commit says when it ends
            self.outage.down(f"Redis unavailable ({exc})")
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            recreate_group(self.conn, self.qk)

    def reclaim(self) -> None:
        capacity = self.requests.capacity()
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
            self.count("lost_entries", len(claimed.lost_ids))
        if claimed.deliveries:
            self.count("reclaimed", len(claimed.deliveries))
            # a cancel before the claim must be seen
            self.requests.admit_reclaimed(claimed.deliveries, self.keeper.poll_cancelled())

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

    def payload(self, activity: dict[str, Any]) -> dict[str, Any]:
        """The heartbeat: who and where this worker is, with ``activity``, the loop's part."""
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
            **activity,
        }

    def retire(self) -> None:
        with contextlib.suppress(*_REDIS_DOWN):
            heartbeat.retire(self.conn, self.keys, self.config.name)
