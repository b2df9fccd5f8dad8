"""``batchgen delete``: remove a job from Redis, and with --outputs its files."""

from __future__ import annotations

import click

from batchgen.cli._common import connect, handles_errors, redis_option


@click.command("delete")
@click.argument("job_id")
@click.option("--outputs", is_flag=True, help="Also delete the files the job wrote.")
@click.option("--force", is_flag=True, help="Cancel the job first if it still runs.")
@redis_option
@handles_errors
def delete(job_id: str, outputs: bool, force: bool, redis_url: str | None) -> None:
    """Remove every trace of JOB_ID from Redis: its record, rows, error rows, dead
    letters, queued entries and finalize task.

    The job's output files stay unless --outputs (then result.parquet,
    manifest.json, the parts and the output marker go, and the directory if
    nothing else is left in it). A job that still runs is refused unless
    --force, which cancels it first. Finished jobs' Redis state also expires on
    its own after their retention (submit --retention, default 7 days).
    """
    from batchgen.jobs.ops.deletion import delete as run_delete
    from batchgen.jobs.storage.names import check_job_id

    conn, keys, _ = connect(redis_url)
    report = run_delete(conn, keys, check_job_id(job_id), outputs=outputs, force=force)
    files = f", {report.files} output files" if outputs else ""
    click.echo(f"deleted job {job_id}: {report.keys} keys, {report.entries} queued entries{files}")
