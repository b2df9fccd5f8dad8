"""Output tok/s over the last hour, for the fleet, each job and each worker.

The server samples every ``interval_s``: committed completion tokens per job
(from the job records) and generated tokens per worker (from their heartbeats'
counters, which arrive with each heartbeat: a rate over the last 30 s), as rates
since the previous sample. Each sample is one JSON member
of a sorted set scored by time; older than an hour is trimmed. With several
servers on one Redis, one takes each time slot (SET NX).
"""

from __future__ import annotations

import json
import time
from collections import deque
from typing import Any, cast

import redis

from batchgen.jobs.ops.status_report import all_statuses
from batchgen.jobs.redis.heartbeat import live_workers
from batchgen.jobs.redis.keys import Keys, text

WINDOW_S = 3600
WORKER_WINDOW_S = 30.0  # heartbeats carry a worker's counters every few seconds: rate over this


class Sampler:
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
        jobs = {s.record.id: s.record.completion_tokens for s in all_statuses(self.conn, self.keys)}
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
            job_rates = {j: round((n - self.jobs[j]) / dt, 2) for j, n in jobs.items()
                         if j in self.jobs and n > self.jobs[j]}  # fmt: skip
            point = {"t": round(now, 3), "fleet": round(sum(job_rates.values()), 2),
                     "jobs": job_rates, "workers": worker_rates}  # fmt: skip
            pipe = self.conn.pipeline(transaction=False)
            pipe.zadd(self.keys.series, {json.dumps(point, sort_keys=True): now})
            pipe.zremrangebyscore(self.keys.series, 0, now - WINDOW_S)
            pipe.execute()
        self.last_t, self.jobs = now, jobs
        return point


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
