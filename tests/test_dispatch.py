"""The dispatch script against a real redis-server: which requests a worker takes next.

No worker here: ``read_new`` is what a worker calls each time it has room, so these
tests read as workers would and check who got what, exactly.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from itertools import groupby
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.jobs.ops.fair_share import backlog, deadlines, tenants
from batchgen.jobs.ops.fair_share.backlog import prefix_group
from batchgen.jobs.ops.fair_share.schedule import Schedule
from batchgen.jobs.ops.job_record import load_job
from batchgen.jobs.ops.submission import submit
from batchgen.jobs.redis.keys import BACKLOG_GROUPS, GROUP, Keys
from batchgen.jobs.schema.entry import QueuedRequest
from batchgen.jobs.schema.sampling import DEFAULTS
from batchgen.worker.consumer.queue import read_new
from batchgen.worker.loop.affinity import owned
from batchgen.worker.loop.loop_config import LoopConfig
from batchgen.worker.supervisor.supervisor import Supervisor

KEYS = Keys("bg")
QK = KEYS.queue_for_model("m")


def rconn(url: str) -> Any:
    return redis.Redis.from_url(url)


def job(conn, tmp_path: Path, job_id: str, n: int, schedule: Schedule | None = None,
        prompt: str = "prompt {i}", **defaults) -> None:  # fmt: skip
    src = tmp_path / f"{job_id}.jsonl"
    src.write_text("".join(json.dumps({"prompt": prompt.format(i=i)}) + "\n" for i in range(n)))
    submit(conn, KEYS, source_path=str(src), model="m", output=str(tmp_path / f"out-{job_id}"),
           defaults={**DEFAULTS, **defaults}, job_id=job_id, schedule=schedule)  # fmt: skip


def jobs_of(deliveries) -> list[str]:
    return [d.job_id for d in deliveries]


def test_a_small_job_behind_a_big_one_is_taken_at_the_next_read(redis_url, tmp_path):
    conn = rconn(redis_url)
    job(conn, tmp_path, "big", 300)
    first = read_new(conn, QK, "w", 8)
    assert jobs_of(first) == ["big"] * 8 and [d.index for d in first] == list(range(8))
    metrics = Supervisor(conn, LoopConfig(model="m"), [], None).metrics()
    (backlog,) = [f for f in metrics if f.name == "batchgen_queue_backlog"]
    assert [(s.labels, s.value) for s in backlog.samples] == [({"model": "m"}, 292)]
    job(conn, tmp_path, "small", 5)
    # the worker has room for 3 more: the small job's first three, then its last two
    assert [(d.job_id, d.index) for d in read_new(conn, QK, "w", 3)] == [
        ("small", i) for i in range(3)
    ]
    again = read_new(conn, QK, "w", 4)
    assert [(d.job_id, d.index) for d in again][:2] == [("small", 3), ("small", 4)]
    assert jobs_of(again)[2:] == ["big", "big"]
    record = load_job(conn, KEYS, "small")
    assert (record.backlog, conn.sismember(QK.ready, "small")) == (0, False)
    assert record.last_id == again[1].entry_id  # the newest stream entry of the job


def test_equal_jobs_take_equal_shares_and_weights_are_shares_of_tokens(redis_url, tmp_path):
    conn = rconn(redis_url)
    job(conn, tmp_path, "a", 400, Schedule(tenant="t1"))
    job(conn, tmp_path, "b", 400, Schedule(tenant="t1"))
    got = Counter(jobs_of(d for _ in range(20) for d in read_new(conn, QK, "w", 8)))
    assert got == {"a": 80, "b": 80}
    # tenants by weight: heavy has 3, light 1; light's requests cost twice as much
    # (max_tokens 32 against 16): in tokens heavy gets three times light's share
    tenants.save(conn, KEYS, tenants.Tenant("heavy", weight=3))
    job(conn, tmp_path, "h", 900, Schedule(tenant="heavy"), prompt="{i:04d}", max_tokens=16)
    job(conn, tmp_path, "l", 900, Schedule(tenant="light"), prompt="{i:04d}", max_tokens=32)
    cost = {j: load_job(conn, KEYS, j).cost for j in ("h", "l")}
    for _ in range(2):  # catch up with the tenant that ran before, then share
        read_new(conn, QK, "w", 400)
    got = Counter(d.job_id for _ in range(30) for d in read_new(conn, QK, "w", 16)
                  if d.job_id in "hl")  # fmt: skip
    ratio = got["h"] * cost["h"] / (got["l"] * cost["l"])
    assert ratio == pytest.approx(3, rel=0.1), (got, cost)


def test_a_higher_class_goes_first_and_a_new_job_gets_no_credit_for_idle_time(redis_url, tmp_path):
    conn = rconn(redis_url)
    job(conn, tmp_path, "low", 50)
    read_new(conn, QK, "w", 40)  # low ran alone for a while: its virtual time is high
    job(conn, tmp_path, "high", 30, Schedule(priority=5))
    assert jobs_of(read_new(conn, QK, "w", 40)) == ["high"] * 30 + ["low"] * 10
    # a job arriving now starts at the clock, level with the one that ran all along
    job(conn, tmp_path, "low2", 100)
    job(conn, tmp_path, "low3", 100)
    got = Counter(jobs_of(read_new(conn, QK, "w", 32)))
    assert got == {"low2": 16, "low3": 16}


def measured_rate(conn, now: float, tokens_per_s: float = 10.0) -> None:
    """The deadline check measures the fleet at ``tokens_per_s`` from ``now`` on."""
    conn.hincrbyfloat(QK.fair, "work", 0.0)
    deadlines.check(conn, KEYS, QK, now=now)  # first sample of the committed work
    conn.hincrbyfloat(QK.fair, "work", tokens_per_s)  # commits add each row's cost here
    deadlines.check(conn, KEYS, QK, now=now + 1)


def runs(deliveries) -> list[tuple[str, int]]:
    """The jobs in dispatch order, as (job, how many in a row)."""
    return [(j, len(list(g))) for j, g in groupby(jobs_of(deliveries))]


def test_at_risk_jobs_go_first_within_half_the_model_earliest_deadline_first(redis_url, tmp_path):
    """A fleet doing 10 tokens/s: the job due in 100 s cannot finish at its share (a
    third) but can at half the model, so it is at risk: served first, but urgent picks
    take at most half the tokens, so the fair order gets every other turn."""
    conn = rconn(redis_url)
    now = time.time()
    job(conn, tmp_path, "bulk", 500, max_tokens=8)
    job(conn, tmp_path, "later", 40, Schedule(deadline=now + 3600), max_tokens=8)
    job(conn, tmp_path, "soon", 40, Schedule(deadline=now + 100), max_tokens=8)
    cost = load_job(conn, KEYS, "soon").cost
    measured_rate(conn, now)
    soon, later = load_job(conn, KEYS, "soon"), load_job(conn, KEYS, "later")
    assert (soon.urgent, soon.late, later.urgent, later.late) == (True, False, False, False)
    assert now + 1 + 40 * cost / (10 / 3) > now + 100 >= now + 1 + 40 * cost / 5
    assert soon.eta == pytest.approx(now + 1 + 40 * cost / 5)  # at half the model
    assert later.eta == pytest.approx(now + 1 + 40 * cost / (10 / 3))  # a third of it
    on_track = {"deadline": now + 3600, "state": "on_track", "eta": later.eta, "expire": False}
    assert deadlines.deadline_view(later, now + 1) == on_track
    assert runs(read_new(conn, QK, "w", 40)) == [("soon", 16), ("bulk", 16), ("soon", 8)]
    # a job due sooner is at risk too: urgent picks go by deadline, fair picks between
    job(conn, tmp_path, "sooner", 10, Schedule(deadline=now + 40), max_tokens=8)
    conn.hincrbyfloat(QK.fair, "work", 10.0)
    deadlines.check(conn, KEYS, QK, now=now + 2)
    assert [load_job(conn, KEYS, j).urgent for j in ("soon", "sooner", "later")] == [
        True, True, False]  # fmt: skip
    assert runs(read_new(conn, QK, "w", 64)) == [
        ("later", 16), ("sooner", 10), ("later", 16), ("soon", 16), ("bulk", 6)]  # fmt: skip
    view = deadlines.deadline_view(load_job(conn, KEYS, "sooner"), now + 2)
    assert view is not None and view["state"] == "at_risk"
    view = deadlines.deadline_view(load_job(conn, KEYS, "sooner"), now + 41)
    assert view is not None and view["state"] == "late"


def test_a_job_that_cannot_make_its_deadline_is_late_and_served_at_its_fair_share(
    redis_url, tmp_path
):
    """1,000 lines due in 10 minutes at 10 tokens/s would not make it with the whole
    model: it is late (status says so) and shares by weight; another tenant's 10-line
    job does not wait for it."""
    conn = rconn(redis_url)
    now = time.time()
    job(conn, tmp_path, "huge", 1000, Schedule(tenant="a", deadline=now + 600), max_tokens=8)
    job(conn, tmp_path, "small", 10, Schedule(tenant="b"), max_tokens=8)
    measured_rate(conn, now)
    huge = load_job(conn, KEYS, "huge")
    assert (huge.urgent, huge.late) == (False, True)
    assert huge.eta == pytest.approx(now + 1 + 1000 * huge.cost / 5)  # half: two tenants
    view = deadlines.deadline_view(huge, now + 1)
    assert view is not None and view["state"] == "late"
    assert "(it cannot make it at any share it may take: served at its fair share)" in (
        deadlines.describe(view))  # fmt: skip
    assert runs(read_new(conn, QK, "w", 32)) == [("huge", 16), ("small", 10), ("huge", 6)]


def test_a_deadline_gives_no_urgency_over_a_higher_class(redis_url, tmp_path):
    """A priority -1000 job due in a second waits for the priority 1000 job: its class
    has no share while a higher one has work, so it is late, not urgent."""
    conn = rconn(redis_url)
    now = time.time()
    job(conn, tmp_path, "low", 5, Schedule(priority=-1000, deadline=now + 1.5), max_tokens=8)
    job(conn, tmp_path, "high", 20, Schedule(priority=1000), max_tokens=8)
    measured_rate(conn, now)
    low = load_job(conn, KEYS, "low")
    assert (low.urgent, low.late) == (False, True)
    assert runs(read_new(conn, QK, "w", 25)) == [("high", 20), ("low", 5)]


def test_expire_cancels_at_the_deadline_and_keeps_running_without_it(redis_url, tmp_path):
    conn = rconn(redis_url)
    now = time.time()
    job(conn, tmp_path, "strict", 5, Schedule(deadline=now + 10, expire=True))
    job(conn, tmp_path, "lenient", 5, Schedule(deadline=now + 10))
    read_new(conn, QK, "w", 2)
    assert deadlines.check(conn, KEYS, QK, now=now + 11) == ["strict"]
    strict, lenient = load_job(conn, KEYS, "strict"), load_job(conn, KEYS, "lenient")
    assert (strict.state.value, strict.backlog) == ("cancelling", 0)
    # running since the read took its first requests; the rest wait in its backlog
    assert lenient.state.value == "running" and lenient.backlog > 0
    view = deadlines.deadline_view(lenient, now + 11)
    assert view is not None and view["state"] == "late"
    assert deadlines.describe(view).endswith("keeps running (submitted without --expire)")
    conn.hset(QK.job("lenient").job, "deadline", repr(time.time() - 1))  # late by the clock
    shown = CliRunner().invoke(main, ["status", "lenient", "--redis", redis_url])
    assert shown.exit_code == 0 and shown.stderr == (
        "batchgen: warning: job lenient is past its deadline and keeps running (it was "
        "submitted without --expire); `batchgen cancel lenient` stops it, its finished rows "
        "kept\n"
    )
    shown = CliRunner().invoke(main, ["status", "strict", "--redis", redis_url])
    assert shown.exit_code == 0 and shown.stderr == ""


def test_each_worker_takes_its_own_prefix_groups_first_and_steals_when_they_are_empty(
    redis_url, tmp_path
):
    conn = rconn(redis_url)
    system = "You are a careful assistant. " * 12  # > PREFIX_BYTES: the prefix decides
    lines = [f"{i % 8}: {system} question {i}" for i in range(64)]
    job(conn, tmp_path, "fs", 64, prompt="{i}")
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in lines))
    group = [prefix_group(QueuedRequest(prompt=p, sampling=dict(DEFAULTS)).encode()) for p in lines]
    assert len({group[i] for i in range(8)}) > 1 and all(
        group[i] == group[i % 8] for i in range(64))  # fmt: skip
    mine = {w: owned(w, {"w1", "w2"}) for w in ("w1", "w2")}
    assert sorted(mine["w1"] + mine["w2"]) == list(range(BACKLOG_GROUPS))
    own = {w: [i for i in range(64) if group[i] in mine[w]] for w in mine}
    thief, victim = sorted(mine, key=lambda w: len(own[w]))  # the one with less of its own
    conn.delete(*QK.job("fs").backlogs)
    conn.srem(QK.ready, "fs")
    submit(conn, KEYS, source_path=str(src), model="m", output=str(tmp_path / "o2"),
           defaults=dict(DEFAULTS), job_id="prefixed")  # fmt: skip
    got = read_new(conn, QK, thief, len(own[thief]), mine[thief])
    assert [d.index for d in got] == own[thief]  # its own groups, in input order
    # its groups are empty: it takes from the other's fullest group, in input order
    counts = Counter(group[i] for i in own[victim])
    fullest = min(counts, key=lambda g: (-counts[g], g))  # the first of the fullest
    stolen = read_new(conn, QK, thief, 3, mine[thief])
    assert [d.index for d in stolen] == [i for i in own[victim] if group[i] == fullest][:3]
    rest = read_new(conn, QK, victim, 64, mine[victim])
    assert sorted(d.index for d in rest) == sorted(set(own[victim]) - {d.index for d in stolen})


def test_an_entry_without_its_queue_time_becomes_its_error_row(redis_url, tmp_path):
    """Every entry says when it was queued (``q``, which dispatch writes); one without it
    (planted, or written by hand) is not served: it becomes its job's error row."""
    conn = rconn(redis_url)
    job(conn, tmp_path, "j", 3)
    read_new(conn, QK, "ghost", 3)  # all three dispatched to the stream, held by a ghost
    ((entry_id, fields),) = [e for e in conn.xrange(QK.stream) if e[1][b"i"] == b"1"]
    conn.xack(QK.stream, GROUP, entry_id)
    conn.xdel(QK.stream, entry_id)
    del fields[b"q"]
    unqueued = conn.xadd(QK.stream, fields).decode()
    assert read_new(conn, QK, "w", 3) == []
    reason = f"stream entry {unqueued} cannot be read: it has no 'q' field (when it was queued)"
    ((_, dead),) = conn.xrange(QK.job("j").dead)
    assert (dead[b"i"], dead[b"reason"].decode()) == (b"1", reason)
    assert json.loads(conn.hget(QK.job("j").errors, "1"))["error"] == f"dead-lettered: {reason}"
    assert conn.xlen(QK.stream) == 2  # the ghost's two; the unreadable one is gone


def test_a_retried_request_carries_the_deliveries_that_ran_it_before(redis_url, tmp_path):
    """A retry queues a row's request with the attempts its row had: the backlog item
    carries them, dispatch hands them on (the entry's ``x``), and the delivery counts
    them in ``attempts`` but not toward ``max_attempts``."""
    conn = rconn(redis_url)
    job(conn, tmp_path, "r", 3)
    queued = backlog.queued(conn, QK, "r")
    conn.delete(*QK.job("r").backlogs)
    items = backlog.items([(i, request) for i, _, request in queued], queued_ms=1234,
                          prior_runs={1: 2, 2: 0})  # fmt: skip
    conn.rpush(QK.job("r").backlogs[int(items[0])], *items[1::2])  # one list, in order
    assert backlog.queued(conn, QK, "r") == [(i, 1234, request) for i, _, request in queued]
    got = read_new(conn, QK, "w", 3)
    assert [(d.index, d.prior_runs, d.attempts, d.failed_attempts, d.queued_at) for d in got] == [
        (0, 0, 1, 1, 1234), (1, 2, 3, 1, 1234), (2, 0, 1, 1, 1234),
    ]  # fmt: skip
    assert [d.request.encode() for d in got] == [request for _, _, request in queued]
