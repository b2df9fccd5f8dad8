"""submit: validate the whole input, create the job, append its requests to its backlog.

Pass 1 (validate.py for JSONL, tables.py for Parquet and CSV) makes every line
or row into spool files of ready entries, in parallel for big files (nothing touches Redis before the
whole file is known good, unless ``skip_invalid``). The job's tenant must have room
for it (tenants.py: its estimated input tokens and one more unfinished job), or
nothing is created. Pass 2 appends the spool to the job's backlog (backlog.py) in
chunks, each chunk one Lua call that pushes its requests and advances the job's
``enqueued`` counter atomically, and only if ``enqueued`` still equals the chunk's
start. So:

- a crashed or OOM-stopped submit leaves a prefix of whole chunks; re-running
  it with the same ``--job-id`` continues from ``enqueued``;
- re-submitting a finished job enqueues nothing;
- two submits of one job id racing never enqueue a chunk twice;
- a different file (or flags) under an existing job id is refused (the job
  records the sha256 of its entries), and so is a different output;
- the output directory is claimed for the job before anything reaches Redis
  (ownership.py): one that belongs to another job, or cannot be written, is
  refused;
- with ``wait_s``, a Redis that goes away mid-file (a restart) is waited for,
  and appending goes on from the job's ``enqueued``: nothing twice, nothing
  skipped; through Sentinel a failover is such an outage, and the last chunk
  waits for a replica before submit reports success (sentinel.py).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from batchgen.jobs.crashpoints import CrashPlan
from batchgen.jobs.intake import kept
from batchgen.jobs.intake.duplicate_ids import DuplicateIds
from batchgen.jobs.intake.inputs import MAX_LINE_BYTES
from batchgen.jobs.intake.lines import InputError, LineError
from batchgen.jobs.intake.sources import local_copy, locate
from batchgen.jobs.intake.table_spec import TableSpec
from batchgen.jobs.intake.tables import validate_table
from batchgen.jobs.intake.validate import SpoolDir, Validation, validate_file
from batchgen.jobs.ops import job_index, retention
from batchgen.jobs.ops.chunk_append import (
    enqueue_chunks,
    enqueued_after_outage,
)
from batchgen.jobs.ops.fair_share import backlog, tenants
from batchgen.jobs.ops.fair_share.schedule import Schedule
from batchgen.jobs.ops.job_record import JobRecord
from batchgen.jobs.ops.lifecycle import CREATE, JobState
from batchgen.jobs.ops.modelinfo import chat_template, fingerprint, vocab_size
from batchgen.jobs.redis.connection import describe_connection_error
from batchgen.jobs.redis.keys import Keys, QueueKeys, model_name, queue_name, queue_tag, text
from batchgen.jobs.redis.sentinel import replicated
from batchgen.jobs.redis.stream import ensure_group
from batchgen.jobs.schema import reasoning, tool_parsers
from batchgen.jobs.schema.errors import (
    InvalidInput,
    JobConflict,
    ParserError,
    RedisUnavailable,
    UsageError,
)
from batchgen.jobs.schema.sampling import COMPLETION_MAX_TOKENS
from batchgen.jobs.storage.names import check_job_id
from batchgen.jobs.storage.output_store import OutputDir
from batchgen.jobs.storage.ownership import claim


@dataclass(slots=True)
class SubmitResult:
    job_id: str
    total: int  # lines or rows: the output's rows (invalid ones skipped are error rows)
    skipped: int
    errors: list[InputError]  # the first invalid lines or rows (skip_invalid)
    enqueued_now: int  # entries this call appended
    resumed: bool  # the job existed (an interrupted or repeated submit)
    unit: str = "line"  # what the input holds: lines (JSONL) or rows (a table)
    duplicates: DuplicateIds = field(default_factory=DuplicateIds)  # ids given twice


def new_job_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def submit(
    conn: redis.Redis,
    keys: Keys,
    *,
    source_path: str,
    model: str,
    output: str,
    defaults: dict[str, Any],
    job_id: str | None = None,
    skip_invalid: bool = False,
    max_line_bytes: int = MAX_LINE_BYTES,
    progress: Callable[[int, int], None] | None = None,
    wait_s: float = 0.0,
    retention_s: int | None = None,
    cache: str = "",
    table: TableSpec | None = None,
    input_format: str | None = None,
    schedule: Schedule | None = None,
    queue: str | None = None,
    api_tenant: str = "",
    reasoning_parser: str | None = None,
    tool_call_parser: str | None = None,
) -> SubmitResult:
    """``table``: how a Parquet or CSV input's rows become requests (tables.py);
    ``input_format``: "jsonl", "parquet" or "csv" when the name does not say;
    ``schedule``: the job's tenant, priority class and deadline (schedule.py); ``queue``:
    the queue's name when it is not the model's (keys.run_queue_name); ``api_tenant``:
    the serve tenant whose key submitted it (job_record.py); ``reasoning_parser``: its
    name, "none" for none, None for the one the checkpoint's chat template makes
    unambiguous (``choose_reasoning_parser``); ``tool_call_parser`` the same for the tool
    calls of tool_choice auto rows (``choose_tool_call_parser``)."""
    schedule = schedule or Schedule()
    parser_name = choose_reasoning_parser(reasoning_parser, model)
    tool_parser_name = choose_tool_call_parser(tool_call_parser, model)
    job_id = check_job_id(job_id) if job_id else new_job_id()
    tenants.check_priority(conn, keys, schedule.tenant, schedule.priority, keyed=False)
    with SpoolDir() as spool_dir:
        checked, kept_names, fmt = validate_input(
            source_path, input_format, table, defaults, spool_dir, max_line_bytes,
            vocab_size(model),
        )  # fmt: skip
        unit = "line" if fmt == "jsonl" else "row"
        if checked.error_count and not skip_invalid:
            shown = "\n  ".join(str(e) for e in checked.errors)
            more = checked.error_count - len(checked.errors)
            raise InvalidInput(
                f"{source_path}: {checked.error_count} invalid {unit}(s); nothing was enqueued. "
                f"Fix them, or pass --skip-invalid to submit only the valid {unit}s.\n  {shown}"
                + (f"\n  ... and {more} more" if more else ""),
                [e for e in checked.errors if isinstance(e, LineError)],
            )
        if checked.valid == 0:
            raise InvalidInput(f"{source_path}: no valid {unit}s; nothing was enqueued")
        name = queue or queue_name(model)
        qk = keys.queue(queue_tag(name))
        record = JobRecord(
            id=job_id,
            model=model_name(model),
            api_tenant=api_tenant,
            queue=name,
            tag=qk.tag,
            output=output,
            defaults=defaults,
            source=source_path if "://" in source_path else os.path.abspath(source_path),
            source_sha256=checked.sha256,
            total=checked.total,
            skipped=checked.error_count,
            created_at=time.time(),
            retention_s=retention.default() if retention_s is None else retention_s,
            model_fingerprint=fingerprint(model),  # "" for an HF id: the first worker sets it
            cache=cache,
            reasoning_parser=parser_name,
            tool_call_parser=tool_parser_name,
            input_format=fmt,
            kept_columns=kept_names,
            table=table.to_json() if table else "",
            tenant=schedule.tenant,
            priority=schedule.priority,
            deadline=schedule.deadline,
            expire=schedule.expire,
        )
        _estimate(record, checked, defaults)
        resumed, start = _create(conn, keys, qk, record)
        if kept_names:  # before any entry: finalize needs it once they all ran
            kept.publish(spool_dir, OutputDir.open(record.output))
        position = start
        while True:
            try:
                position += enqueue_chunks(
                    conn, qk, job_id, checked.entries(), position, checked.total, progress
                )
                break
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if isinstance(exc, redis.AuthenticationError):
                    raise
                after = enqueued_after_outage(conn, qk, job_id, wait_s) if wait_s > 0 else None
                if after is None:
                    raise RedisUnavailable(
                        f"{describe_connection_error(exc)}; job {job_id!r} is partly enqueued "
                        f"(whole chunks only): re-run the same submit with --job-id {job_id} "
                        "to enqueue the rest"
                    ) from exc
                position = after
        replicated(conn)  # through Sentinel: every chunk on a replica before we say so
        appended = position - start
    return SubmitResult(
        job_id, checked.total, checked.error_count, checked.errors, appended, resumed, unit,
        checked.duplicates,
    )  # fmt: skip


def choose_reasoning_parser(name: str | None, model: str) -> str:
    """The job's reasoning parser (see ``_choose_parser``)."""
    return _choose_parser(name, model, reasoning.detect, reasoning.parser)


