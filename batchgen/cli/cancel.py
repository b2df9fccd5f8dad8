"""``batchgen cancel``: stop a job; rows already made are kept."""

from __future__ import annotations

import click

from batchgen.cli._common import connect, handles_errors, redis_option


@click.command("cancel")
@click.argument("job_id")
@redis_option
@handles_errors
def cancel(job_id: str, redis_url: str | None) -> None:
    """Cancel JOB_ID: workers drop its remaining requests.

    Rows already committed are kept; every other input gets a row with
    finish_reason "cancelled". The job's output is still written (by a worker's
    finalize task) and can be downloaded once the job is "cancelled".
    """
    from batchgen.jobs.ops.cancellation import cancel as run_cancel
    from batchgen.jobs.storage.names import check_job_id

    conn, keys, _ = connect(redis_url)
    state = run_cancel(conn, keys, check_job_id(job_id))
    if state.value == "cancelled":
        click.echo(f"{job_id} was already cancelled")
    else:
        click.echo(f"{job_id} cancelling (a worker finalizes it)")
