"""``batchgen redis status|stop``: the embedded Redis, which outlives every command."""

from __future__ import annotations

import json
from typing import Any

import click

from batchgen.cli._common import handles_errors
from batchgen.jobs.environment import REDIS_URL


@click.group("redis")
def redis_group() -> None:
    """The embedded Redis: the redis-server batchgen starts on a Unix socket under
    $BATCHGEN_HOME/redis when no --redis or BATCHGEN_REDIS_URL is given, shared by
    every batchgen command of this user on this machine.

    It keeps running after the command that started it (so a worker in one terminal
    and a submit in another meet), and its AOF keeps every job across a stop: the
    next batchgen command starts it again with everything it held.
    """


@redis_group.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print the status as one JSON object.")
@handles_errors
def status(as_json: bool) -> None:
    """Whether the embedded Redis runs, where, and what it holds: jobs not finished,
    live workers and other connections."""
    report = _report()
    if as_json:
        click.echo(json.dumps(report))
        return
    if not report["running"]:
        click.echo(f"embedded Redis  not running (data in {report['data_dir']}; the next "
                   "batchgen command that needs it starts it)")  # fmt: skip
    else:
        click.echo(f"embedded Redis  running, pid {report['pid']}, {report['url']}")
        click.echo(f"data            {report['data_dir']} ({report['aof_bytes']:,} bytes of AOF)")
        click.echo(f"jobs            {report['unfinished_jobs']} not finished, "
                   f"{report['finished_jobs']} finished")  # fmt: skip
        click.echo(f"workers         {report['live_workers']} live; "
                   f"{report['other_connections']} other connection(s)")  # fmt: skip
    if REDIS_URL.get():
        click.echo("note            BATCHGEN_REDIS_URL is set: commands in this shell use "
                   "that Redis, not this one")  # fmt: skip


@redis_group.command("stop")
@click.option("--force", is_flag=True, help="Stop it even while workers or commands use it.")
@handles_errors
def stop(force: bool) -> None:
    """Stop the embedded Redis (its AOF keeps every job for the next start).

    Refused while work is in flight there (a live worker, a batchgen run, serve
    or any other connection): they would lose Redis mid-job. --force stops it
    anyway; what they held goes back to the queue when it runs again.
    """
    from batchgen.jobs.redis import embedded
    from batchgen.jobs.schema.errors import JobConflict

    report = _report()
    if not report["running"]:
        click.echo("the embedded Redis is not running")
        return
    # in use means connected: a live worker holds connections, and a heartbeat without
    # any is a killed worker's (kept by the AOF until it expires), which holds nothing up
    if report["other_connections"] and not force:
        busy = [f"{report['live_workers']} live worker(s)"] if report["live_workers"] else []
        busy.append(f"{report['other_connections']} connection(s) of workers, batchgen run, "
                    "serve or status --watch")  # fmt: skip
        raise JobConflict(
            f"the embedded Redis is in use ({'; '.join(busy)}; {report['unfinished_jobs']} "
            "job(s) not finished): stop those first, or pass --force"
        )
    embedded.stop()
    kept = report["unfinished_jobs"]
    note = f"; {kept} unfinished job(s) wait in its AOF for the next start" if kept else ""
    click.echo(f"stopped the embedded Redis (pid {report['pid']}){note}")


def _report() -> dict[str, Any]:
    """What status shows, as data; the server is never started to find out."""
    from batchgen.jobs.redis import embedded

    data_dir = embedded.redis_dir()
    url = embedded.running_url()
    report: dict[str, Any] = {"running": url is not None, "data_dir": str(data_dir)}
    if url is None:
        return report
    from batchgen.jobs.ops.status_report import all_statuses
    from batchgen.jobs.redis.connection import connect
    from batchgen.jobs.redis.heartbeat import live_workers
    from batchgen.jobs.redis.keys import Keys

    conn: Any = connect(url)
    keys = Keys.from_env()
    statuses = all_statuses(conn, keys)
    unfinished = sum(1 for s in statuses if not s.record.state.terminal)
    # one appendonly.aof, or an appendonlydir of them (Redis 7)
    aof_bytes = sum(f.stat().st_size for f in data_dir.rglob("appendonly*") if f.is_file())
    report.update(
        url=url,
        pid=embedded.server_pid(),
        aof_bytes=aof_bytes,
        unfinished_jobs=unfinished,
        finished_jobs=len(statuses) - unfinished,
        live_workers=len(live_workers(conn, keys)),
        other_connections=len(conn.client_list()) - 1,  # this one is not "other"
    )
    conn.close()
    return report
