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

import os
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from batchgen.jobs.intake import kept
from batchgen.jobs.intake.duplicate_ids import DuplicateIds
from batchgen.jobs.intake.inputs import MAX_LINE_BYTES
from batchgen.jobs.intake.lines import InputError, LineError
from batchgen.jobs.intake.sources import local_copy, locate
from batchgen.jobs.intake.table_spec import TableSpec
from batchgen.jobs.intake.tables import validate_table
from batchgen.jobs.intake.validate import SpoolDir, Validation, validate_file
from batchgen.jobs.ops import backlog, retention, tenants
from batchgen.jobs.ops.backlog import BACKLOG_PUSH
from batchgen.jobs.ops.job_record import JobRecord
from batchgen.jobs.ops.lifecycle import CREATE, JobState, script
from batchgen.jobs.ops.modelinfo import fingerprint, vocab_size
from batchgen.jobs.ops.schedule import Schedule
from batchgen.jobs.redis.connection import describe_connection_error, is_oom, queue_full
from batchgen.jobs.redis.keys import Keys, QueueKeys, queue_name, queue_tag, text
from batchgen.jobs.redis.sentinel import replicated
from batchgen.jobs.redis.stream import ensure_group
from batchgen.jobs.schema.errors import InvalidInput, JobConflict, RedisUnavailable, UsageError
from batchgen.jobs.storage.names import check_job_id
from batchgen.jobs.storage.output_store import OutputDir
from batchgen.jobs.storage.ownership import claim, new_token

CHUNK_ENTRIES = 2000
CHUNK_BYTES = 4 << 20

APPEND_CHUNK = script(
    "append chunk",
    keys=[
        ("job", "the job record"),
        ("ready", "the model's jobs with a backlog"),
        ("*backlogs", "the job's backlog lists"),
    ],
    args=[
        ("job_id", ""),
        ("events", "the model's events channel: 'work' wakes idle workers"),
        ("start", "entries the job had when this chunk was packed"),
        ("*items", "the chunk's requests: prefix group, backlog item, ..."),
    ],
    body="""
local v = redis.call('HMGET', job, 'enqueued', 'state')
if not v[1] then return {-1, ''} end
if v[2] == S.CANCELLING or v[2] == S.CANCELLED then return {-2, v[2]} end
local first = tonumber(start)
if tonumber(v[1]) ~= first then return {tonumber(v[1]), ''} end
push_backlog(job, job_id, ready, events, backlogs, items)
local enqueued = first + #items / 2
redis.call('HSET', job, 'enqueued', enqueued)
return {enqueued, ''}
""",
    prelude=BACKLOG_PUSH,
)


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
) -> SubmitResult:
    """``table``: how a Parquet or CSV input's rows become requests (tables.py);
    ``input_format``: "jsonl", "parquet" or "csv" when the name does not say;
    ``schedule``: the job's tenant, priority class and deadline (schedule.py); ``queue``:
    the queue's name when it is not the model's (keys.run_queue_name); ``api_tenant``:
    the serve tenant whose key submitted it (job_record.py)."""
    schedule = schedule or Schedule()
    job_id = check_job_id(job_id) if job_id else new_job_id()
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
            model=model,
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
                position += _enqueue(
                    conn, qk, job_id, checked.entries(), position, checked.total, progress
                )
                break
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if isinstance(exc, redis.AuthenticationError):
                    raise
                after = _enqueued_after_outage(conn, qk, job_id, wait_s) if wait_s > 0 else None
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
    output = int(defaults.get("max_tokens") or 16)
    record.cost = max(record.est_input_tokens / max(record.total, 1) + output, 1.0)


