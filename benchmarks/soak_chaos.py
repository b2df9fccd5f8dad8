"""The soak's storm: faults at seeded points, reached by progress rather than by the clock.

Every tenth of a second it looks at the jobs and acts:
- kill: SIGKILL a random serving engine process of the supervisor once a
  seeded share of all rows has come in since the last kill (so a loaded
  machine, slow to restart a worker, still makes progress between kills);
- Redis: SIGKILL redis-server once, at a seeded share, and restart it on its
  AOF a second later;
- cancel: ``batchgen cancel`` the job "cancelled" at a seeded share of its
  short rows (a few of its requests are long: it cannot be done before), its
  engines stopped meanwhile, then wait (no kills meanwhile) until every
  serving worker says when it applied the cancel;
- storage: repair the job "broken" ``broken_for_s`` after its output first
  failed;
- finalize: SIGKILL the finalizer that froze at its crash point (once).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis

from batchgen.jobs.redis.heartbeat import live_workers
from batchgen.jobs.redis.keys import Keys

if TYPE_CHECKING:
    from batchgen.jobs.redis.redis_server import RedisServer
    from benchmarks.soak import SoakConfig, SoakResult

KEYS = Keys("bg")
JOBS = ("plain", "cancelled", "broken")
DOWN = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)


@dataclass(slots=True)
class CancelRecord:
    at_ms: int = 0  # when `batchgen cancel` returned
    rows: int = 0  # rows the job had then
    seen: dict[str, int] = field(default_factory=dict)  # worker -> ms it applied the cancel


def children(pid: int) -> dict[int, str]:
    """Live children of ``pid``: pid -> "STATE command line" (STATE as in /proc: T = stopped)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            found[int(stat.parent.name)] = f"{fields[0]} {cmdline}"
    return found