def choose_tool_call_parser(name: str | None, model: str) -> str:
    """The job's tool-call parser (see ``_choose_parser``)."""
    return _choose_parser(name, model, tool_parsers.detect, tool_parsers.parser)


def _choose_parser(
    name: str | None, model: str, detect: Callable[[str | None], str], parser: Callable[[str], Any]
) -> str:
    """``name`` checked ("none": none), else the parser a local checkpoint's chat template
    makes unambiguous ("" when none does, or it is not here). UsageError for a name that
    is no parser."""
    if name == "none":
        return ""
    if name is None:
        return detect(chat_template(model))
    try:
        return str(parser(name).name)
    except ParserError as exc:
        raise UsageError(str(exc)) from None


def validate_input(
    source: str, input_format: str | None, table: TableSpec | None, defaults: dict[str, Any],
    spool_dir: Path, max_line_bytes: int, vocab: int | None,
) -> tuple[Validation[Any], list[str], str]:  # fmt: skip
    """Pass 1 for either kind of input, submit's and retry's: (validation, kept
    columns, format)."""
    found = locate(source, input_format)
    if found.format == "jsonl":
        if table is not None and table.given:
            raise UsageError(
                "--prompt-column, --messages-column, --template, --id-column, "
                "--keep-columns and --sampling-columns read a Parquet or CSV input; a JSONL "
                "line names its own fields"
            )
        local = local_copy(source, found, spool_dir)
        lines = validate_file(local, defaults, spool_dir, max_line_bytes, vocab_size=vocab)
        return lines, [], found.format
    rows, kept_names = validate_table(found, table or TableSpec(), defaults, spool_dir, vocab)
    return rows, kept_names, found.format


