"""``batchgen delete``: remove a job from Redis, and with --outputs its files."""

from __future__ import annotations

import shlex

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

    A batch of `batchgen serve` (its job has its id) goes too: its record and its
    output and error files (their records and bytes); its input file is kept.
    """
    from batchgen.jobs.ops.deletion import delete as run_delete
    from batchgen.jobs.redis import embedded
    from batchgen.jobs.schema.errors import JobNotFound
    from batchgen.jobs.storage.names import check_job_id
    from batchgen.serve.batch.batch_removal import remove_batch

    conn, keys, _ = connect(redis_url)
    job_id = check_job_id(job_id)
    batch = bool(conn.exists(keys.batch(job_id)))
    said = []
    try:
        report = run_delete(conn, keys, job_id, outputs=outputs, force=force)
        files = f", {report.files} output files" if outputs else ""
        said.append(f"deleted job {job_id}: {report.keys} keys, {report.entries} queued "
                    f"entries{files}")  # fmt: skip
        if report.kept_output:
            said.append(kept_output(report.kept_output))
    except JobNotFound:
        if not batch:
            raise
    if batch:
        removed = remove_batch(conn, keys, job_id, str(embedded.home() / "files"))
        said.append(f"deleted batch {job_id} and its {removed} output files")
    click.echo("; ".join(said))


def kept_output(uri: str) -> str:
    """What delete without --outputs left, and how to remove it."""
    from batchgen.jobs.storage.output_store import OutputDir

    if OutputDir.open(uri).local:
        return f"its output folder {uri} is kept (`rm -r {shlex.quote(uri)}` removes it)"
    return f"its output {uri} is kept"
