"""``batchgen jobs``: the newest jobs this Redis knows, newest last."""

from __future__ import annotations

import json

import click

from batchgen.cli._common import connect, handles_errors, redis_option

LIMIT = 100


@click.command("jobs")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per job.")
@click.option("--limit", type=click.IntRange(min=0), default=LIMIT, show_default=True,
              help="List the newest N jobs; 0 lists every job.")  # fmt: skip
@redis_option
@handles_errors
def jobs(as_json: bool, limit: int, redis_url: str | None) -> None:
    """List jobs: id, state, rows done, failed and cancelled, total, model.

    The same data as `batchgen status` without a job id, one line per job. A listing
    reads only the jobs it shows (an index by submit time), so it stays quick with
    thousands of jobs; when older jobs are left out, a line on stderr says how many.
    """
    from batchgen.jobs.ops import job_index
    from batchgen.jobs.ops.status_report import listed_statuses

    conn, keys, _ = connect(redis_url)
    statuses = listed_statuses(conn, keys, limit=limit or None)[::-1]
    older = job_index.count(conn, keys) - len(statuses) if limit else 0
    if as_json:
        for s in statuses:
            click.echo(json.dumps(s.to_dict()))
    elif not statuses:
        click.echo("no jobs")
    else:
        click.echo(f"{'JOB':<28} {'STATE':<11} {'DONE':>9} {'FAILED':>7} {'CANCELLED':>9} "
                   f"{'TOTAL':>9}  MODEL")  # fmt: skip
        for s in statuses:
            r = s.record
            click.echo(f"{r.id:<28} {r.state.value:<11} {r.done:>9} {r.errors:>7} "
                       f"{r.cancelled_rows:>9} {r.total:>9}  {r.model}")  # fmt: skip
    if older > 0:
        click.echo(f"batchgen: {older} older job(s) not listed (--limit 0 lists every job)",
                   err=True)  # fmt: skip
