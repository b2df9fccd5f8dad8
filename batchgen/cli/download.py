"""``batchgen download``: fetch a job's Parquet output."""

from __future__ import annotations

import click

from batchgen.cli._common import connect, handles_errors, redis_option


@click.command("download")
@click.argument("job_id")
@click.option(
    "-o", "--output", "dest", default=None, help="File or directory (default ./JOB.parquet)."
)
@click.option("--partial", is_flag=True, help="Before completion: the rows committed so far.")
@click.option("--force", is_flag=True, help="Overwrite the file if it exists.")
@redis_option
@handles_errors
def download(
    job_id: str, dest: str | None, partial: bool, force: bool, redis_url: str | None
) -> None:
    """Copy JOB_ID's output (one row per input line, in input order) to a local file.

    Before the job is completed (or cancelled) this refuses, unless --partial,
    which writes the rows committed so far, in input order. An existing file is
    refused unless --force; a folder that does not exist is never created.
    """
    from batchgen.jobs.ops.export import download as run_download
    from batchgen.jobs.storage.names import check_job_id

    conn, keys, _ = connect(redis_url)
    path, rows = run_download(conn, keys, check_job_id(job_id), dest, partial, force)
    click.echo(f"wrote {rows} rows to {path}")
