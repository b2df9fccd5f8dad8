"""A thread that keeps the worker's claims and heartbeat fresh, and hears cancels at once.

The queue loop's main thread spends most of its time in engine steps and part
writes; one of those can outlast the claim timeout (a Triton JIT, a slow
store), and claims refreshed between steps would then look dead: other
workers would take live work. This thread does, on its own connection and
its own clock:

- refresh: XCLAIM JUSTID of the entries the loop holds (a snapshot it
  publishes each tick), every claim_timeout / 4; entries another worker took
  meanwhile are reported back (``take_stolen``);
- heartbeat: the loop's latest payload, with a TTL, every heartbeat_s (and the
  loop sends one itself right after it committed rows: ``beat_now``);
- cancels: subscribed to the queue's events channel, where ``batchgen cancel``
  publishes, so the loop learns of a cancel within a step; the cancelled set
  is also read every cancel_poll_s in case a message was missed;
- work: submit, retry and hand-backs publish ``work`` on the same channel; it
  sets ``work``, which an idle loop waits on (and reads again at least every
  block_ms in case a message was missed).

The loop reads what this thread learned with plain attribute reads (no lock
on the hot path: a snapshot is replaced whole, never mutated).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import redis

from batchgen.jobs.redis import heartbeat
from batchgen.jobs.redis.keys import Keys, QueueKeys, text
from batchgen.jobs.redis.outage_probe import OutageLog
from batchgen.worker.consumer.queue import refresh
from batchgen.worker.loop.loop_config import LoopConfig

log = logging.getLogger(__name__)
_REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)


class Keeper(threading.Thread):
    def __init__(self, conn: redis.Redis, keys: Keys, qk: QueueKeys, config: LoopConfig,
                 outage: OutageLog) -> None:  # fmt: skip
        super().__init__(name="batchgen-keeper", daemon=True)
        self.conn = conn
        self.outage = outage  # the worker's: an outage is logged once, whoever meets it
        self.keys = keys
        self.qk = qk
        self.config = config
        self.held: tuple[str, ...] = ()  # set by the loop: the entries it holds
        self.payload: dict[str, Any] = {}  # set by the loop: what the heartbeat carries
        self.cancelled: frozenset[str] = frozenset()  # read by the loop
        self.work = threading.Event()  # set when new work was announced; the loop clears it
        self._beat_lock = threading.Lock()  # one sender at a time: the newest payload lands last
        self._stolen: set[str] = set()
        self._lock = threading.Lock()  # guards _stolen and the publishing of ``cancelled``
        self._cancelled_read_at = 0.0
        self._halt = threading.Event()
        self._pubsub: Any = None

    # -- the loop's side ----------------------------------------------------------

    def take_stolen(self) -> set[str]:
        """Entries another worker claimed since the last call."""
        if not self._stolen:
            return set()
        with self._lock:
            stolen, self._stolen = self._stolen, set()
        return stolen

    def beat_now(self, payload: dict[str, Any]) -> None:
        """Send ``payload`` now, from the loop's thread (it just committed rows: their
        tokens must leave the payload's pending ones at once, or status counts them
        twice until the next beat). Redis down: the next beat sends it."""
        with self._beat_lock:
            self.payload = payload
            with contextlib.suppress(*_REDIS_DOWN):
                self._send()

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(timeout=10)

    def poll_cancelled(self) -> frozenset[str]:
        """Read the cancelled set now (the loop calls this right after reading entries).

        Both threads call it: a read that started before the newest one published is
        returned but not published, so the loop never sees the set go back in time."""
        started = time.monotonic()
        fresh = frozenset(text(m) for m in self.conn.smembers(self.qk.cancelled))
        with self._lock:
            if started >= self._cancelled_read_at:
                self._cancelled_read_at = started
                self.cancelled = fresh
        return fresh

    # -- the thread ---------------------------------------------------------------

    def run(self) -> None:
        c = self.config
        chores = [
            (self._refresh, c.refresh_s),
            (self._heartbeat, c.heartbeat_s),
            (self.poll_cancelled, c.cancel_poll_s),
        ]
        due = [0.0] * len(chores)
        while not self._halt.is_set():
            try:
                for i, (chore, every) in enumerate(chores):
                    if time.monotonic() >= due[i]:
                        chore()
                        due[i] = time.monotonic() + every
                # short waits: stop() is answered within a quarter second
                self._listen(min(max(min(due) - time.monotonic(), 0.01), 0.25))
                self.outage.up()
            except _REDIS_DOWN as exc:
                self.outage.down(f"Redis unavailable ({exc})")
                self._close_pubsub()
                self._halt.wait(0.2)
            except Exception:  # keep the claims alive whatever happens here
                log.exception("keeper: unexpected error; going on")
                self._halt.wait(0.2)
        self._close_pubsub()

    def _refresh(self) -> None:
        held = self.held
        gone = refresh(self.conn, self.qk, self.config.name, list(held))
        if gone:
            with self._lock:
                self._stolen.update(gone)

    def _heartbeat(self) -> None:
        with self._beat_lock:
            self._send()

    def _send(self) -> None:
        if self.payload:
            ttl = max(int(self.config.heartbeat_s * 3), 2)
            heartbeat.beat(self.conn, self.keys, self.config.name, self.payload, ttl)

    def _listen(self, timeout: float) -> None:
        """Wait up to ``timeout`` for an event; a cancel re-reads the cancelled set, new
        work wakes the loop."""
        if self._pubsub is None:
            self._pubsub = self.conn.pubsub(ignore_subscribe_messages=True)
            self._pubsub.subscribe(self.qk.events)
            self.poll_cancelled()  # anything published before we listened
        message = self._pubsub.get_message(timeout=timeout)
        data = text(message.get("data")) if message is not None else ""
        if data == "work":
            self.work.set()
        elif data.startswith("cancel:"):
            self.poll_cancelled()

    def _close_pubsub(self) -> None:
        if self._pubsub is not None:
            with contextlib.suppress(Exception):  # a broken connection closes as it can
                self._pubsub.close()
            self._pubsub = None
