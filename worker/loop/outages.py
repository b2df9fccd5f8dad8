"""Storage outages: a job whose parts cannot be written is said so loudly, never charged.

The sink keeps such a job's rows and retries with backoff (worker/consumer/sink.py). This
reports it: a log line, the ``storage_failures`` counter in the heartbeat (and
so in Prometheus), and ``storage_error`` on the job record, which ``batchgen
status`` shows; cleared when writes work again. After ``limit_s`` of one
outage the loop hands the job's requests back, uncharged (finished rows travel
with their entries, so nobody generates them again): a worker whose storage
works may take them; this one may read them again and keep them for another
``limit_s``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime

import redis

from batchgen.jobs.redis.keys import QueueKeys
from batchgen.worker.consumer.sink import PartSink, StorageFailure

log = logging.getLogger(__name__)
_REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)


class StorageOutages:
    def __init__(
        self, conn: redis.Redis, qk: QueueKeys, worker: str, limit_s: float,
        count: Callable[[str, int], None],
    ) -> None:  # fmt: skip
        self.conn = conn
        self.qk = qk
        self.worker = worker
        self.limit_s = limit_s
        self.count = count
        self._reported: dict[str, int] = {}  # job -> failed attempts already reported

    def update(self, sink: PartSink, recovered: list[str]) -> list[str]:
        """Report new failures and recoveries; the jobs whose outage passed the limit."""
        for job_id in recovered:
            self._reported.pop(job_id, None)
            log.warning("job %s: its output can be written again", job_id)
            self._set(job_id, None)
        overdue = []
        for job_id, failure in sink.failing.items():
            if self._reported.get(job_id) != failure.attempts:
                self._reported[job_id] = failure.attempts
                self.count("storage_failures", 1)
                self._set(job_id, self._describe(failure))
            if time.time() - failure.since >= self.limit_s:
                overdue.append(job_id)
        return overdue

    def handed_back(self, job_id: str, failure: StorageFailure, n: int) -> None:
        self._reported.pop(job_id, None)
        self.count("storage_hand_backs", 1)
        log.error(
            "job %s: its output has failed for %.0fs (%s); handed its %d requests back, "
            "uncharged, for a worker that can write it", job_id, time.time() - failure.since,
            failure.error, n,
        )  # fmt: skip
        self._set(job_id, f"{self._describe(failure)}; handed {n} requests back")

    def _describe(self, failure: StorageFailure) -> str:
        since = datetime.fromtimestamp(failure.since, UTC).isoformat(timespec="seconds")
        return (
            f"worker {self.worker} cannot write parts since {since} ({failure.attempts} tries; "
            f"rows kept, not charged): {failure.error}"
        )

    def _set(self, job_id: str, message: str | None) -> None:
        key = self.qk.job(job_id).job
        try:
            if message is None:
                self.conn.hdel(key, "storage_error")
            elif self.conn.exists(key):
                self.conn.hset(key, "storage_error", message[:2000])
        except _REDIS_DOWN:
            pass  # said in the log; the next report retries
