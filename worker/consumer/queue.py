"""The consumer side of a model's request stream.

A worker is a named consumer in group ``workers``. It reads new entries
(``read_new``: XREADGROUP ``>``, and requests the dispatch script moves from the
jobs' backlogs, dispatch.py), keeps the ones it holds from looking idle (``refresh``:
XCLAIM JUSTID to itself, only where it still owns them), takes over entries
idle past a timeout (``reclaim``: XPENDING IDLE + XCLAIM per id, in one script,
so every claimed entry has its exact delivery count; deleted ones are acked
and reported as lost), dead-letters entries delivered too often, hands in-flight requests back on shutdown (``hand_back``), and drops
entries of cancelled jobs. An entry it cannot read (``readable``) becomes its job's
error row, or is dropped, logged: it never stops the worker. Every step that moves an entry is one atomic
script, and entries are deleted once acked so the stream does not grow.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from batchgen.jobs.ops.finalize.finalize_tasks import enqueue_finalize
from batchgen.jobs.ops.lifecycle import script
from batchgen.jobs.redis.keys import GROUP, Keys, QueueKeys, text
from batchgen.jobs.redis.lua import ACK_AND_DELETE, LuaScript
from batchgen.jobs.redis.stream import ensure_group
from batchgen.jobs.schema.entry import QueueEntry, job_and_index
from batchgen.jobs.schema.errors import EntryError
from batchgen.jobs.schema.rows import Row
from batchgen.worker.consumer.dispatch import dispatch

log = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class Delivery(QueueEntry):
    """A stream entry (jobs/schema/entry.py) as this worker read it."""

    entry_id: str
    deliveries: int = 1  # times this entry was delivered (XPENDING), this one included
    # unix s this worker read it: its commit dates the job's start by its earliest read, so
    # the job's tok/s counts the time its first rows were generated in
    read_at: float = field(default_factory=time.time, compare=False)

    @property
    def attempts(self) -> int:
        """Deliveries that ran this request, hand-backs included (the output column)."""
        return self.prior_runs + self.deliveries

    @property
    def failed_attempts(self) -> int:
        """Deliveries that may have crashed a worker (what ``max_attempts`` limits)."""
        return self.prior_failures + self.deliveries

    @classmethod
    def parse(cls, entry_id: bytes, fields: dict[bytes, bytes], deliveries: int = 1) -> Delivery:
        eid = entry_id.decode()
        return cls.decode(fields, eid, entry_id=eid, deliveries=deliveries)


def read_new(
    conn: redis.Redis, qk: QueueKeys, consumer: str, count: int,
    groups: Sequence[int] | None = None,
) -> list[Delivery]:  # fmt: skip
    """Up to ``count`` entries never delivered before: handed-back ones first, then
    requests the dispatch script (dispatch.py) moves from the jobs' backlogs by fair
    share; ``groups``: this worker's prefix groups (None: every group). Never blocks."""
    if count <= 0:
        return []
    try:
        reply = dispatch(conn, qk, consumer, count, groups)
    except redis.ResponseError as exc:
        if "NOGROUP" not in str(exc):
            raise
        recreate_group(conn, qk)
        return []
    return readable(conn, qk, consumer, [(eid.encode(), fields, 1) for eid, fields in reply])


def readable(
    conn: redis.Redis, qk: QueueKeys, consumer: str, raw: list[tuple[Any, dict, int]]
) -> list[Delivery]:
    """The entries of ``raw`` (id, fields, deliveries) this release can read. One it cannot
    (corrupt, planted, or of an unknown format) must not stop the worker, which would
    read it again after every restart: it becomes its job's error row (dead-lettered with
    the reason) when its job and index can be read, else it is dropped, logged."""
    out = []
    for entry_id, fields, deliveries in raw:
        try:
            out.append(Delivery.parse(entry_id, fields, deliveries))
        except EntryError as exc:
            set_aside(conn, qk, consumer, text(entry_id), fields, str(exc), deliveries)
    return out


def set_aside(
    conn: redis.Redis, qk: QueueKeys, consumer: str, entry_id: str, fields: dict, reason: str,
    deliveries: int,
) -> None:  # fmt: skip
    """An unreadable entry: dead-lettered as its job's error row, or dropped (logged). Its
    row's ``attempts`` are its ``deliveries`` (what it carried cannot be read)."""
    where = job_and_index(fields)
    if where is not None:
        job_id, index = where
        total = conn.hget(qk.job(job_id).job, "total")
        if total is not None and index < int(total):
            row = Row(index=index, error=f"dead-lettered: {reason}", attempts=deliveries,
                      worker=consumer, finished_at=int(time.time() * 1000))  # fmt: skip
            raw = [text(x) if isinstance(x, bytes) else str(x) for kv in fields.items() for x in kv]
            log.error("job %s, input %d: %s; dead-lettered", job_id, index, reason)
            made = DEAD_LETTER(
                conn, stream=qk.stream, dead=qk.job(job_id).dead, job=qk.job(job_id).job,
                done=qk.job(job_id).done, errors=qk.job(job_id).errors, group=GROUP, id=entry_id,
                index=index, request=json.dumps(raw, ensure_ascii=False), reason=reason,
                deliveries=deliveries, worker=consumer,
                row=json.dumps(row.to_dict(), ensure_ascii=False), now=repr(time.time()),
            )  # fmt: skip
            if int(made) == 2:
                enqueue_finalize(conn, Keys(qk.prefix), qk, job_id)
            return
    log.error("%s; no job of this Redis can take its error row: dropped", reason)
    drop(conn, qk, [entry_id])


