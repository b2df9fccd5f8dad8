"""submit: validate the whole file, create the job, append its requests to the stream.

Pass 1 parses and validates every line into a spool file of ready entries
(nothing touches Redis before the whole file is known good, unless
``skip_invalid``). Pass 2 appends the spool in chunks, each chunk one Lua call
that XADDs its entries and advances the job's ``enqueued`` counter atomically,
and only if ``enqueued`` still equals the chunk's start. So:

- a crashed or OOM-stopped submit leaves a prefix of whole chunks; re-running
  it with the same ``--job-id`` continues from ``enqueued``;
- re-submitting a finished job enqueues nothing;
- two submits of one job id racing never enqueue a chunk twice;
- a different file (or flags) under an existing job id is refused (the job
  records the sha256 of its entries).
"""

from __future__ import annotations

import hashlib
import secrets
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any, BinaryIO

import redis

from batchgen.jobs.connection import is_oom, queue_full
from batchgen.jobs.errors import InvalidInput, JobConflict, UsageError
from batchgen.jobs.inputs import MAX_LINE_BYTES, LineError, parse_line, read_lines
from batchgen.jobs.keys import GROUP, Keys, QueueKeys, queue_name, queue_tag, text
from batchgen.jobs.names import check_job_id
from batchgen.jobs.records import JobRecord, JobState

CHUNK_ENTRIES = 2000
CHUNK_BYTES = 4 << 20
SHOWN_ERRORS = 20

_CHUNK = """
local v = redis.call('HMGET', KEYS[2], 'enqueued', 'state')
if not v[1] then return {-1, ''} end
if v[2] == 'cancelling' or v[2] == 'cancelled' then return {-2, v[2]} end
local start = tonumber(ARGV[2])
if tonumber(v[1]) ~= start then return {tonumber(v[1]), ''} end
local id
for k = 3, #ARGV do
  id = redis.call('XADD', KEYS[1], '*', 'j', ARGV[1], 'i', start + k - 3, 'r', ARGV[k])
end
local enqueued = start + #ARGV - 2
redis.call('HSET', KEYS[2], 'enqueued', enqueued, 'last_id', id)
return {enqueued, ''}
"""

