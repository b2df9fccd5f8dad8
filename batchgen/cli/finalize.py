"""``batchgen finalize``: write a job's output now, here, instead of waiting for a worker."""

from __future__ import annotations

import click

from batchgen.cli._common import connect, handles_errors, redis_option


@click.command("finalize")
@click.argument("job_id")
@redis_option
@handles_errors
def finalize(job_id: str, redis_url: str | None) -> None:
    """Run JOB_ID's finalize in this process (it must reach the job's output).

    Workers finalize a job on their own once every input has a row (or after
    a cancel), and retry a failed finalize with backoff. Use this to retry at
    once, after fixing what made it fail (see `batchgen status JOB_ID`), or to
    finish the clean-up of one that was interrupted. Refused while the job
    still runs, or while another finalizer holds it.
    """
    import socket

    from batchgen.jobs.ops.finalize.finalization import FinalizeSettings, record_failure
    from batchgen.jobs.ops.finalize.finalization import finalize as run_finalize
    from batchgen.jobs.ops.job_record import load_job
    from batchgen.jobs.schema.errors import BatchgenError, JobConflict, JobNotReady, LeaseHeld
    from batchgen.jobs.storage.names import check_job_id

    conn, keys, _ = connect(redis_url)
    record = load_job(conn, keys, check_job_id(job_id))
    if record.state.live:
        raise JobNotReady(
            f"job {job_id!r} is {record.state.value} ({record.finished_rows}/{record.total} "
            "rows); it is finalized once every input has a row, or after `batchgen cancel`"
        )
    settings = FinalizeSettings.from_env()
    try:
        state = run_finalize(
            conn, keys, job_id, settings, owner=f"batchgen finalize on {socket.gethostname()}"
        )
    except LeaseHeld as held:
        raise JobConflict(
            f"job {job_id!r} is being finalized right now by {held.holder}; wait for it "
            f"(batchgen status {job_id})"
        ) from None
    except Exception as exc:
        delay = record_failure(conn, keys, job_id, exc, settings)
        message = str(exc) if isinstance(exc, BatchgenError) else f"{type(exc).__name__}: {exc}"
        raise BatchgenError(
            f"finalize of job {job_id!r} failed: {message}; workers retry it in {delay:.0f}s, "
            "or fix the cause and run this again"
        ) from None
    done = "already " if record.state.terminal else ""
    click.echo(f"{job_id}: {done}{state}; output in {record.output}")