def _estimate(record: JobRecord, checked: Validation[Any], defaults: dict[str, Any]) -> None:
    """The job's estimated input tokens (quotas) and cost a request (fair share: input
    and the job's max_tokens)."""
    record.est_input_tokens = sum(map(backlog.estimate_input_tokens, checked.entries()))
    # a chat line without max_tokens runs to its answer's end, unknown here: the
    # completions default stands in for it
    output = int(defaults.get("max_tokens") or COMPLETION_MAX_TOKENS)
    record.cost = max(record.est_input_tokens / max(record.total, 1) + output, 1.0)


def _create(conn: redis.Redis, keys: Keys, qk: QueueKeys, record: JobRecord) -> tuple[bool, int]:
    """Create the job, or find it and check it is this same submission; (resumed, start).

    The output directory is claimed for the job first (ownership.py), which also
    proves it can be written: nothing is created in Redis for an output that
    belongs to another job or cannot be written.
    """
    job_id = record.id
    jk = qk.job(job_id)
    tag = text(conn.hget(keys.jobs, job_id))
    if tag and tag != qk.tag:
        other = text(conn.hget(keys.queues, tag)) or "?"
        raise JobConflict(
            f"job {job_id!r} already exists for model {other!r}; choose another --job-id"
        )
    raw = conn.hgetall(jk.job)
    if raw:
        return _resume_listed(conn, keys, JobRecord.from_hash(job_id, raw), record)
    tenants.reserve(conn, keys, record, record.est_input_tokens)  # refused: nothing created
    try:
        record.output_token = _output_token(conn, keys, job_id)
        claim(OutputDir.open(record.output), job_id, record.output_token)
        CrashPlan.from_env().reached("after_output_claim")
        conn.hsetnx(keys.jobs, job_id, qk.tag)
        conn.hset(keys.queues, qk.tag, record.queue)
        ensure_group(conn, qk)
        tenants.publish_weight(conn, qk, tenants.load(conn, keys, record.tenant))
        fields = [
            x for name, value in record.to_hash().items() if name != "state" for x in (name, value)
        ]
        created = CREATE(conn, job=jk.job, active=qk.active, job_id=job_id, fields=fields)
        conn.sadd(keys.tenants, record.tenant)  # tenant list shows it, settings or not
    except BaseException:
        if not conn.exists(jk.job):
            tenants.release(conn, keys, record.tenant, job_id)
        raise
    if created:
        job_index.add(conn, keys, record)
        return False, 0
    existing = JobRecord.from_hash(job_id, conn.hgetall(jk.job))
    return _resume_listed(conn, keys, existing, record)  # lost a race


def _output_token(conn: redis.Redis, keys: Keys, job_id: str) -> str:
    """The token of the job's output marker (ownership.py): the same for every submit of
    this job id to this Redis, so one interrupted after its claim (Redis refusing
    writes, the process killed) and re-run finds its own marker; another Redis's
    (another ``identity``) differs."""
    conn.set(keys.identity, secrets.token_hex(8), nx=True)
    identity = text(conn.get(keys.identity))
    return hashlib.sha256(f"{identity}\0{job_id}".encode()).hexdigest()[:16]


def _resume_listed(
    conn: redis.Redis, keys: Keys, existing: JobRecord, record: JobRecord
) -> tuple[bool, int]:
    """Resume the existing job, and list it (job_index.py): a submit killed before it
    did is listed once resumed."""
    resumed = _resume(existing, record)
    job_index.add(conn, keys, existing)
    return resumed


def _resume(existing: JobRecord, record: JobRecord) -> tuple[bool, int]:
    """The job exists: go on only if this is the same submission; (True, enqueued)."""
    job_id = record.id
    if existing.source_sha256 != record.source_sha256:
        raise JobConflict(
            f"job {job_id!r} was submitted from different input or flags "
            f"({existing.source}, {existing.total} requests); choose another --job-id"
        )
    if existing.output != record.output:
        raise JobConflict(
            f"job {job_id!r} exists with output {existing.output}, not {record.output}; re-submit "
            "it with the same --output, or choose another --job-id"
        )
    if existing.state in (JobState.CANCELLING, JobState.CANCELLED):
        raise JobConflict(f"job {job_id!r} was cancelled; submit under another --job-id")
    if existing.model_fingerprint and record.model_fingerprint not in (
        "",
        existing.model_fingerprint,
    ):
        raise JobConflict(
            f"job {job_id!r} was submitted for other weights of {record.model} "
            f"({existing.model_fingerprint[:19]}, now {record.model_fingerprint[:19]}); "
            "choose another --job-id"
        )
    claim(OutputDir.open(existing.output), job_id, existing.output_token)
    return True, existing.enqueued
