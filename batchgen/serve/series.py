"""Output tok/s over the last hour, for the fleet, each job and each worker.

The server samples every ``interval_s``: committed completion tokens per job
(from the job records), as a rate over the part of the interval the job ran, and
generated tokens per worker (from their heartbeats' counters, which arrive with
each heartbeat: a rate over the last 30 s). Each sample is one JSON member
of a sorted set scored by time; older than an hour is trimmed. With several
servers on one Redis, one takes each time slot (SET NX).
"""

from __future__ import annotations

import json
import time
from collections import deque
from typing import Any, cast

import redis

from batchgen.jobs.ops.job_record import JobRecord
from batchgen.jobs.ops.status_report import all_statuses
from batchgen.jobs.redis.heartbeat import live_workers
from batchgen.jobs.redis.keys import Keys, text

WINDOW_S = 3600
WORKER_WINDOW_S = 30.0  # heartbeats carry a worker's counters every few seconds: rate over this
MIN_ACTIVE_S = 0.01  # a job that ran shorter than this within an interval: counted as this long


class RateSampler:
    def __init__(self, conn: redis.Redis, keys: Keys, interval_s: float) -> None:
        self.conn, self.keys, self.interval_s = conn, keys, interval_s
        self.last_t = 0.0
        self.jobs: dict[str, int] = {}  # completion tokens at the last sample
        self.history: dict[str, deque[tuple[float, int]]] = {}  # worker -> (t, generated tokens)

    def sample(self, now: float | None = None) -> dict[str, Any] | None:
        now = time.time() if now is None else now
        slot = int(now // self.interval_s)
        ttl = max(int(self.interval_s * 3), 2)
        if not self.conn.set(self.keys.sampled(slot), "1", nx=True, ex=ttl):
            return None
        records = {s.record.id: s.record for s in all_statuses(self.conn, self.keys)}
        jobs = {job_id: record.completion_tokens for job_id, record in records.items()}
        workers = {w["name"]: int(w.get("counters", {}).get("generation_tokens", 0))
                   for w in live_workers(self.conn, self.keys)}  # fmt: skip
        worker_rates = {}
        for name, tokens in workers.items():
            seen = self.history.setdefault(name, deque())
            seen.append((now, tokens))
            while len(seen) > 2 and seen[1][0] <= now - WORKER_WINDOW_S:
                seen.popleft()
            t0, n0 = seen[0]
            worker_rates[name] = round(max(tokens - n0, 0) / (now - t0), 2) if now > t0 else 0.0
        self.history = {w: h for w, h in self.history.items() if w in workers}
        dt = now - self.last_t
        point = None
        if self.last_t and dt > 0:
            # a job not seen at the last sample was created since: all its tokens are new
            job_rates = {j: round((n - self.jobs.get(j, 0)) / self._active(records[j], now), 2)
                         for j, n in jobs.items() if n > self.jobs.get(j, 0)}  # fmt: skip
            point = {"t": round(now, 3), "fleet": round(sum(job_rates.values()), 2),
                     "jobs": job_rates, "workers": worker_rates}  # fmt: skip
            pipe = self.conn.pipeline(transaction=False)
            pipe.zadd(self.keys.series, {json.dumps(point, sort_keys=True): now})
            pipe.zremrangebyscore(self.keys.series, 0, now - WINDOW_S)
            pipe.execute()
        self.last_t, self.jobs = now, jobs
        return point

    def _active(self, record: JobRecord, now: float) -> float:
        """The part of the interval since the last sample in which the job ran (from
        its start, the first read of one of its requests, to its end): the tokens it
        committed meanwhile are a rate over that time, not over idle time around a short
        job. So the job's own tok/s (tokens over its running time) never exceeds its
        highest point here."""
        start = max(self.last_t, record.started_at or self.last_t)
        end = min(now, record.finished_at) if record.finished_at > start else now
        return max(end - start, MIN_ACTIVE_S)


def read_series(conn: redis.Redis, keys: Keys, since_s: float = WINDOW_S) -> list[dict[str, Any]]:
    raw = conn.zrangebyscore(keys.series, time.time() - since_s, "+inf")
    return [json.loads(text(m)) for m in raw]


def forget_job(conn: redis.Redis, keys: Keys, job_id: str) -> None:
    """Take ``job_id``'s line out of every sample (its batch was deleted)."""
    samples = cast(list[tuple[bytes, float]],
                   conn.zrangebyscore(keys.series, "-inf", "+inf", withscores=True))  # fmt: skip
    for raw, score in samples:
        point = json.loads(text(raw))
        if job_id in point.get("jobs", {}):
            del point["jobs"][job_id]
            pipe = conn.pipeline(transaction=True)
            pipe.zrem(keys.series, raw)
            pipe.zadd(keys.series, {json.dumps(point, sort_keys=True): score})
            pipe.execute()
