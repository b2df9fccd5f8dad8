"""Whether Redis refuses writes right now, for ``batchgen status``'s outage line.

Workers, supervisors, finalizers and serve wait out a refusing server (OOM, MISCONF,
READONLY, BUSY, LOADING: connection.py's RedisRefused) and log it; status asks the
server the same question they do, with a write that changes nothing (SETRANGE of an
empty value on a key that does not exist: Redis refuses it as it refuses any write,
and creates no key), so what it says is what the workers meet. A server that refuses reads too (BUSY,
LOADING) fails status's own reads first: the CLI's one-line "cannot serve now".
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from batchgen.jobs.redis.connection import RedisRefused
from batchgen.jobs.redis.keys import Keys

_WHAT_TO_DO = {
    "OOM": "raise maxmemory or free memory",
    "MISCONF": "its last snapshot or AOF write failed: see the Redis log (a full disk?)",
    "READONLY": "the server is a replica now: point --redis at the primary",
    "BUSY": "a script runs past lua-time-limit: SCRIPT KILL stops it",
    "LOADING": "it is loading its dataset at start",
}


def refused_writes(conn: redis.Redis, keys: Keys) -> str | None:
    """The outage line when Redis refuses a write now; None when it takes one."""
    try:
        conn.setrange(keys.write_probe, 0, "")
    except RedisRefused as exc:
        hint = _WHAT_TO_DO.get(exc.code, "")
        return (f"Redis refuses writes ({exc.code}: {str(exc).removeprefix(exc.code + ' ')}); "
                f"workers and serve wait and resume on their own, nothing is lost; {hint}")  # fmt: skip
    return None


class OutageLog:
    """Says an outage once when it starts and once when it ends, however often the
    caller retries meanwhile (a loop that logged each retry would flood its log). The
    threads of one process may share one: the first to meet the outage says it, the
    first that Redis serves again says it ended."""

    def __init__(self, log: logging.Logger, who: str) -> None:
        self.log, self.who = log, who  # what waits: "finalizer", "renewing lease K"
        self.since: float | None = None
        self._lock = threading.Lock()

    def down(self, reason: object) -> None:
        with self._lock:
            if self.since is None:
                self.since = time.monotonic()
                self.log.warning("%s waits for Redis: %s", self.who, reason)

    def up(self) -> None:
        if self.since is None:  # the hot path: no outage, no lock
            return
        with self._lock:
            if self.since is not None:
                waited = time.monotonic() - self.since
                self.log.warning("%s resumes: Redis serves again after %.0fs", self.who, waited)
                self.since = None
