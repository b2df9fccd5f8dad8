"""retry: a finished job's failed rows run again, as new attempts of the same job.

``batchgen retry JOB`` re-runs the rows whose finish_reason is ``error``
(could not run, dead-lettered, lost); ``--all-failed`` the ``cancelled`` ones
too. Every other row stays exactly as it was, and the output still holds one
row per input:

1. Under the job's finalize lease (no finalize, delete or other retry runs
   meanwhile), the job must be finished (completed or cancelled) and cleaned
   up; a clean-up a killed finalizer left undone is finished first.
2. The retried requests are read again from the job's recorded input with its
   recorded defaults, through submit's validation; the entries' sha256 must
   equal the job's (proof they are the very requests). A moved copy is given
   with ``input_path`` (``--input``) and checked the same way.
3. The job's tenant must have room for it, as for a submit (tenants.py): one
   more unfinished job and the retried requests' estimated input tokens; a
   retry past a quota is refused with submit's error and nothing changes. The
   share is released when the job finishes again (or the retry fails before
   4). Then the kept rows are written back from ``result.parquet`` as parts
   (carryover.py).
4. Entries a cancel left in the stream are deleted (they would run beside
   the retried ones). One atomic step (``REOPEN_JOB``) records those parts, sets the kept
   indices' done-marks and the counters to the kept rows', drops the old error
   rows, and moves the job back to running (lifecycle ``REOPEN``): open again,
   in the active set, no expiry, its retry counters bumped.
5. The retried requests are appended at their original indices in chunks
   (``RETRY_CHUNK``), each advancing the job's ``retry_cursor`` atomically. Each
   carries the ``attempts`` its row had (entry.py's backlog item), so the new row
   counts the deliveries of every round: its previous attempts plus this round's.

Workers commit the new rows like any others (first row wins); once every
input has a row the job is finalized again, which replaces ``result.parquet``.

Running it again is harmless at every point. Killed before 4, the job is
untouched (the part files are rewritten under the same names, or removed by
the next clean-up or delete). Killed after 4, the job runs with
``retry_cursor < total``: ``batchgen retry`` goes on from the cursor, queuing
the inputs past it that have no done-mark (those are exactly the ones not
queued yet), and until then the job waits (it cannot reach finalize, and the
lost-entry check skips it: ``enqueued < total``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import redis

from batchgen.jobs.crashpoints import CrashPlan
from batchgen.jobs.intake.lines import MAX_LINE_BYTES
from batchgen.jobs.intake.table_spec import TableSpec
from batchgen.jobs.intake.validate import SpoolDir, Validation
from batchgen.jobs.ops.carryover import PART_ROWS, attempts_before, carry_over, retried_mask
from batchgen.jobs.ops.chunk_append import CHUNK_BYTES, CHUNK_ENTRIES
from batchgen.jobs.ops.deletion import delete_entries
from batchgen.jobs.ops.fair_share import backlog, tenants
from batchgen.jobs.ops.fair_share.backlog import BACKLOG_PUSH
from batchgen.jobs.ops.finalize.finalization import FinalizeSettings, finalize
from batchgen.jobs.ops.job_record import JobRecord, load_job, queue_of_job
from batchgen.jobs.ops.lifecycle import script
from batchgen.jobs.ops.modelinfo import vocab_size
from batchgen.jobs.ops.submission import validate_input
from batchgen.jobs.redis.keys import Keys, QueueKeys, text
from batchgen.jobs.redis.lease import Lease
from batchgen.jobs.redis.sentinel import replicated
from batchgen.jobs.schema.entry import is_rejected
from batchgen.jobs.schema.errors import (
    JobConflict,
    JobNotFound,
    JobNotReady,
    LeaseHeld,
    ParamError,
    UsageError,
)
from batchgen.jobs.schema.rows import FinishReason
from batchgen.jobs.schema.sampling import job_defaults
from batchgen.jobs.storage.output_store import OutputDir

ERRORS = frozenset({FinishReason.ERROR.value})
ALL_FAILED = frozenset({FinishReason.ERROR.value, FinishReason.CANCELLED.value})

REOPEN_JOB = script(
    "reopen job for retry",
    keys=[
        ("job", "the job record"),
        ("done", "its done-marks"),
        ("parts", "its committed parts"),
        ("errors", "its error rows"),
        ("dead", "its dead letters"),
        ("active", "the queue's unfinalized jobs"),
        ("expiring", "finished jobs by expiry time"),
        ("cancelled", "the queue's cancelled jobs"),
    ],
    args=[
        ("job_id", ""),
        ("round", "retry rounds the job had when this retry read it"),
        ("bitmap", "the done-marks of the kept rows"),
        ("counts", "JSON: the kept rows' counters, rows kept and rows retried"),
        ("*parts_kept", "the kept rows' parts: name, commit record, ..."),
    ],
    body="""
