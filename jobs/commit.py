"""The commit step: published parts become committed rows, in ONE atomic Lua step.

For every row: SETBIT on the job's done-mark bitmap (the old bit says whether a
row for that input was committed before: first commit wins), counters bumped
for winners only; the part's commit record lists the indices it lost (usually
none), so finalize knows which row of which part is the winner. The stream
entries are XACKed and XDELed in the same step, so the stream never grows
without bound and a crash leaves either everything or nothing done. A job that
has every row moves to ``finalizing`` here, exactly once.

All keys share the queue's hash tag (keys.py), so this runs on Redis Cluster.
Idempotent: a part already recorded is not counted again (a retried commit
after a lost reply only acks); a closed (finalized) or missing job's rows are
discarded and their entries acked.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import redis

from batchgen.jobs.keys import GROUP, QueueKeys
from batchgen.jobs.rows import Row

# Shared Lua: job liveness and the counters + state transition after new rows.
LUA_HELPERS = """
local function job_status(job)
  local v = redis.call('HMGET', job, 'state', 'closed')
  if not v[1] then return 'missing' end
  if v[2] == '1' then return 'closed' end
  return 'live'
end

local function bump(job, d, f, pt, ct, cc, now)
  if d > 0 then redis.call('HINCRBY', job, 'done', d) end
  if f > 0 then redis.call('HINCRBY', job, 'failed', f) end
  if pt > 0 then redis.call('HINCRBY', job, 'prompt_tokens', pt) end
  if ct > 0 then redis.call('HINCRBY', job, 'completion_tokens', ct) end
  if cc > 0 then redis.call('HINCRBY', job, 'cached_tokens', cc) end
  local v = redis.call('HMGET', job, 'state', 'done', 'failed', 'total')
  local state = v[1]
  if state == 'queued' then
    redis.call('HSET', job, 'state', 'running', 'started_at', now)
    state = 'running'
  end
  if state == 'running' and tonumber(v[2]) + tonumber(v[3]) >= tonumber(v[4]) then
    redis.call('HSET', job, 'state', 'finalizing')
    return true
  end
  return false
end

local function ack_and_delete(stream, group, ids)
  for i = 1, #ids, 500 do
    local chunk = {}
    for k = i, math.min(i + 499, #ids) do chunk[#chunk + 1] = ids[k] end
    redis.call('XACK', stream, group, unpack(chunk))
    redis.call('XDEL', stream, unpack(chunk))
  end
end
"""

_COMMIT = (
    LUA_HELPERS
    + """
local stream, group, now = KEYS[1], ARGV[1], ARGV[2]
local njobs = tonumber(ARGV[3])
local p = 4
local jobs = {}
for j = 1, njobs do
  local job = {key = KEYS[1 + (j - 1) * 3 + 1], done = KEYS[1 + (j - 1) * 3 + 2],
               parts = KEYS[1 + (j - 1) * 3 + 3], id = ARGV[p], part = ARGV[p + 1],
               meta = ARGV[p + 2], lost = {}, d = 0, f = 0, pt = 0, ct = 0, cc = 0}
  job.status = job_status(job.key)
  if job.status == 'live' and redis.call('HEXISTS', job.parts, job.part) == 1 then
    job.status = 'again'
  end
  jobs[j] = job
  p = p + 3
end
local ids = {}
local nrows = tonumber(ARGV[p])
p = p + 1
for r = 1, nrows do
  local job = jobs[tonumber(ARGV[p])]
  ids[#ids + 1] = ARGV[p + 2]
  if job.status == 'live' then
    if redis.call('SETBIT', job.done, ARGV[p + 1], 1) == 0 then
      if ARGV[p + 3] == '1' then job.f = job.f + 1 else job.d = job.d + 1 end
      job.pt = job.pt + tonumber(ARGV[p + 4])
      job.ct = job.ct + tonumber(ARGV[p + 5])
      job.cc = job.cc + tonumber(ARGV[p + 6])
    else
      job.lost[#job.lost + 1] = tonumber(ARGV[p + 1])
    end
  end
  p = p + 7
end
local ndrop = tonumber(ARGV[p])
for k = 1, ndrop do ids[#ids + 1] = ARGV[p + k] end
if #ids > 0 then ack_and_delete(stream, group, ids) end
local out = {finished = {}, missing = {}, closed = {}, again = {}, lost = 0}
for j = 1, njobs do
  local job = jobs[j]
  if job.status == 'live' then
    local record = cjson.decode(job.meta)
    record.lost = job.lost
    redis.call('HSET', job.parts, job.part, cjson.encode(record))
    out.lost = out.lost + #job.lost
    if bump(job.key, job.d, job.f, job.pt, job.ct, job.cc, now) then
      out.finished[#out.finished + 1] = job.id
    end
  else
    local list = out[job.status]
    list[#list + 1] = job.id
  end
end
return cjson.encode(out)
"""
)


@dataclass(slots=True)
class PartCommit:
    """One published part of one job, and the stream entries its rows came from."""

    job_id: str
    name: str  # relative to the job's output dir, e.g. "parts/w1-000003-ab12.parquet"
    rows: list[Row]
    entry_ids: list[str]


@dataclass(slots=True)
class CommitResult:
    finished: list[str] = field(default_factory=list)  # jobs that now need finalize
    missing: list[str] = field(default_factory=list)  # jobs whose record is gone
    closed: list[str] = field(default_factory=list)  # already finalized: rows discarded
    again: list[str] = field(default_factory=list)  # part was committed before
    lost: int = 0  # rows that lost to an earlier committed row


def commit(
    conn: redis.Redis,
    qk: QueueKeys,
    parts: list[PartCommit],
    drop_ids: list[str] = (),  # type: ignore[assignment]
) -> CommitResult:
    """Commit ``parts`` and ack+delete ``drop_ids`` (entries with no row to keep)."""
    keys: list[str] = [qk.stream]
    args: list[str | int] = [GROUP, repr(time.time()), len(parts)]
    row_args: list[str | int] = []
    for ordinal, part in enumerate(parts, start=1):
        jk = qk.job(part.job_id)
        keys += [jk.job, jk.done, jk.parts]
        indices = [row.index for row in part.rows]
        meta = {"rows": len(indices), "lo": min(indices, default=0), "hi": max(indices, default=0)}
        args += [part.job_id, part.name, json.dumps(meta)]
        for row, entry_id in zip(part.rows, part.entry_ids, strict=True):
            row_args += [
                ordinal,
                row.index,
                entry_id,
                1 if row.failed else 0,
                row.prompt_tokens,
                row.completion_tokens,
                row.cached_tokens,
            ]
    args += [len(row_args) // 7, *row_args, len(drop_ids), *drop_ids]
    raw = conn.register_script(_COMMIT)(keys=keys, args=args)
    data = json.loads(raw)
    return CommitResult(
        finished=_list(data["finished"]),
        missing=_list(data["missing"]),
        closed=_list(data["closed"]),
        again=_list(data["again"]),
        lost=int(data["lost"]),
    )


def _list(value: object) -> list[str]:
    # cjson encodes an empty Lua table as {}.
    return list(value) if isinstance(value, list) else []