def _enqueued_after_outage(
    conn: redis.Redis, qk: QueueKeys, job_id: str, wait_s: float
) -> int | None:
    """Wait (with backoff, up to ``wait_s``) for Redis to answer again; the job's
    ``enqueued`` then (chunks are appended whole or not at all, so go on from
    there), or None if Redis stayed away."""
    deadline = time.monotonic() + wait_s
    delay = 0.1
    while True:
        try:
            raw = conn.hget(qk.job(job_id).job, "enqueued")
        except (redis.ConnectionError, redis.TimeoutError):
            if time.monotonic() + delay > deadline:
                return None
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
            continue
        if raw is None:
            raise JobConflict(
                f"job {job_id!r} disappeared from Redis while submitting (Redis restarted "
                "without its data?); submit the file again"
            )
        return int(raw)


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
        return _resume(JobRecord.from_hash(job_id, raw), record)
    tenants.reserve(conn, keys, record)  # refused: nothing is created, nothing claimed
    try:
        record.output_token = new_token()
        claim(OutputDir.open(record.output), job_id, record.output_token)
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
        return False, 0
    return _resume(JobRecord.from_hash(job_id, conn.hgetall(jk.job)), record)  # lost a race


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


def _enqueue(
    conn: redis.Redis,
    qk: QueueKeys,
    job_id: str,
    entries: Iterator[bytes],
    start: int,
    total: int,
    progress: Callable[[int, int], None] | None,
) -> int:
    for _ in range(start):  # skip what an earlier submit already appended
        next(entries)
    sender = _ChunkSender(conn, qk, job_id, total)
    position, chunk, size = start, list[bytes](), 0
    try:
        for entry in entries:
            chunk.append(entry)
            size += len(entry) + 1
            if len(chunk) >= CHUNK_ENTRIES or size >= CHUNK_BYTES:
                sender.send(position, chunk)
                position += len(chunk)
                chunk, size = [], 0
                if progress:
                    progress(position, total)
        if chunk:
            sender.send(position, chunk)
            position += len(chunk)
        sender.finish()
    finally:
        sender.close()
    if progress:
        progress(position, total)
    return position - start


class _ChunkSender:
    """Chunk scripts on one connection, ``WINDOW`` in flight: Redis runs one chunk
    while this process packs the next. Replies are checked in order; a chunk
    sent after a failed one finds ``enqueued`` unchanged and appends nothing."""

    WINDOW = 2

    def __init__(self, conn: redis.Redis, qk: QueueKeys, job_id: str, total: int) -> None:
        self.sha = APPEND_CHUNK.load(conn)
        self.pool = conn.connection_pool
        self.connection = self.pool.get_connection()
        self.qk, self.job = qk, qk.job(job_id)
        self.job_id = job_id
        self.total = total
        self.in_flight: deque[tuple[int, int]] = deque()
        self.broken = False

    def send(self, start: int, chunk: list[bytes]) -> None:
        keys, args = APPEND_CHUNK.flatten(
            {"job": self.job.job, "ready": self.qk.ready, "backlogs": self.job.backlogs,
             "job_id": self.job_id, "events": self.qk.events, "start": start,
             "items": backlog.items(enumerate(chunk, start))}
        )  # fmt: skip
        packed = self.connection.pack_command("EVALSHA", self.sha, len(keys), *keys, *args)
        self.connection.send_packed_command(packed, check_health=False)
        self.in_flight.append((start, len(chunk)))
        if len(self.in_flight) > self.WINDOW:
            self._receive()

    def finish(self) -> None:
        while self.in_flight:
            self._receive()

    def close(self) -> None:
        if self.broken or self.in_flight:
            self.connection.disconnect()  # unread replies must not reach the next user
        self.pool.release(self.connection)

    def _receive(self) -> None:
        start, n = self.in_flight.popleft()
        try:
            enqueued, state = self.connection.read_response()
        except redis.ResponseError as exc:
            self.broken = True
            if is_oom(exc):
                raise queue_full(
                    start, self.total,
                    f"re-run the same submit with --job-id {self.job_id} to enqueue the rest",
                ) from exc  # fmt: skip
            raise
        except BaseException:
            self.broken = True
            raise
        if enqueued == start + n:
            return
        self.broken = True
        if enqueued == -1:
            raise JobConflict(f"job {self.job_id!r} disappeared from Redis while submitting")
        if enqueued == -2:
            raise JobConflict(f"job {self.job_id!r} was cancelled while submitting ({text(state)})")
        raise JobConflict(
            f"job {self.job_id!r} is being submitted by another process too "
            f"(it has {enqueued} requests, this one expected {start}); let that one finish"
        )