def recreate_group(conn: redis.Redis, qk: QueueKeys) -> None:
    """The stream or its consumer group vanished: Redis lost its state. Say so
    (jobs it held are gone: status reports them unknown) and serve on."""
    log.error(
        "the request stream %s or its consumer group is gone: Redis lost its state "
        "(restarted without persistence?); jobs submitted before are lost, requests held "
        "here are dropped; re-submit them",
        qk.stream,
    )
    ensure_group(conn, qk)


REFRESH = LuaScript.define(
    "refresh claims",
    keys=[("stream", "the model's request stream")],
    args=[("group", ""), ("me", "this consumer"), ("*ids", "entries this worker holds")],
    body="""
local gone, mine = {}, {}
for _, id in ipairs(ids) do
  local p = redis.call('XPENDING', stream, group, id, id, 1)
  if #p == 0 or p[1][2] ~= me then gone[#gone + 1] = id else mine[#mine + 1] = id end
end
for i = 1, #mine, 500 do
  -- unpack() expands to all its values only as the last argument of a call
  local claim = {stream, group, me, 0}
  for k = i, math.min(i + 499, #mine) do claim[#claim + 1] = mine[k] end
  claim[#claim + 1] = 'JUSTID'
  redis.call('XCLAIM', unpack(claim))
end
return gone
""",
)


def refresh(conn: redis.Redis, qk: QueueKeys, consumer: str, entry_ids: list[str]) -> list[str]:
    """Reset the idle time of entries we still own; the ids that are no longer ours.

    XCLAIM JUSTID does not bump the delivery count. An entry another worker
    claimed meanwhile (we were stopped past the claim timeout) is left to it.
    """
    if not entry_ids:
        return []
    gone: Any = REFRESH(conn, stream=qk.stream, group=GROUP, me=consumer, ids=entry_ids)
    return [g.decode() for g in gone]


@dataclass(slots=True)
class Reclaimed:
    deliveries: list[Delivery] = field(default_factory=list)
    lost_ids: list[str] = field(default_factory=list)  # deleted while pending: bodies gone


RECLAIM = LuaScript.define(
    "reclaim",
    keys=[("stream", "the model's request stream")],
    args=[
        ("group", ""),
        ("me", "this consumer"),
        ("min_idle", "ms an entry must be idle"),
        ("count", "claim at most this many"),
    ],
    body="""
-- One id at a time, so each claimed entry comes with its exact delivery count and a
-- deleted one is known by its id on every server version (7.0 drops it from the PEL
-- and returns nothing; 6.2 returns a nil entry and keeps it pending: acked here).
local claimed, lost = {}, {}
for _, p in ipairs(redis.call('XPENDING', stream, group, 'IDLE', min_idle, '-', '+', count)) do
  local id, delivered = p[1], p[4]
  local entry = redis.call('XCLAIM', stream, group, me, min_idle, id)[1]
  if type(entry) == 'table' and type(entry[2]) == 'table' then
    claimed[#claimed + 1] = {id, entry[2], delivered + 1}
  else
    redis.call('XACK', stream, group, id)
    lost[#lost + 1] = id
  end
end
return {claimed, lost}
""",
)


def reclaim(
    conn: redis.Redis, qk: QueueKeys, consumer: str, min_idle_ms: int, count: int
) -> Reclaimed:
    """Claim up to ``count`` entries idle for ``min_idle_ms`` (a dead worker's), each with
    its exact delivery count, in one atomic step. Entries deleted while pending (a
    trimmed stream) are acked and reported as lost."""
    if count <= 0:
        return Reclaimed()
    claimed, lost = RECLAIM(
        conn, stream=qk.stream, group=GROUP, me=consumer, min_idle=min_idle_ms, count=count
    )
    raw = [(eid, dict(zip(flat[::2], flat[1::2])), int(n)) for eid, flat, n in claimed]
    return Reclaimed(readable(conn, qk, consumer, raw), [text(i) for i in lost])


