"""The commit step: published parts become committed rows, in ONE atomic Lua step.

For every row: SETBIT on the job's done-mark bitmap (the old bit says whether a
row for that input was committed before: first commit wins), counters bumped
for winners only; the part's commit record lists the indices it lost (usually
none), so finalize knows which row of which part is the winner. The stream
entries are XACKed and XDELed in the same step, so the stream never grows
without bound and a crash leaves either everything or nothing done. A job that
has every row moves to ``finalizing`` here, exactly once.

All keys share the queue's hash tag (jobs/redis/keys.py), so this runs on Redis Cluster.
Through Sentinel a commit then waits for one replica (jobs/redis/sentinel.py).

The same step adds what the winning rows used to the job's and its tenant's usage
(input, cached input and output tokens, engine time): usage is counted exactly
once, like the rows. A failed row (error, cancelled) is not billed, as OpenAI
bills no failed request: its input tokens are counted apart (the job's
``failed_prompt_tokens``, the tenant's ``failed_input_tokens``), its engine time
is counted as any row's.

Idempotent: a part already recorded is not counted again (a retried commit
after a lost reply only acks); a closed (finalized) or missing job's rows are
discarded and their entries acked.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import redis

from batchgen.jobs.ops.lifecycle import script
from batchgen.jobs.redis.keys import GROUP, QueueKeys
from batchgen.jobs.redis.lua import ACK_AND_DELETE
from batchgen.jobs.redis.sentinel import replicated
from batchgen.jobs.schema.rows import Row, cached_input_tokens

# Lua: what a job's newly committed rows used, on the job and on its tenant's counters of
# this model (``TENANT|counter``); their estimated cost, to the fleet's committed work.
USAGE = """
local function charge_usage(job, usage, fair, rows, input, cached, output, engine_us, failed_in)
  if rows == 0 then return end
  local v = redis.call('HMGET', job, 'tenant', 'cost')
  local t = (v[1] or '') .. '|'
  if engine_us > 0 then redis.call('HINCRBY', job, 'engine_us', engine_us) end
  redis.call('HINCRBY', usage, t .. 'requests', rows)
  if input > 0 then redis.call('HINCRBY', usage, t .. 'input_tokens', input) end
  if cached > 0 then redis.call('HINCRBY', usage, t .. 'cached_tokens', cached) end
  if output > 0 then redis.call('HINCRBY', usage, t .. 'output_tokens', output) end
  if engine_us > 0 then redis.call('HINCRBY', usage, t .. 'engine_us', engine_us) end
  if failed_in > 0 then
    redis.call('HINCRBY', job, 'failed_prompt_tokens', failed_in)
    redis.call('HINCRBY', usage, t .. 'failed_input_tokens', failed_in)
  end
  redis.call('HINCRBYFLOAT', fair, 'work', rows * math.max(tonumber(v[2] or '1'), 1))
end
"""


COMMIT = script(
    "commit parts",
    keys=[
        ("stream", "the model's request stream"),
        ("usage", "the model's usage per tenant"),
        ("fair", "the model's fair-share state (its committed work: the fleet's rate)"),
        ("*touched", "every job key the payload names (one hash slot)"),
    ],
    args=[
        ("group", "the consumer group"),
        ("now", "unix seconds"),
        (
            "payload",
            "JSON: {parts: [part], drop: [entry id]}; part: {job_id, record, done, "
            "parts, name, meta, started, rows: {index, entry, failed, pt, ct, cc, eu, rt} as "
            "columns}",
        ),
    ],
    prelude=ACK_AND_DELETE + USAGE,
    body="""
local p = cjson.decode(payload)
local out = {finished = {}, missing = {}, closed = {}, again = {}, lost = 0}
local ids = {}
for _, part in ipairs(p.parts) do
  local status = job_status(part.record)
  if status == 'live' and redis.call('HEXISTS', part.parts, part.name) == 1 then
    status = 'again'  -- a retried commit after a lost reply: only ack
  end
  local rows, lost = part.rows, {}
  local d, f, pt, ct, cc, eu, fpt, rt = 0, 0, 0, 0, 0, 0, 0, 0
  for r = 1, #rows.index do
    ids[#ids + 1] = rows.entry[r]
    if status == 'live' then
      if redis.call('SETBIT', part.done, rows.index[r], 1) == 0 then  -- first row wins
        if rows.failed[r] == 1 then  -- not billed: its input tokens counted apart
          f, fpt = f + 1, fpt + rows.pt[r]
        else
          d, pt, ct, cc = d + 1, pt + rows.pt[r], ct + rows.ct[r], cc + rows.cc[r]
          rt = rt + rows.rt[r]
        end
        eu = eu + rows.eu[r]
      else
        lost[#lost + 1] = rows.index[r]
      end
    end
  end
  if status == 'live' then
    local meta = cjson.decode(part.meta)
    meta.lost = lost
    redis.call('HSET', part.parts, part.name, cjson.encode(meta))
    out.lost = out.lost + #lost
    if rt > 0 then redis.call('HINCRBY', part.record, 'reasoning_tokens', rt) end
    if bump(part.record, d, f, pt, ct, cc, now, part.started) then
      out.finished[#out.finished + 1] = part.job_id
    end
    charge_usage(part.record, usage, fair, d + f, pt, cc, ct, eu, fpt)
  else
    out[status][#out[status] + 1] = part.job_id
  end
end
for _, id in ipairs(p.drop) do ids[#ids + 1] = id end
ack_and_delete(stream, group, ids)
return cjson.encode(out)
""",
)


@dataclass(slots=True)
class PartCommit:
    """One published part of one job, and the stream entries its rows came from."""

    job_id: str
    name: str  # relative to the job's output dir, e.g. "parts/w1-000003-ab12.parquet"
    rows: list[Row]
    entry_ids: list[str]
    nbytes: int = 0  # the rows' size in memory (Arrow): finalize plans its windows by it
    started: float = 0.0  # unix s the worker read the first of them (0: unknown, now)
    engine_us: list[int] = field(default_factory=list)  # each row's share of engine time


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
    touched: list[str] = []
    payload: dict[str, list] = {"parts": [], "drop": list(drop_ids)}
    for part in parts:
        jk = qk.job(part.job_id)
        touched += [jk.job, jk.done, jk.parts]
        indices = [row.index for row in part.rows]
        meta = {
            "rows": len(indices),
            "lo": min(indices, default=0),
            "hi": max(indices, default=0),
            "bytes": part.nbytes,
        }
        rows = part.rows
        payload["parts"].append({
            "job_id": part.job_id, "record": jk.job, "done": jk.done, "parts": jk.parts,
            "name": part.name, "meta": json.dumps(meta), "started": part.started,
            "rows": {
                "index": indices, "entry": list(part.entry_ids),
                "failed": [1 if r.failed else 0 for r in rows],
                "pt": [r.prompt_tokens for r in rows], "ct": [r.completion_tokens for r in rows],
                "cc": [cached_input_tokens(r) for r in rows],
                "rt": [r.reasoning_tokens or 0 for r in rows],
                "eu": part.engine_us or [0] * len(rows),
            },
        })  # fmt: skip
    raw = COMMIT(
        conn, stream=qk.stream, usage=qk.usage, fair=qk.fair, touched=touched, group=GROUP,
        now=repr(time.time()),
        payload=json.dumps(payload, separators=(",", ":")),
    )  # fmt: skip
    data = json.loads(raw)
    replicated(conn)  # through Sentinel: on a replica before the worker moves on
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