class Storm:
    def __init__(
        self, config: SoakConfig, server: RedisServer, supervisor: int, model: Path,
        outputs: dict[str, Path], cli: list[str], env: dict[str, str],
    ) -> None:  # fmt: skip
        self.config = config
        self.qk = KEYS.queue_for_model(str(model))
        self.server = server
        self.supervisor = supervisor
        self.outputs = outputs
        self.cli = cli
        self.env = env
        self.conn: Any = redis.Redis.from_url(server.url, socket_timeout=5)
        self.rng = random.Random(config.seed * 7919 + 1)
        self.total = config.requests * len(JOBS)
        self.redis_at = self.rng.uniform(0.3, 0.6)
        self.cancel_at = self.rng.uniform(0.1, 0.4)
        self.next_kill = self._gap()
        self.kills = self.redis_restarts = self.finalize_kills = 0
        self.cancel = CancelRecord()
        self.broken_since = 0.0
        self.broken_s = 0.0

    def _gap(self) -> int:
        lo, hi = self.config.kill_gap
        return max(1, int(self.rng.uniform(lo, hi) * self.total))

    def run_until_done(self) -> None:
        deadline = time.monotonic() + self.config.timeout_s
        rows_at_kill, killed_at = 0, time.monotonic()
        while True:
            assert time.monotonic() < deadline, f"not done in {self.config.timeout_s}s"
            time.sleep(0.1)
            try:
                jobs = {job: self.conn.hgetall(self.qk.job(job).job) for job in JOBS}
            except DOWN:
                continue
            done = {
                job: int(r.get(b"done", 0)) + int(r.get(b"failed", 0)) for job, r in jobs.items()
            }
            states = {job: r.get(b"state", b"").decode() for job, r in jobs.items()}
            if states == {"plain": "completed", "broken": "completed", "cancelled": "cancelled"}:
                return
            rows = sum(done.values())
            if not self.redis_restarts and rows >= self.redis_at * self.total:
                self.server.kill()
                time.sleep(1.0)
                self.server.start()
                self.redis_restarts += 1
                continue
            short = self.config.requests - self.config.long_requests
            if not self.cancel.at_ms and done["cancelled"] >= self.cancel_at * short:
                self._cancel()
                continue
            self._storage(jobs["broken"])
            self._finalizer()
            due = (rows - rows_at_kill >= self.next_kill
                   or (rows > rows_at_kill  # progress since: never kill a stalled fleet
                       and time.monotonic() - killed_at >= self.config.kill_every_s))  # fmt: skip
            if due and rows < self.config.kill_until * self.total and self._kill_one():
                rows_at_kill, self.next_kill, killed_at = rows, self._gap(), time.monotonic()

    def _engines(self) -> dict[int, str]:
        return {pid: cmd for pid, cmd in children(self.supervisor).items()
                if "worker.loop" in cmd and "finalizer" not in cmd}  # fmt: skip

    def _kill_one(self) -> bool:
        """SIGKILL a serving engine process (one with a heartbeat); whether one was."""
        try:
            serving = {int(w["pid"]) for w in live_workers(self.conn, KEYS) if w.get("pid")}
        except DOWN:
            return False
        pids = sorted(set(self._engines()) & serving)
        if not pids:
            return False
        try:
            os.kill(self.rng.choice(pids), signal.SIGKILL)
        except ProcessLookupError:
            return False
        self.kills += 1
        return True

    def _cancel(self) -> None:
        """Cancel the job "cancelled" with the CLI while every engine is stopped (SIGSTOP), so
        no row can land between the decision and the cancel however slow the CLI starts
        (on a fast machine the job used to finish while ``batchgen`` was still importing)."""
        engines = list(self._engines())
        for pid in engines:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(0.2)  # commits already on the wire land first
            record = self._job("cancelled")
            done = int(record.get(b"done", 0)) + int(record.get(b"failed", 0))
            if done >= self.config.requests:
                raise AssertionError("the job to cancel finished before the storm cancelled it")
            ran = subprocess.run([*self.cli, "cancel", "cancelled"], env=self.env,
                                 capture_output=True, text=True)  # fmt: skip
            assert ran.returncode == 0, ran.stderr
            self.cancel.at_ms, self.cancel.rows = int(time.time() * 1000), done
        finally:
            for pid in engines:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 60
        while True:  # every serving worker applies it; no kills meanwhile
            assert time.monotonic() < deadline, "workers did not apply the cancel"
            try:
                workers = live_workers(self.conn, KEYS)
            except DOWN:
                continue
            serving = [w for w in workers if int(w.get("pid", 0)) in self._engines()]
            seen = {w["name"]: w.get("cancels", {}).get("cancelled") for w in serving}
            if serving and all(seen.values()):
                self.cancel.seen = {name: int(ms) for name, ms in seen.items()}
                return
            time.sleep(0.05)

    def _job(self, job: str) -> dict[bytes, bytes]:
        deadline = time.monotonic() + 30
        while True:
            try:
                return self.conn.hgetall(self.qk.job(job).job)
            except DOWN:
                assert time.monotonic() < deadline, "Redis did not come back"
                time.sleep(0.1)

    def _storage(self, record: dict[bytes, bytes]) -> None:
        if self.broken_s or not record.get(b"storage_error"):
            return
        if not self.broken_since:
            self.broken_since = time.monotonic()
        elif time.monotonic() - self.broken_since >= self.config.broken_for_s:
            (self.outputs["broken"] / "parts").unlink()
            self.broken_s = round(time.monotonic() - self.broken_since, 1)

    def _finalizer(self) -> None:
        if self.finalize_kills:
            return
        for pid, cmd in children(self.supervisor).items():
            if "finalizer" in cmd and cmd.startswith("T "):  # frozen at its crash point
                os.kill(pid, signal.SIGKILL)
                self.finalize_kills += 1

    def report(self, result: SoakResult, worker_log: str) -> None:
        result.kills, result.redis_restarts = self.kills, self.redis_restarts
        result.finalize_kills, result.broken_s = self.finalize_kills, self.broken_s
        result.cancelled_at = self.cancel.rows
        result.restarts = len(re.findall(r"worker \d+ exited with .*; restarting", worker_log))
        for name, ok in [("no engine process was killed", self.kills > 0),
                         ("Redis was not restarted", self.redis_restarts == 1),
                         ("no finalize was killed", self.finalize_kills == 1),
                         ("the broken output was never repaired", self.broken_s > 0)]:  # fmt: skip
            if not ok:
                result.problems.append(name)
