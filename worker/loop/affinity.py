"""Prefix affinity: which of a job's backlog lists this worker takes from first.

A job's backlog is split by prompt prefix (jobs/ops/fair_share/backlog.py). Each list belongs
to one live worker of the model by rendezvous hashing (the worker whose hash of
``name:group`` is highest), so requests that share a long prefix go to the worker
whose prefix cache already holds it, and a worker joining or leaving moves only
its own lists. The dispatch script takes a worker's own lists first and the
fullest other one when they are empty, so affinity never leaves a worker idle
while work waits, and never changes which job goes next (worker/consumer/dispatch.py).
"""

from __future__ import annotations

import hashlib
import logging
import time

import redis

from batchgen.jobs.redis.heartbeat import live_workers
from batchgen.jobs.redis.keys import BACKLOG_GROUPS, Keys, QueueKeys

log = logging.getLogger(__name__)


def _score(worker: str, group: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{worker}:{group}".encode(), digest_size=8).digest())


def owned(me: str, workers: set[str]) -> list[int]:
    """The groups rendezvous hashing gives ``me`` among ``workers`` (``me`` included)."""
    everyone = sorted(workers | {me})
    return [g for g in range(BACKLOG_GROUPS)
            if max(everyone, key=lambda w: _score(w, g)) == me]  # fmt: skip


class Affinity:
    """This worker's groups, from the model's live workers, looked up every ``every_s``."""

    def __init__(self, conn: redis.Redis, keys: Keys, qk: QueueKeys, name: str, every_s: float):
        self.conn, self.keys, self.qk, self.name, self.every_s = conn, keys, qk, name, every_s
        self._groups = list(range(BACKLOG_GROUPS))
        self._next = 0.0

    def groups(self) -> list[int]:
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.every_s
            try:
                names = {w["name"] for w in live_workers(self.conn, self.keys, self.qk.tag)}
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("prefix affinity: cannot read the live workers (%s)", exc)
                return self._groups
            self._groups = owned(self.name, names)
        return self._groups
