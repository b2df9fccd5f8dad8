"""A worker says a Redis outage in two lines, one when it starts and one when it ends,
as the finalizer and serve do (OutageLog, jobs/redis/outage_probe.py), however often its
loop, upkeep and keeper thread retry meanwhile. Real Redis, killed and started again;
the engine is the test double."""

from __future__ import annotations

import logging
import time
from typing import Any

from batchgen.jobs.redis.connection import connect
from tests.engine_double import FakeEngine, expected_tokens
from tests.test_queue_loop import _restore_signals as _restore_signals  # autouse fixture
from tests.test_queue_loop import finish, make_job, make_loop, rows, tokens

WAITS = "worker waits for Redis: Redis unavailable ("
RESUMES = "worker resumes: Redis serves again after "


def test_a_worker_logs_an_outage_once_when_it_starts_and_once_when_it_ends(
    private_redis, tmp_path, caplog
):
    caplog.set_level(logging.WARNING)
    conn: Any = connect(private_redis.url, retries=1)
    out = make_job(conn, tmp_path, [f"p{i}" for i in range(20)], max_tokens=3)
    engine = FakeEngine(max_num_seqs=4)
    loop = make_loop(conn, engine, flush_interval_s=0.0)
    loop.start_keeper()  # its claims, heartbeat and cancels: retried on its own clock
    loop.tick()
    assert len(engine.running) == 4
    private_redis.kill()
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        loop.tick()  # reads back off, commits fail, upkeep is skipped
    private_redis.start()
    finish(conn, loop)
    assert loop.counters["redis_outages"] >= 5  # the loop retried, many times
    # every warning the worker logged: the outage's two lines, none a retry
    said = [r.getMessage() for r in caplog.records if r.name.startswith("batchgen.worker")]
    assert len(said) == 2 and said[0].startswith(WAITS) and said[1].startswith(RESUMES), said
    result = rows(out)
    assert result["index"] == list(range(20))
    assert result["token_ids"] == [expected_tokens(tokens(f"p{i}"), 3) for i in range(20)]
