"""``batchgen jobs``: every job this Redis knows, newest last."""

from __future__ import annotations

import json

import click

from batchgen.cli._common import connect, handles_errors, redis_option


@click.command("jobs")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per job.")
@redis_option
@handles_errors
def jobs(as_json: bool, redis_url: str | None) -> None:
    """List jobs: id, state, rows done, failed and cancelled, total, model.

    The same data as `batchgen status` without a job id, one line per job.
    """
    from batchgen.jobs.ops.status_report import all_statuses

    conn, keys, _ = connect(redis_url)
    statuses = all_statuses(conn, keys)
    if as_json:
        for s in statuses:
            click.echo(json.dumps(s.to_dict()))
        return
    if not statuses:
        click.echo("no jobs")
        return
    click.echo(
        f"{'JOB':<28} {'STATE':<11} {'DONE':>9} {'FAILED':>7} {'CANCELLED':>9} {'TOTAL':>9}  MODEL"
    )
    for s in statuses:
        r = s.record
        click.echo(f"{r.id:<28} {r.state.value:<11} {r.done:>9} {r.errors:>7} {r.cancelled_rows:>9} "
                   f"{r.total:>9}  {r.model}")  # fmt: skip