local v = redis.call('HMGET', job, 'state', 'retry_rounds')
local state = v[1]
if not state then return 'missing' end
if not REOPEN[state] then return state end
if (tonumber(v[2]) or 0) ~= tonumber(round) then return 'raced' end
if redis.call('SISMEMBER', active, job_id) == 1 or redis.call('EXISTS', parts) == 1 then
  return 'unclean'
end
local c = cjson.decode(counts)
reopen(job, state, 'closed', '0', 'done', c.done, 'failed', c.failed,
       'cancelled_rows', c.cancelled, 'prompt_tokens', c.prompt_tokens,
       'completion_tokens', c.completion_tokens, 'reasoning_tokens', c.reasoning_tokens,
       'cached_tokens', c.cached_tokens, 'failed_prompt_tokens', c.failed_prompt_tokens,
       'enqueued', c.kept, 'last_id', '', 'error', '',
       'storage_error', '', 'finalize_attempts', 0, 'finished_at', 0, 'retry_cursor', 0,
       'retry_rounds', tonumber(round) + 1)
redis.call('HINCRBY', job, 'retried', c.retried)
redis.call('HDEL', job, 'finalize_retry_at', 'cancelled_at', 'lost')
redis.call('PERSIST', job)
redis.call('PERSIST', dead)
redis.call('DEL', errors, done)
redis.call('SET', done, bitmap)
for i = 1, #parts_kept, 2 do redis.call('HSET', parts, parts_kept[i], parts_kept[i + 1]) end
redis.call('SADD', active, job_id)
redis.call('ZREM', expiring, job_id)
redis.call('SREM', cancelled, job_id)
return 'reopened'
""",
)

RETRY_CHUNK = script(
    "append retry chunk",
    keys=[
        ("job", "the job record"),
        ("ready", "the model's jobs with a backlog"),
        ("*backlogs", "the job's backlog lists"),
    ],
    args=[
        ("job_id", ""),
        ("events", "the model's events channel: 'work' wakes idle workers"),
        ("cursor", "the job's retry_cursor when this chunk was packed"),
        ("next", "the cursor after this chunk"),
        ("final", "'1': the last chunk (every retried input is queued after it)"),
        ("*items", "prefix group, backlog item (backlog.items), ..."),
    ],
    body="""
local v = redis.call('HMGET', job, 'state', 'retry_cursor', 'total')
if not v[1] then return 'missing' end
if v[1] ~= S.QUEUED and v[1] ~= S.RUNNING then return v[1] end
if tonumber(v[2]) ~= tonumber(cursor) then return 'moved' end
if #items > 0 then push_backlog(job, job_id, ready, events, backlogs, items) end
redis.call('HSET', job, 'retry_cursor', next)
if final == '1' then
  redis.call('HSET', job, 'enqueued', v[3])