_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
redis.call('SADD', KEYS[2], ARGV[2])
return 1
"""


@dataclass(slots=True)
class Validation:
    total: int = 0
    error_count: int = 0
    errors: list[LineError] = field(default_factory=list)  # the first few
    sha256: str = ""


@dataclass(slots=True)
class SubmitResult:
    job_id: str
    total: int
    skipped: int
    errors: list[LineError]  # the first invalid lines (skip_invalid)
    enqueued_now: int  # entries this call appended
    resumed: bool  # the job existed (an interrupted or repeated submit)


def validate(
    source: BinaryIO,
    defaults: dict[str, Any],
    spool: IO[bytes],
    max_line_bytes: int = MAX_LINE_BYTES,
) -> Validation:
    """Parse every line; write each valid entry (one JSON a line) to ``spool``."""
    result = Validation()
    digest = hashlib.sha256()
    write, update = spool.write, digest.update
    for number, line in read_lines(source, max_line_bytes):
        entry = line if isinstance(line, LineError) else parse_line(number, line, defaults)
        if isinstance(entry, LineError):
            result.error_count += 1
            if len(result.errors) < SHOWN_ERRORS:
                result.errors.append(entry)
            continue
        write(entry)
        write(b"\n")
        update(entry)
        update(b"\n")
        result.total += 1
    result.sha256 = digest.hexdigest()
    return result


def new_job_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def ensure_group(conn: redis.Redis, qk: QueueKeys) -> None:
    """The stream and its consumer group; id 0 so entries added earlier are delivered."""
    try:
        conn.xgroup_create(qk.stream, GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


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
) -> SubmitResult:
    job_id = check_job_id(job_id) if job_id else new_job_id()
    try:
        source = open(source_path, "rb")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise UsageError(f"cannot read {source_path}: {exc.strerror}") from exc
    with source, tempfile.TemporaryFile(prefix="batchgen-submit-") as spool:
        checked = validate(source, defaults, spool, max_line_bytes)
        if checked.error_count and not skip_invalid:
            shown = "\n  ".join(str(e) for e in checked.errors)
            more = checked.error_count - len(checked.errors)
            raise InvalidInput(
                f"{source_path}: {checked.error_count} invalid line(s); nothing was enqueued. "
                f"Fix them, or pass --skip-invalid to submit only the valid lines.\n  {shown}"
                + (f"\n  ... and {more} more" if more else "")
            )
        if checked.total == 0:
            raise InvalidInput(f"{source_path}: no valid lines; nothing was enqueued")
        name = queue_name(model)
        qk = keys.queue(queue_tag(name))
        record = JobRecord(
            id=job_id,
            model=model,
            queue=name,
            tag=qk.tag,
            output=output,
            defaults=defaults,
            source=source_path,
            source_sha256=checked.sha256,
            total=checked.total,
            skipped=checked.error_count,
            created_at=time.time(),
        )
        resumed, start = _create(conn, keys, qk, record)
        spool.seek(0)
        appended = _enqueue(conn, qk, job_id, spool, start, checked.total, progress)
    return SubmitResult(
        job_id, checked.total, checked.error_count, checked.errors, appended, resumed
    )


def _create(conn: redis.Redis, keys: Keys, qk: QueueKeys, record: JobRecord) -> tuple[bool, int]:
    """Create the job, or find it and check it is this same submission; (resumed, start)."""
    job_id = record.id
    if not conn.hsetnx(keys.jobs, job_id, qk.tag):
        tag = text(conn.hget(keys.jobs, job_id))
        if tag != qk.tag:
            other = text(conn.hget(keys.queues, tag)) or "?"
            raise JobConflict(
                f"job {job_id!r} already exists for model {other!r}; choose another --job-id"
            )
    conn.hset(keys.queues, qk.tag, record.queue)
    ensure_group(conn, qk)
    jk = qk.job(job_id)
    fields = [x for pair in record.to_hash().items() for x in pair]
    # ARGV[2] must be the job id for SADD: put ("id", job_id) first.
    created = conn.register_script(_CREATE)(keys=[jk.job, qk.active], args=["id", job_id, *fields])
    if created:
        return False, 0
    existing = JobRecord.from_hash(job_id, conn.hgetall(jk.job))
    if existing.source_sha256 != record.source_sha256:
        raise JobConflict(
            f"job {job_id!r} was submitted from different input or flags "
            f"({existing.source}, {existing.total} requests); choose another --job-id"
        )
    if existing.state in (JobState.CANCELLING, JobState.CANCELLED):
        raise JobConflict(f"job {job_id!r} was cancelled; submit under another --job-id")
    return True, existing.enqueued


def _enqueue(
    conn: redis.Redis,
    qk: QueueKeys,
    job_id: str,
    spool: IO[bytes],
    start: int,
    total: int,
    progress: Callable[[int, int], None] | None,
) -> int:
    script = conn.register_script(_CHUNK)
    jk = qk.job(job_id)
    for _ in range(start):  # skip what an earlier submit already appended
        spool.readline()
    position, chunk, size = start, [], 0
    appended = 0
    for line in spool:
        chunk.append(line[:-1])
        size += len(line)
        if len(chunk) >= CHUNK_ENTRIES or size >= CHUNK_BYTES:
            appended += _append(script, qk, jk.job, job_id, position, chunk, total)
            position += len(chunk)
            chunk, size = [], 0
            if progress:
                progress(position, total)
    if chunk:
        appended += _append(script, qk, jk.job, job_id, position, chunk, total)
        if progress:
            progress(position + len(chunk), total)
    return appended


def _append(script, qk: QueueKeys, job_key: str, job_id: str, start: int, chunk, total) -> int:
    try:
        enqueued, state = script(keys=[qk.stream, job_key], args=[job_id, start, *chunk])
    except redis.ResponseError as exc:
        if is_oom(exc):
            raise queue_full(
                start, total, f"re-run the same submit with --job-id {job_id} to enqueue the rest"
            ) from exc
        raise
    if enqueued == -1:
        raise JobConflict(f"job {job_id!r} disappeared from Redis while submitting")
    if enqueued == -2:
        raise JobConflict(f"job {job_id!r} was cancelled while submitting ({text(state)})")
    if enqueued != start + len(chunk):
        raise JobConflict(
            f"job {job_id!r} is being submitted by another process too "
            f"(it has {enqueued} requests, this one expected {start}); let that one finish"
        )
    return len(chunk)
