"""The scheduler's cost does not grow with the number of jobs: with 2,000 queued jobs
(a third with deadlines, four tenants) one dispatch and one deadline check run a
bounded number of Redis commands (counted by Redis itself, INFO commandstats, which
counts the commands a script runs), never one per job. Command counts, not wall
time: the machine the tests run on is loaded."""

from __future__ import annotations

import time
from typing import Any

import redis

from batchgen.jobs.ops.fair_share import deadlines
from batchgen.worker.consumer.queue import read_new
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


def test_a_listing_reads_the_jobs_it_shows_not_every_job(redis_url):
    """At 2,000 jobs, the dashboard's overview, /api/jobs and `batchgen jobs` run a
    command or so a job they show, an admin's and a tenant's key alike (before the
    listings' index: an HGETALL per job in Redis, for every key, every 2 s)."""
    from click.testing import CliRunner

    from batchgen.cli.jobs import jobs
    from batchgen.serve import dashboard
    from batchgen.serve.api_keys import Principal

    conn = redis.Redis.from_url(redis_url)
    populate(conn, QK, 2000, lines=1, now=time.time())
    admin, tenant = Principal("root", admin=True), Principal("t1")
    for who, newest in ((admin, "j01999"), (tenant, "j01997")):
        conn.config_resetstat()
        shown = dashboard.jobs(conn, KEYS, who, limit=50)
        assert dashboard.unseen_notice(conn, KEYS, who) is None
        assert [j["job_id"] for j in shown][:1] == [newest] and len(shown) == 50
        assert {j["tenant"] for j in shown} == ({"t0", "t1", "t2", "t3"} if who.admin else {"t1"})
        assert commands(conn) <= 50 + 10, commands(conn)
    page = dashboard.jobs(conn, KEYS, tenant, offset=490, limit=20)
    assert [j["job_id"] for j in page] == [f"j{k:05d}" for k in range(37, 0, -4)]  # the last 10
    env = {"BATCHGEN_PREFIX": KEYS.prefix}
    conn.config_resetstat()
    out = CliRunner().invoke(jobs, ["--redis", redis_url, "--limit", "30"], env=env)
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    assert len(lines) == 31 and lines[-1].startswith("j01999 ")
    assert out.stderr == "batchgen: 1970 older job(s) not listed (--limit 0 lists every job)\n"
    assert commands(conn) <= 30 + 15, commands(conn)


def test_a_submit_costs_the_same_with_10_or_1000_unfinished_jobs(redis_url, tmp_path):
    """A submit's quota check reads the tenant's held total and looks at a few of its
    shares (tenants.prune), never at every unfinished job's (before: an HGET per
    unfinished job, every submit: 5 submits at 1,000 jobs made 5,015 HGETs)."""
    from click.testing import CliRunner

    from batchgen.cli import main
    from batchgen.jobs.ops.fair_share import tenants

    conn = redis.Redis.from_url(redis_url)
    populate(conn, QK, 1000, lines=1, now=time.time())
    tk = KEYS.tenant("acme")
    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "hi"}\n')

    def hold(first: int, last: int) -> None:  # shares of populated jobs, as their submits left
        pipe = conn.pipeline(transaction=False)
        for k in range(first, last):
            tenants.RESERVE(pipe, settings=tk.settings, jobs=tk.jobs, held=tk.held,
                            job_id=f"j{k:05d}", tokens=10, now=int(time.time()))  # fmt: skip
        pipe.execute()

    def submit_commands(job_id: str) -> int:
        conn.config_resetstat()
        out = CliRunner().invoke(main, ["submit", str(source), "--model", MODEL, "--job-id",
                                        job_id, "--output", str(tmp_path / job_id), "--tenant",
                                        "acme", "--redis", redis_url],
                                 env={"BATCHGEN_PREFIX": KEYS.prefix})  # fmt: skip
        assert out.exit_code == 0, out.output
        return commands(conn)

    hold(0, 10)
    few = submit_commands("with-10")
    hold(10, 1000)
    many = [submit_commands(f"with-1000-{i}") for i in range(5)]
    assert tenants.holding(conn, KEYS, "acme") == {
        "jobs": 1006,
        "enqueued_tokens": 10018,
    }  # 3 a submit
    assert max(many) <= few + 15, (few, many)
