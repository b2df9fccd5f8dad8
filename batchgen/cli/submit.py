"""``batchgen submit``: validate a JSONL file or a table of prompts and queue it as a job."""

from __future__ import annotations

import json
import shlex
from typing import TYPE_CHECKING, Any

import click

from batchgen.cli._common import (
    connect,
    handles_errors,
    redis_option,
    report_submit,
    sampling_options,
    table_options,
)

if TYPE_CHECKING:
    from batchgen.jobs.intake.table_spec import TableSpec


@click.command("submit")
@click.argument("prompts")
@click.option("--model", required=True, help="Model path or name; workers serve it by this name.")
@click.option(
    "--output",
    metavar="URI",
    default=None,
    help="Directory for the job's output (local path or s3://, gs://, ...). Default: "
    "$BATCHGEN_OUTPUT_ROOT/JOB (else $BATCHGEN_HOME/outputs/JOB) with the embedded Redis; "
    "required with a shared Redis.",
)
@sampling_options
@table_options
@click.option("--job-id", default=None, help="Name the job; re-submitting it never enqueues twice.")
@click.option("--skip-invalid", is_flag=True, help="Queue the valid lines; report the others.")
@click.option(
    "--retention",
    metavar="DURATION",
    default=None,
    help="Keep the finished job's Redis state this long (7d, 36h, ...); the outputs stay. "
    "Default $BATCHGEN_RETENTION, else 7d.",
)
@click.option(
    "--cache",
    "use_cache",
    is_flag=True,
    help="Serve rows a job generated before from the result cache, and store new ones "
    "(greedy or seeded requests only). Where: $BATCHGEN_CACHE (folder or s3://...), default "
    "$BATCHGEN_HOME/cache with the embedded Redis; required with a shared Redis.",
)
@click.option(
    "--tenant",
    default=None,
    help="Who the job is for: tenants share the workers by weight and are held to their "
    "quotas (batchgen tenant). Default $BATCHGEN_TENANT, else your login name.",
)
@click.option(
    "--priority",
    type=int,
    default=0,
    show_default=True,
    help="The job's class (-1000..1000): a higher class is served first.",
)
@click.option(
    "--deadline",
    metavar="WHEN",
    default=None,
    help="When it should be done: a duration from now (6h, 90m, 2d) or an ISO time. A job "
    "that would miss it at its fair share is served first (earliest deadline first).",
)
@click.option(
    "--expire",
    is_flag=True,
    help="Cancel the job at its --deadline (finished rows are kept); without it a late job "
    "keeps running and status reports it late.",
)
@click.option("--json", "as_json", is_flag=True, help="Print {job_id, total, ...} as JSON.")
@redis_option
@handles_errors
def submit(
    prompts: str,
    model: str,
    output: str | None,
    defaults: dict[str, Any],
    table: TableSpec,
    job_id: str | None,
    skip_invalid: bool,
    retention: str | None,
    use_cache: bool,
    tenant: str | None,
    priority: int,
    deadline: str | None,
    expire: bool,
    reasoning_parser: str | None,
    tool_call_parser: str | None,
    as_json: bool,
    redis_url: str | None,
) -> None:
    """Validate PROMPTS and queue one request per line or row; print the job id.

    PROMPTS is a local path or a URI such as s3://bucket/p.jsonl (credentials from the
    AWS_* environment): JSONL (.jsonl, .jsonl.gz, .jsonl.zst), Parquet (.parquet), CSV
    (.csv), or a folder of Parquet or CSV files.

    Every line or row is checked before anything is queued; an invalid one stops the
    submit with its line and column (a table: its row and column), unless
    --skip-invalid. Lines are native ({"prompt" | "messages", "id", sampling fields,
    "metadata"}) or OpenAI batch ({"custom_id", "method", "url", "body"}); unknown
    fields are errors (except body.model/body.user). A table's prompt comes from
    --prompt-column, --messages-column or --template, and its columns named as
    sampling fields (max_tokens, temperature, seed, ...) set them per row. Flags set
    job defaults; a line's or row's own fields override them.

    MODEL must be a checkpoint directory here (with a shared Redis it may live only
    on the worker hosts); one that cannot be loaded is refused before anything is
    queued.
    """
    from batchgen.jobs.environment import REDIS_WAIT
    from batchgen.jobs.ops import retention as keep
    from batchgen.jobs.ops.fair_share.schedule import (
        Schedule,
        check_priority,
        check_tenant,
        default_tenant,
        parse_deadline,
    )
    from batchgen.jobs.ops.modelinfo import check_submittable
    from batchgen.jobs.ops.submission import new_job_id
    from batchgen.jobs.ops.submission import submit as run_submit
    from batchgen.jobs.storage import result_cache
    from batchgen.jobs.storage.names import check_job_id, job_output_dir

    job_id = check_job_id(job_id) if job_id else new_job_id()
    retention_s = keep.parse(retention) if retention else keep.default()
    if expire and not deadline:
        raise click.UsageError("--expire cancels the job at its --deadline: give one")
    schedule = Schedule(
        tenant=check_tenant(tenant) if tenant is not None else default_tenant(),
        priority=check_priority(priority),
        deadline=parse_deadline(deadline) if deadline else 0.0,
        expire=expire,
    )
    conn, keys, target = connect(redis_url)
    warning = check_submittable(conn, keys, model, target.embedded)
    if warning:
        click.echo(f"batchgen: warning: {warning}", err=True)
    out_uri = job_output_dir(output, job_id, target.embedded)
    cache_uri = result_cache.location(target.embedded) if use_cache else ""
    result = run_submit(
        conn, keys, source_path=prompts, model=model, output=out_uri, defaults=defaults,
        job_id=job_id, skip_invalid=skip_invalid, wait_s=REDIS_WAIT.get(), retention_s=retention_s,
        cache=cache_uri,
        table=table,
        schedule=schedule, reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser,
    )  # fmt: skip
    report_submit(result)
    if as_json:
        click.echo(json.dumps({
            "job_id": result.job_id, "total": result.total, "skipped": result.skipped,
            "enqueued": result.enqueued_now, "resumed": result.resumed, "output": out_uri,
        }))  # fmt: skip
    else:
        click.echo(result.job_id)
    if not warning:  # on stderr, terminal or not: a script keeps stdout for the job id
        note = no_worker_note(conn, keys, model)
        if note:
            click.echo(f"batchgen: note: {note}", err=True)


def no_worker_note(conn: Any, keys: Any, model: str) -> str:
    """What a new job waits for when no live worker serves its model (and no worker
    supervisor is starting one), with the command that starts one; "" otherwise."""
    from batchgen.jobs.redis.heartbeat import live_workers, starting_queues
    from batchgen.jobs.redis.keys import model_name, queue_name

    if live_workers(conn, keys, keys.queue_for_model(model).tag):
        return ""
    if queue_name(model) in starting_queues(conn, keys):
        return ""
    model = model_name(model)
    return (f"no worker serves {model} yet, so the job waits; start one with "
            f"`batchgen worker --model {shlex.quote(model)}`")  # fmt: skip
