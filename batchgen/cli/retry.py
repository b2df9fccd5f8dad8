"""``batchgen retry``: run a finished job's failed rows again; every other row stays."""

from __future__ import annotations

import click

from batchgen.cli._common import connect, handles_errors, redis_option


@click.command("retry")
@click.argument("job_id")
@click.option(
    "--errors-only/--all-failed",
    "errors_only",
    default=True,
    help="Retry the rows whose finish_reason is error (the default: could not run, "
    "dead-lettered, lost), or those and the cancelled ones.",
)
@click.option(
    "--input",
    "input_path",
    metavar="PATH",
    default=None,
    help="The job's input file (or URI) where it is now, if it moved; it must hold the very "
    "requests the job was submitted with.",
)
@redis_option
@handles_errors
def retry(job_id: str, errors_only: bool, input_path: str | None, redis_url: str | None) -> None:
    """Queue JOB_ID's failed rows again, as new attempts of the same job.

    JOB_ID must be finished (completed or cancelled). Its failed requests are
    read again from the job's input (checked to be the very same requests) and
    queued; the job is running again, workers run them, and the job is
    finalized anew: the retried rows replace their failed rows, every other
    row stays exactly as it was, one row per input line. A retry that was
    stopped halfway goes on where it stopped when run again.
    """
    from batchgen.jobs.ops.job_record import load_job
    from batchgen.jobs.ops.rerun import retry as run_retry
    from batchgen.jobs.storage.names import check_job_id

    conn, keys, _ = connect(redis_url)
    result = run_retry(conn, keys, check_job_id(job_id), all_failed=not errors_only,
                       input_path=input_path)  # fmt: skip
    if result.resumed:
        click.echo(f"{job_id}: went on with retry {result.round}: queued {result.queued_now} "
                   "more row(s); the job is running")  # fmt: skip
    elif result.rows == 0 and result.invalid:
        click.echo(f"{job_id}: nothing to retry (its {result.invalid} failed row(s) are invalid "
                   "input lines, which would fail the same way)")  # fmt: skip
    elif result.rows == 0:
        which = "error" if errors_only else "error or cancelled"
        cancelled = load_job(conn, keys, job_id).cancelled_rows if errors_only else 0
        hint = (f"; `batchgen retry {job_id} --all-failed` runs its {cancelled} cancelled "
                "row(s) again" if cancelled else "")  # fmt: skip
        click.echo(f"{job_id}: nothing to retry (no row has finish_reason {which}){hint}")
    else:
        click.echo(f"{job_id}: retry {result.round}: queued {result.rows} row(s) again; the job "
                   "is running")  # fmt: skip
    if result.queued_now and load_job(conn, keys, job_id).run_alone:
        click.echo(f"{job_id} was made by `batchgen run`, whose queue no worker reads: run the "
                   f"same `batchgen run` command with --job-id {job_id} to run them")  # fmt: skip