else
  redis.call('HINCRBY', job, 'enqueued', #items / 2)
end
return 'ok'
""",
    prelude=BACKLOG_PUSH,
)


@dataclass(slots=True)
class RetryResult:
    job_id: str
    rows: int  # rows this retry runs again (0: nothing to retry)
    queued_now: int  # requests this call appended
    round: int  # the job's retry round
    resumed: bool  # went on with a retry that was stopped halfway
    invalid: int = 0  # failed rows of invalid lines (--skip-invalid), left as they are


def retry(
    conn: redis.Redis,
    keys: Keys,
    job_id: str,
    *,
    all_failed: bool = False,
    input_path: str | None = None,
    part_rows: int = PART_ROWS,
) -> RetryResult:
    try:
        qk = queue_of_job(conn, keys, job_id)
    except JobNotFound:
        raise JobNotFound(
            f"no job {job_id!r} in this Redis: it was deleted, or its state expired after its "
            "retention (submit --retention), and a retry needs it; submit the input again as a "
            "new job"
        ) from None
    jk = qk.job(job_id)
    record = load_job(conn, keys, job_id)
    settings = FinalizeSettings.from_env()  # the job's finalize lease is the one a retry holds
    try:
        if record.state.terminal and conn.sismember(qk.active, job_id):
            finalize(conn, keys, job_id, settings)  # its clean-up was cut short: finish it
        with Lease(conn, jk.finalizer, settings.lease_s, f"batchgen retry {job_id}"):
            return _retry(conn, keys, qk, job_id, all_failed, input_path, part_rows)
    except LeaseHeld as held:
        raise JobConflict(
            f"job {job_id!r} is being finalized or retried right now by {held.holder} (one "
            f"that was killed lets go within {settings.lease_s:.0f}s); try again once it is done"
        ) from None


def _retry(
    conn: redis.Redis, keys: Keys, qk: QueueKeys, job_id: str, all_failed: bool,
    input_path: str | None, part_rows: int,
) -> RetryResult:  # fmt: skip
    record = load_job(conn, keys, job_id)
    if record.retry_incomplete:
        with SpoolDir() as spool:
            requests = _requests(record, input_path, spool)
            queued = _enqueue_rest(conn, qk, record, requests)
        return RetryResult(job_id, queued, queued, record.retry_rounds, resumed=True)
    if not record.state.terminal:
        raise JobNotReady(
            f"job {job_id!r} is {record.state.value} ({record.finished_rows}/{record.total} "
            "rows); only a finished job (completed or cancelled) can be retried"
        )
    out = OutputDir.open(record.output)
    retried = retried_mask(out, record.total, ALL_FAILED if all_failed else ERRORS)
    round_ = record.retry_rounds + 1
    if not retried.any():
        return RetryResult(job_id, 0, 0, record.retry_rounds, resumed=False)
    with SpoolDir() as spool:
        requests = _requests(record, input_path, spool)
        invalid = 0
        if record.skipped:  # an invalid line's error row stays: it would fail the same way
            rejected = retried & _rejected(requests, record.total)
            invalid = int(rejected.sum())
            retried &= ~rejected
        rows = int(retried.sum())
        if rows == 0:
            return RetryResult(job_id, 0, 0, record.retry_rounds, resumed=False, invalid=invalid)
        tokens = sum(backlog.estimate_input_tokens(entry)
                     for position, entry in enumerate(requests.entries()) if retried[position])  # fmt: skip
        tenants.reserve(conn, keys, record, tokens)  # refused (QuotaExceeded): nothing reopened
        try:
            return _reopen(conn, keys, qk, record, requests, retried, round_, part_rows, invalid)
        except BaseException:
            if load_job(conn, keys, job_id).state.terminal:  # not reopened: nothing to hold
                tenants.release(conn, keys, record.tenant, job_id)
            raise


def _reopen(
    conn: redis.Redis, keys: Keys, qk: QueueKeys, record: JobRecord, requests: Validation,
    retried: np.ndarray, round_: int, part_rows: int, invalid: int,
) -> RetryResult:  # fmt: skip
    """Steps 3 to 5: the kept rows as parts, the job reopened, the retried rows queued."""
    job_id, rows = record.id, int(retried.sum())
    out = OutputDir.open(record.output)
    crash = CrashPlan.from_env()
    kept = carry_over(out, job_id, round_, retried, part_rows)
    crash.reached("after_retry_parts")
    if conn.sismember(qk.cancelled, job_id):  # entries its cancel left must not run too
        delete_entries(conn, qk, job_id)
    jk = qk.job(job_id)
    counts = {"done": kept.done, "failed": kept.failed, "cancelled": kept.cancelled,
              **kept.tokens, "kept": kept.rows, "retried": rows}  # fmt: skip
    status = text(REOPEN_JOB(
        conn, job=jk.job, done=jk.done, parts=jk.parts, errors=jk.errors, dead=jk.dead,
        active=qk.active, expiring=qk.expiring, cancelled=qk.cancelled, job_id=job_id,
        round=record.retry_rounds, bitmap=np.packbits(~retried).tobytes(),
        counts=json.dumps(counts), parts_kept=[x for part in kept.parts for x in part],
    ))  # fmt: skip
    if status != "reopened":
        raise JobConflict(f"job {job_id!r} changed while retrying ({status}); run it again")
    crash.reached("after_retry_reopen")
    record = load_job(conn, keys, job_id)
    queued = _enqueue_rest(conn, qk, record, requests)
    return RetryResult(job_id, rows, queued, round_, resumed=False, invalid=invalid)


def _requests(record: JobRecord, input_path: str | None, spool: Path) -> Validation:
    """The job's requests, validated again as submit did; refused unless they are the same."""
    path = input_path or record.source
    hint = "" if input_path else "; if it moved, pass a copy with --input PATH"
    # The record keeps the defaults with sorted keys; an entry lists them in the order
    # submit had them, which job_defaults gives (every caller of submit builds them so).
    try:
        defaults = job_defaults(record.defaults)
    except ParamError as exc:  # a record written by another version, say
        raise JobConflict(f"job {record.id!r} has defaults this version refuses: {exc}") from None
    try:  # read as submit read it: the same format, and a table's same flags
        checked, _, _ = validate_input(
            path, record.input_format or None, TableSpec.from_json(record.table), defaults,
            spool, MAX_LINE_BYTES, vocab_size(record.model),
        )  # fmt: skip
    except UsageError as exc:
        raise UsageError(f"the job's input cannot be read: {exc}{hint}") from None
    if checked.sha256 != record.source_sha256 or checked.total != record.total:
        raise JobConflict(
            f"{path} does not hold job {record.id!r}'s requests any more ({checked.total} lines, "
            f"entries sha256 {checked.sha256[:12]}; the job has {record.total}, "
            f"{record.source_sha256[:12]}): nothing was retried{hint or '; check --input'}"
        )
    return checked


def _rejected(requests: Validation, total: int) -> np.ndarray:
    """True for each input whose entry is an invalid line's (skipped at submit)."""
    mask = np.zeros(total, dtype=bool)
    for position, entry in enumerate(requests.entries()):
        mask[position] = is_rejected(entry)
    return mask


def _enqueue_rest(conn: redis.Redis, qk: QueueKeys, record: JobRecord, requests: Validation) -> int:
    """Append the inputs at or past the job's retry cursor that have no done-mark; how many.
    Each carries its row's attempts in the previous result (which stays until the job is
    finalized again), so its new row counts them."""
    jk = qk.job(record.id)
    before = attempts_before(OutputDir.open(record.output), record.total)
    crash = CrashPlan.from_env()
    raw = conn.get(jk.done)
    marks = np.unpackbits(np.frombuffer(raw if isinstance(raw, bytes) else b"", np.uint8))
    marks = np.pad(marks[: record.total], (0, max(record.total - len(marks), 0)))
    todo = np.flatnonzero(marks[record.retry_cursor :] == 0) + record.retry_cursor
    cursor, queued = record.retry_cursor, 0
    chunks = _chunks(requests.entries(), todo)
    pending = next(chunks, None)
    while True:
        items = pending or []
        pending = next(chunks, None)
        final = pending is None
        following = record.total if final else items[-1][0] + 1
        status = text(RETRY_CHUNK(
            conn, job=jk.job, ready=qk.ready, backlogs=jk.backlogs, job_id=record.id,
            events=qk.events, cursor=cursor, next=following, final="1" if final else "0",
            items=backlog.items(items, prior_runs={i: int(before[i]) for i, _ in items}),
        ))  # fmt: skip
        if status != "ok":
            raise JobConflict(_stopped(record.id, status))
        crash.reached("after_retry_chunk")
        cursor, queued = following, queued + len(items)
        if final:
            replicated(conn)  # through Sentinel: on a replica before the retry says so
            return queued


def _chunks(entries: Iterator[bytes], todo: np.ndarray) -> Iterator[list[tuple[int, bytes]]]:
    """(input index, entry) of the ``todo`` inputs, in chunks submit would send."""
    chunk: list[tuple[int, bytes]] = []
    size, want = 0, 0
    for position, entry in enumerate(entries):
        if want == len(todo):
            break
        if position != todo[want]:
            continue
        want += 1
        chunk.append((position, entry))
        size += len(entry) + 16
        if len(chunk) >= CHUNK_ENTRIES or size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _stopped(job_id: str, status: str) -> str:
    if status == "missing":
        return f"job {job_id!r} was deleted while retrying"
    if status == "moved":
        return f"job {job_id!r} is being retried by another process too; let that one finish"
    return f"job {job_id!r} became {status} while retrying; its rows not queued yet were not run"
