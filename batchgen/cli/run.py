"""``batchgen run``: submit + an in-process worker + finalize + copy, in one command."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any

import click

from batchgen.cli._common import (
    connect,
    handles_errors,
    model_impl_option,
    progress_bar,
    quantization_option,
    redis_option,
    report_submit,
    sampling_options,
    table_options,
    threads_option,
)

if TYPE_CHECKING:
    from batchgen.jobs.intake.tables import TableSpec


@click.command("run")
@click.argument("prompts")
@click.option("--model", required=True, help="Model path (HF checkpoint directory).")
@click.option("-o", "--output", "dest", required=True, help="Parquet file to write.")
@click.option("--force", is_flag=True, help="Overwrite OUTPUT if it exists.")
@click.option(
    "--job-output",
    metavar="URI",
    default=None,
    help="The job's output directory (parts, result), as submit's --output. Default: "
    "$BATCHGEN_OUTPUT_ROOT/JOB with the embedded Redis; required with a shared Redis.",
)
@sampling_options
@table_options
@click.option("--device", default=None, help="cpu, cuda, ... (default: the engine's choice).")
@click.option("--max-num-seqs", type=int, default=256, show_default=True)
@click.option("--num-kv-blocks", type=int, default=None)
@click.option("--max-model-len", type=int, default=None, help="Cap the context length.")
@model_impl_option
@quantization_option
@threads_option
@click.option(
    "--tensor-parallel-size", type=int, default=1, show_default=True,
    help="Ranks that split the model: that many GPUs from --device's on, or processes on "
    "--device cpu (docs/fleet.md).",
)  # fmt: skip
@click.option("--job-id", default=None, help="Name the job (re-running it resumes it).")
@click.option("--skip-invalid", is_flag=True,
              help="Run the valid lines; the others become error rows.")  # fmt: skip
@redis_option
@handles_errors
def run(
    prompts: str, model: str, dest: str, force: bool, job_output: str | None,
    defaults: dict[str, Any], table: TableSpec, device: str | None, max_num_seqs: int,
    num_kv_blocks: int | None, max_model_len: int | None, model_impl: str,
    quantization: str | None, threads: int | None, tensor_parallel_size: int,
    job_id: str | None,
    skip_invalid: bool, reasoning_parser: str | None, tool_call_parser: str | None,
    redis_url: str | None,
) -> None:  # fmt: skip
    """Generate for every line (or table row) of PROMPTS and write OUTPUT, all in this
    process. PROMPTS is what submit takes: JSONL, Parquet, CSV or a folder of them.

    The rows are the ones submit + worker + download would write, and only this
    process runs them: the job has a queue of its own (on the embedded Redis, or
    --redis), which no `batchgen worker` reads. The model is loaded before
    anything is queued, so a model that cannot be loaded queues nothing. A
    progress bar shows on stderr.
    """
    from batchgen.jobs.ops.export import destination, download
    from batchgen.jobs.ops.finalize.finalize_tasks import run_pending
    from batchgen.jobs.ops.job_record import load_job
    from batchgen.jobs.ops.lifecycle import JobState
    from batchgen.jobs.ops.submission import new_job_id, submit
    from batchgen.jobs.redis.keys import prefix_from_env, queue_tag, run_queue_name
    from batchgen.jobs.schema.errors import BatchgenError
    from batchgen.jobs.schema.model_files import check_checkpoint
    from batchgen.jobs.storage.names import check_job_id, job_output_dir
    from batchgen.worker.engine_config import EngineConfig
    from batchgen.worker.loop.engine_api import load_engine
    from batchgen.worker.loop.loop_config import ENGINE_FAILED_EXIT, LoopConfig
    from batchgen.worker.loop.queue_loop import QueueLoop

    engine_config = EngineConfig(
        device=device, max_num_seqs=max_num_seqs, num_kv_blocks=num_kv_blocks,
        max_model_len=max_model_len, model_impl=model_impl, threads=threads,
        quantization=quantization,
        tensor_parallel_size=tensor_parallel_size,
    )  # fmt: skip
    job_id = check_job_id(job_id) if job_id else new_job_id()
    destination(job_id, dest, force)  # refused now, not after the whole job ran
    check_checkpoint(model)
    conn, keys, target = connect(redis_url)
    output = job_output_dir(job_output, job_id, target.embedded)

    def engine():
        return load_engine(model, engine_config)

    api = engine()  # before anything is queued: a model that cannot load queues nothing
    queue = run_queue_name(model, job_id)
    result = submit(
        conn, keys, source_path=prompts, model=model, output=output, defaults=defaults,
        job_id=job_id, skip_invalid=skip_invalid, table=table, queue=queue,
        reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser,
    )  # fmt: skip
    report_submit(result)
    tag = queue_tag(queue)
    config = LoopConfig(model=model, redis_url=target.url, prefix=prefix_from_env(),
                        block_ms=200, flush_interval_s=1.0, queue=queue)  # fmt: skip
    tty = sys.stderr.isatty()

    def finished() -> bool:
        record = load_job(conn, keys, job_id)
        line = f"\r{job_id} {progress_bar(record)} {record.state.value}"
        if tty:
            click.echo(line, err=True, nl=False)
        return record.state not in (JobState.QUEUED, JobState.RUNNING)

    # An engine that raised handed its requests back: start a fresh one, as the
    # worker's supervisor would (a poison request is dead-lettered after
    # max_attempts). Stopped otherwise (Ctrl-C) before the job finished: say so.
    try:
        while QueueLoop(conn, api, config).run(until=finished) == ENGINE_FAILED_EXIT:
            if finished():
                break
            click.echo("batchgen: the engine failed; starting a fresh one", err=True)
            api.close()
            api = engine()
    finally:
        api.close()  # a tensor-parallel engine's other ranks exit with it
    if not finished():
        raise BatchgenError(
            f"stopped before job {job_id} finished; its requests wait in its own queue, "
            f"which only `batchgen run` serves: re-run the same command with --job-id {job_id} "
            "to finish it"
        )
    while not load_job(conn, keys, job_id).state.terminal:
        if not run_pending(conn, keys, tag):  # a finalize started by this loop may be running
            time.sleep(0.2)
    if tty:
        click.echo("", err=True)
    path, rows = download(conn, keys, job_id, dest, force=force)
    state = load_job(conn, keys, job_id).state.value
    click.echo(f"{job_id}: {state}, wrote {rows} rows to {path}")
