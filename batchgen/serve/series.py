"""Output tok/s over the last hour, for the fleet, each job and each worker.

The server samples every ``interval_s`` the live workers' heartbeats: each carries,
per job, the completion tokens it generated per second over the last minute, counted
as they are generated (worker/loop/progress.py), the same rates `batchgen status`
sums. A job's point is its workers' sum, a worker's the sum over its jobs, the
fleet's the sum over the workers: rows that commit in a burst are no spike (the
tokens were counted as they were made), and long generations are no stall. Each
sample is one JSON member of a sorted set scored by time; older than an hour is
trimmed. With several servers on one Redis, one takes each time slot (SET NX).
"""

from __future__ import annotations

import json
import time
from typing import Any, cast

import redis

from batchgen.jobs.redis.heartbeat import live_workers
from batchgen.jobs.redis.keys import Keys, text

WINDOW_S = 3600


def worker_rate(worker: dict[str, Any]) -> float:
    """A live worker's output tok/s: over its jobs, from its heartbeat."""
    rates = (float(p.get("tokens_per_s", 0)) for p in worker.get("progress", {}).values())
    return round(sum(rates), 2)


class RateSampler:
    def __init__(self, conn: redis.Redis, keys: Keys, interval_s: float) -> None:
        self.conn, self.keys, self.interval_s = conn, keys, interval_s

    def sample(self, now: float | None = None) -> dict[str, Any] | None:
        now = time.time() if now is None else now
        slot = int(now // self.interval_s)
        ttl = max(int(self.interval_s * 3), 2)
        if not self.conn.set(self.keys.sampled(slot), "1", nx=True, ex=ttl):
            return None
        workers = live_workers(self.conn, self.keys)
        jobs: dict[str, float] = {}
        for w in workers:
            for job_id, progress in w.get("progress", {}).items():
                jobs[job_id] = jobs.get(job_id, 0.0) + float(progress.get("tokens_per_s", 0))
        job_rates = {j: round(r, 2) for j, r in jobs.items() if r > 0}
        worker_rates = {w["name"]: worker_rate(w) for w in workers}
        point = {"t": round(now, 3), "fleet": round(sum(worker_rates.values()), 2),
                 "jobs": job_rates, "workers": worker_rates}  # fmt: skip
        pipe = self.conn.pipeline(transaction=False)
        pipe.zadd(self.keys.series, {json.dumps(point, sort_keys=True): now})
        pipe.zremrangebyscore(self.keys.series, 0, now - WINDOW_S)
        pipe.execute()
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
