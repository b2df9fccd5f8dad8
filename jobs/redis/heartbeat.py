"""Worker heartbeats: a key per worker with a TTL, indexed in a sorted set; and the
announcements of worker supervisors (the same, per supervisor), which say a model's
workers are starting before their engines have loaded (and hashed) the weights.

Liveness comes from these keys, never from XINFO CONSUMERS (a consumer's idle
time grows while it is busy generating, and its meaning changed in Redis 7.2):
a worker whose key expired is dead, whatever its consumer entry says.
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from batchgen.jobs.redis.keys import Keys, text


def beat(
    conn: redis.Redis, keys: Keys, name: str, payload: dict[str, Any], ttl_s: int, pipeline=None
) -> None:
    pipe = pipeline if pipeline is not None else conn.pipeline(transaction=False)
    pipe.set(keys.worker(name), json.dumps(payload), ex=ttl_s)
    pipe.zadd(keys.workers, {name: time.time()})
    if pipeline is None:
        pipe.execute()


def retire(conn: redis.Redis, keys: Keys, name: str, pipeline=None) -> None:
    pipe = pipeline if pipeline is not None else conn.pipeline(transaction=False)
    pipe.delete(keys.worker(name))
    pipe.zrem(keys.workers, name)
    if pipeline is None:
        pipe.execute()


def live_workers(conn: redis.Redis, keys: Keys, tag: str | None = None) -> list[dict[str, Any]]:
    """Heartbeat payloads of live workers (of one queue when ``tag`` is given)."""
    names = [text(n) for n in conn.zrange(keys.workers, 0, -1)]
    if not names:
        return []
    payloads = conn.mget([keys.worker(n) for n in names])
    live = []
    for raw in payloads:
        if raw is None:
            continue
        data = json.loads(raw)
        if tag is None or data.get("tag") == tag:
            live.append(data)
    stale = conn.zrangebyscore(keys.workers, 0, time.time() - 3600)
    if stale:
        conn.zrem(keys.workers, *stale)  # keep the index small; keys expired long ago
    return live


def announce(conn: redis.Redis, keys: Keys, name: str, queue: str, ttl_s: int) -> None:
    """Supervisor ``name`` runs workers for ``queue`` (refreshed while it lives)."""
    pipe = conn.pipeline(transaction=False)
    pipe.set(keys.supervisor(name), json.dumps({"queue": queue}), ex=ttl_s)
    pipe.zadd(keys.supervisors, {name: time.time()})
    pipe.execute()


def withdraw(conn: redis.Redis, keys: Keys, name: str) -> None:
    pipe = conn.pipeline(transaction=False)
    pipe.delete(keys.supervisor(name))
    pipe.zrem(keys.supervisors, name)
    pipe.execute()


def starting_queues(conn: redis.Redis, keys: Keys) -> set[str]:
    """The queues that live supervisors run (or are starting) workers for."""
    names = [text(n) for n in conn.zrange(keys.supervisors, 0, -1)]
    if not names:
        return set()
    payloads = conn.mget([keys.supervisor(n) for n in names])
    gone = [n for n, raw in zip(names, payloads) if raw is None]
    if gone:
        conn.zrem(keys.supervisors, *gone)
    return {json.loads(raw)["queue"] for raw in payloads if raw is not None}