HAND_BACK = script(
    "hand back",
    keys=[("stream", "the model's request stream"), ("*touched", "the job records named below")],
    args=[
        ("group", ""),
        ("me", "this consumer"),
        ("events", "the model's events channel: 'work' wakes idle workers"),
        ("payload", "JSON list of {record, old: entry id, fields: the new entry's}"),
    ],
    prelude=ACK_AND_DELETE,
    body="""
local handed = 0
for _, item in ipairs(cjson.decode(payload)) do
  local pend = redis.call('XPENDING', stream, group, item.old, item.old, 1)
  if #pend == 1 and pend[1][2] == me then  -- still ours: another worker may have taken it
    if job_status(item.record) == 'live' then
      local id = redis.call('XADD', stream, '*', unpack(item.fields))
      redis.call('HSET', item.record, 'last_id', id)
      handed = handed + 1
    end
    ack_and_delete(stream, group, {item.old})
  end
end
if handed > 0 then redis.call('PUBLISH', events, 'work') end
return handed
""",
)


@dataclass(slots=True)
class HandBack:
    delivery: Delivery
    token_ids: list[int]  # generated so far, the resumed ones included
    preemptions: int = 0
    failed: bool = False  # the worker's engine failed: this delivery counts as a crash
    ran: bool = True  # False: never started here (a waiting suspect): the delivery is not counted
    error: str = ""  # with ``failed``: what the engine raised
    row: Row | None = None  # finished, but its part could not be written: carried to the next


def hand_back(conn: redis.Redis, qk: QueueKeys, consumer: str, items: list[HandBack]) -> int:
    """Requeue unfinished requests with their tokens so far; ack the originals atomically.

    Only entries this worker still owns are handed back (another worker that
    claimed one will run it). The new entry counts the old one's deliveries
    but the last (which ended gracefully) as failures toward ``max_attempts``;
    an item that never ran here does not count the last delivery as an attempt
    either.
    """
    if not items:
        return 0
    touched, payload = [], []
    for item in items:
        d = item.delivery
        entry = QueueEntry(
            job_id=d.job_id,
            index=d.index,
            request=d.request,
            resume=item.token_ids,
            prior_runs=d.attempts - (0 if item.ran else 1),
            prior_failures=d.failed_attempts - (0 if item.failed else 1),
            queued_at=d.queued_at,
            preemptions=d.preemptions + item.preemptions,
            last_error=(item.error or d.last_error)[:1000],
            # d.finished: handed back again before it reached a worker's sink
            finished=item.row if item.row is not None else d.finished,
        )
        record = qk.job(d.job_id).job
        touched.append(record)
        payload.append({"record": record, "old": d.entry_id, "fields": entry.handed_back_fields()})
    handed = HAND_BACK(conn, stream=qk.stream, touched=touched, group=GROUP, me=consumer,
                       events=qk.events, payload=json.dumps(payload, ensure_ascii=False))  # fmt: skip
    return int(handed)


DEAD_LETTER = script(
    "dead letter",
    keys=[
        ("stream", "the model's request stream"),
        ("dead", "the job's dead-letter stream"),
        ("job", "the job record"),
        ("done", "its done-marks"),
        ("errors", "its error rows"),
    ],
    args=[
        "group",
        "id",
        "index",
        ("request", "JSON list: the entry's request fields, name, value, ..."),
        "reason",
        "deliveries",
        "worker",
        ("row", "the error row JSON"),
        ("now", "unix seconds"),
    ],
    prelude=ACK_AND_DELETE,
    body="""
local add = cjson.decode(request)
for _, v in ipairs({'reason', reason, 'deliveries', deliveries, 'worker', worker, 'entry', id}) do
  add[#add + 1] = v
end
redis.call('XADD', dead, '*', unpack(add))
ack_and_delete(stream, group, {id})
if job_status(job) == 'live' and redis.call('SETBIT', done, index, 1) == 0 then
  redis.call('HSET', errors, index, row)
  if bump(job, 0, 1, 0, 0, 0, now) then return 2 end
  return 1
end
return 0
""",
)


def dead_letter(
    conn: redis.Redis, qk: QueueKeys, delivery: Delivery, reason: str, worker: str, row_json: str
) -> bool:
    """Move the entry to the dead-letter stream and record its error row, atomically.

    The error row is kept in the job's ``errors`` hash (no part file); finalize
    writes it. True when this made the job complete (enqueue finalize).
    """
    jk = qk.job(delivery.job_id)
    made = DEAD_LETTER(
        conn, stream=qk.stream, dead=jk.dead, job=jk.job, done=jk.done, errors=jk.errors,
        group=GROUP, id=delivery.entry_id, index=delivery.index,
        request=json.dumps(delivery.request_fields(), ensure_ascii=False), reason=reason,
        deliveries=delivery.failed_attempts,
        worker=worker, row=row_json, now=repr(time.time()),
    )  # fmt: skip
    return int(made) == 2


def drop(conn: redis.Redis, qk: QueueKeys, entry_ids: list[str], pipeline=None) -> None:
    """Ack and delete entries that need no row (their job was cancelled or is gone)."""
    if not entry_ids:
        return
    pipe = pipeline if pipeline is not None else conn.pipeline(transaction=True)
    pipe.xack(qk.stream, GROUP, *entry_ids)
    pipe.xdel(qk.stream, *entry_ids)
    if pipeline is None:
        pipe.execute()
