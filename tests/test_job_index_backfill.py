"""Jobs submitted before the listings' index existed (job_index.py) are listed: the first
listing on such a Redis adds them, once, and later listings pay nothing for it.

The Redis is populated the old way: a submit of today, then the index's keys deleted,
is what a submit before the index left (it differed only in listing the job:
``git log -S by-time``), the job index ``bg:jobs`` (job id -> queue tag) and each
job's record."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from click.testing import CliRunner

from batchgen.cli.jobs import jobs
from batchgen.jobs.ops import job_index
from batchgen.jobs.ops.submission import submit
from batchgen.jobs.redis.connection import connect
from batchgen.jobs.redis.keys import Keys
from batchgen.serve import dashboard
from batchgen.serve.api_keys import Principal

KEYS = Keys("bg")


def commands(conn: Any) -> dict[str, int]:
    stats: Any = conn.info("commandstats")
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()}


def submitted(conn: Any, tmp_path: Path, job_id: str, api_tenant: str = "") -> None:
    source = tmp_path / f"{job_id}.jsonl"
    source.write_text('{"prompt": "hi"}\n')
    submit(conn, KEYS, source_path=str(source), model="m", output=str(tmp_path / job_id),
           defaults={}, job_id=job_id, api_tenant=api_tenant)  # fmt: skip


def test_jobs_listed_only_in_the_old_job_index_are_listed_once(redis_url: str, tmp_path: Path):
    conn: Any = connect(redis_url)  # the client every listing uses
    for i in range(5):
        submitted(conn, tmp_path, f"old{i}", api_tenant="acme" if i % 2 else "")
    conn.delete(KEYS.jobs_by_time, KEYS.api_tenant_jobs("acme"), KEYS.jobs_indexed)
    assert conn.hlen(KEYS.jobs) == 5  # as the old submits left them: listed nowhere else
    admin, acme = Principal("root", admin=True), Principal("acme")
    conn.config_set("maxmemory", 1)  # writes refused (OOM): a listing still answers
    try:
        assert dashboard.jobs(conn, KEYS, admin) == [] and job_index.count(conn, KEYS) == 0
    finally:
        conn.config_set("maxmemory", 0)

    out = CliRunner().invoke(jobs, ["--redis", redis_url], env={"BATCHGEN_PREFIX": "bg"})
    assert out.exit_code == 0, out.output
    listed = [line.split()[0] for line in out.stdout.splitlines()[1:]]
    assert listed == ["old0", "old1", "old2", "old3", "old4"]  # the newest last
    assert [j["job_id"] for j in dashboard.jobs(conn, KEYS, acme)] == ["old3", "old1"]
    assert job_index.count(conn, KEYS) == 5

    submitted(conn, tmp_path, "new", api_tenant="acme")
    conn.config_resetstat()
    assert [j["job_id"] for j in dashboard.jobs(conn, KEYS, admin)][:2] == ["new", "old4"]
    assert [j["job_id"] for j in dashboard.jobs(conn, KEYS, acme)] == ["new", "old3", "old1"]
    assert "hscan" not in commands(conn) and "hlen" not in commands(conn)  # done once

    conn.delete(KEYS.jobs_indexed)  # a second backfill (two listings at once) adds nothing
    assert job_index.backfill(conn, KEYS) == 0
    assert conn.zcard(KEYS.jobs_by_time) == 6 and conn.zcard(KEYS.api_tenant_jobs("acme")) == 3
