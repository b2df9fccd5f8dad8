"""A lease: one holder at a time for a piece of work, lost when the holder dies.

A key set with NX and a TTL holds a random token. The holder renews it from a
thread while it works (so a long step does not lose it) and deletes it when
done, both only while the token is still its own. A holder that is killed
stops renewing; the key expires and someone else may take the work over.

A lease that only says "this process is alive" (``retake``: serve's instance lease,
which keeps other servers off its uploads) is taken back when a renewal finds it
expired (Redis was out of reach for longer than the TTL) and nobody else holds it.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
from types import TracebackType

import redis

from batchgen.jobs.redis.lua import LuaScript
from batchgen.jobs.redis.outage_probe import OutageLog
from batchgen.jobs.schema.errors import LeaseHeld

log = logging.getLogger(__name__)

RENEW = LuaScript.define(
    "renew lease",
    keys=[("lease", "the lease key")],
    args=[("token", "the holder's token"), ("ttl_ms", "")],
    body="""
if redis.call('GET', lease) ~= token then return 0 end
redis.call('PEXPIRE', lease, ttl_ms)
return 1
""",
)

RELEASE = LuaScript.define(
    "release lease",
    keys=[("lease", "the lease key")],
    args=[("token", "the holder's token")],
    body="""
if redis.call('GET', lease) ~= token then return 0 end
return redis.call('DEL', lease)
""",
)


class Lease:
    """``with Lease(conn, key, ttl_s, owner):`` holds ``key`` for the block, renewed meanwhile;
    ``retake``: an expired one is taken back (see the module's doc)."""

    def __init__(
        self, conn: redis.Redis, key: str, ttl_s: float, owner: str, *, retake: bool = False
    ) -> None:
        self.conn = conn
        self.retake = retake
        self.key = key
        self.ttl_ms = max(int(ttl_s * 1000), 100)
        self.token = f"{owner}/{secrets.token_hex(8)}"
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self.lost = False  # a renewal found the lease gone (expired while we were stalled)

    def __enter__(self) -> Lease:
        if not self.conn.set(self.key, self.token, nx=True, px=self.ttl_ms):
            raw = self.conn.get(self.key)
            holder = raw.decode() if isinstance(raw, bytes) else str(raw or "?")
            raise LeaseHeld(self.key, holder.split("/")[0])
        self._renewer = threading.Thread(target=self._renew, name=f"lease {self.key}", daemon=True)
        self._renewer.start()
        return self

    def _renew(self) -> None:
        outage = OutageLog(log, f"renewing lease {self.key}")
        while not self._stop.wait(self.ttl_ms / 3000):
            try:
                if not RENEW(self.conn, lease=self.key, token=self.token, ttl_ms=self.ttl_ms):
                    if self.retake and self.conn.set(self.key, self.token, nx=True,
                                                     px=self.ttl_ms):  # fmt: skip
                        log.warning("lease %s had expired (Redis out of reach past its TTL); "
                                    "taken back", self.key)  # fmt: skip
                        outage.up()
                        continue
                    self.lost = True
                    log.error("lease %s was lost (expired while this process stalled)", self.key)
                    return
                outage.up()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                outage.down(exc)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
            RELEASE(self.conn, lease=self.key, token=self.token)  # else it expires on its own
