"""The scheduler's cost does not grow with the number of jobs: with 2,000 queued jobs
(a third with deadlines, four tenants) one dispatch and one deadline check run a
bounded number of Redis commands (counted by Redis itself, INFO commandstats, which
counts the commands a script runs), never one per job. Command counts, not wall
time: the machine the tests run on is loaded."""

from __future__ import annotations

import time
from typing import Any

import redis

from batchgen.jobs.consumer.queue import read_new
from batchgen.jobs.ops import deadlines
from benchmarks.scheduler_scale import KEYS, MODEL, populate

QK = KEYS.queue_for_model(MODEL)


def commands(conn: redis.Redis) -> int:
    """Commands Redis ran so far, but the scripts' own calls and INFO/CONFIG."""
    stats: Any = conn.info("commandstats")
    return sum(v["calls"] for k, v in stats.items()
               if k.split("_", 1)[1] not in ("evalsha", "eval", "info", "config"))  # fmt: skip


def test_dispatch_and_the_deadline_check_run_a_bounded_number_of_commands(redis_url):
    conn = redis.Redis.from_url(redis_url)
    now = time.time()
    populate(conn, QK, 2000, lines=4, now=now)
    conn.hset(QK.fair, "work", 0.0)
    deadlines.check(conn, KEYS, QK, now=now)
    conn.hincrbyfloat(QK.fair, "work", 10.0)  # 10 tokens/s: jobs due within ~4 h are at risk
    conn.config_resetstat()
    deadlines.check(conn, KEYS, QK, now=now + 1)
    check_commands = commands(conn)
    urgent = sum(conn.zcard(f"{QK.base}:urgent:{c}") for c in range(1))
    conn.config_resetstat()
    got = read_new(conn, QK, "w", 16)
    dispatch_commands = commands(conn)
    assert len(got) == 16 and urgent > 0  # the check marked jobs urgent; dispatch served
    # the check looks at CHECK_BATCH deadline jobs (of 667), a handful of commands each
    assert check_commands <= 8 * deadlines.CHECK_BATCH + 50, check_commands
    # 16 requests from four-request jobs: a few commands a request, ~20 a job taken from
    assert dispatch_commands <= 250, dispatch_commands
