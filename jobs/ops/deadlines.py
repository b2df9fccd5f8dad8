"""Deadlines: which jobs would miss theirs at their fair share, served first, and ETAs.

Every worker runs ``check`` about once a second (at most one run a second per
model does the work); one script, on the model's keys:

1. the fleet's rate: the model's committed work (each committed row adds its job's
   estimated cost in tokens, commit.py) per second, a moving average over ~30 s;
2. each unfinished job with a deadline: its fair share (nothing while a higher
   priority class has work; else its tenant's weight over the weights of the
   tenants with work in its class, split among the tenant's jobs there), and the
   time its remaining work takes at that share. A job that would finish after its
   deadline is ``urgent``: dispatch serves urgent jobs first, earliest deadline
   first (dispatch.py), until the estimate says it fits its share again. Its
   ``eta`` is where it stands in that order; another's is at its share;
3. jobs past their deadline that asked to ``expire`` are returned, and cancelled
   (finished rows kept, the rest cancelled rows). A job from ``batchgen serve``
   expires at its batch's ``expires_at`` by serve's own sweep (as OpenAI's do); a
   CLI job without ``--expire`` keeps running and ``status`` reports it late.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime
from typing import Any

import redis

from batchgen.jobs.ops.cancellation import cancel
from batchgen.jobs.ops.job_record import JobRecord
from batchgen.jobs.ops.lifecycle import script
from batchgen.jobs.redis.keys import Keys, QueueKeys, text
from batchgen.jobs.schema.errors import JobConflict, JobNotFound

log = logging.getLogger(__name__)

RATE_TAU_S = 30.0  # the rate's moving average forgets over about this long

CHECK = script(
    "deadlines",
    keys=[
        ("fair", "the model's fair-share state: committed work, the rate"),
        ("ready", "the model's jobs with a backlog"),
        ("active", "the model's unfinished jobs"),
    ],
    args=[("now", "unix s"), ("tau", "the rate average's time constant, s")],
    body="""
local t = tonumber(now)
local f = redis.call('HMGET', fair, 'checked_at', 'work', 'rate', 'rate_at', 'rate_work')
if t - tonumber(f[1] or '0') < 0.5 then return {} end  -- another worker just did it
redis.call('HSET', fair, 'checked_at', t)
local work, rate = tonumber(f[2] or '0'), tonumber(f[3] or '0')
local at, was = tonumber(f[4] or '0'), tonumber(f[5] or '0')
local ready_ids = redis.call('SMEMBERS', ready)
if at == 0 then
  redis.call('HSET', fair, 'rate_at', t, 'rate_work', work)
elseif t - at >= 1 then
  local inst = (work - was) / (t - at)
  if inst > 0 or #ready_ids > 0 then  -- an idle fleet keeps the rate it last had
    if rate > 0 then rate = rate + (1 - math.exp(-(t - at) / tonumber(tau))) * (inst - rate)
    else rate = inst end
  end
  redis.call('HSET', fair, 'rate', rate, 'rate_at', t, 'rate_work', work)
end
local base = string.sub(fair, 1, #fair - 4)  -- 'P:{TAG}:'
local function job_of(id)
  local v = redis.call('HMGET', base .. 'job:' .. id, 'state', 'priority', 'tenant', 'deadline',
                       'total', 'done', 'failed', 'cost', 'expire')
  return {id = id, key = base .. 'job:' .. id, state = v[1], priority = tonumber(v[2] or '0'),
    tenant = v[3] or '', deadline = tonumber(v[4] or '0'),
    left = (tonumber(v[5] or '0') - tonumber(v[6] or '0') - tonumber(v[7] or '0'))
           * math.max(tonumber(v[8] or '1'), 1), expire = v[9] == '1'}
end
-- who competes: the ready jobs by class and tenant
local top, in_class = nil, {}
local readyset = {}
for _, id in ipairs(ready_ids) do
  local j = job_of(id)
  readyset[id] = j
  if not top or j.priority > top then top = j.priority end
end
local function weight(tenant) return tonumber(redis.call('HGET', fair, 'w:' .. tenant) or '1') end
local function share(j)
  if top and j.priority < top then return 0 end
  local tenants, total_w, mine = {}, 0, readyset[j.id] and 0 or 1
  for _, r in pairs(readyset) do
    if r.priority == j.priority then
      if not tenants[r.tenant] then tenants[r.tenant] = true; total_w = total_w + weight(r.tenant) end
      if r.tenant == j.tenant then mine = mine + 1 end
    end
  end
  if not tenants[j.tenant] then total_w = total_w + weight(j.tenant) end
  return weight(j.tenant) / total_w / mine
end
local expired, urgent = {}, {}
for _, id in ipairs(redis.call('SMEMBERS', active)) do
  local j = readyset[id] or job_of(id)
  if (j.state == S.QUEUED or j.state == S.RUNNING) and j.deadline > 0 then
    if j.expire and t >= j.deadline then expired[#expired + 1] = id end
    local s = share(j)
    local late = rate > 0 and (s == 0 or t + j.left / (rate * s) > j.deadline)
    if late then
      urgent[#urgent + 1] = j
    else
      local eta = (rate > 0) and (t + j.left / (rate * s)) or 0
      redis.call('HSET', j.key, 'urgent', '0', 'eta', eta)
    end
  end
end
table.sort(urgent, function(a, b) return a.deadline < b.deadline end)
local ahead = 0
for _, j in ipairs(urgent) do
  ahead = ahead + j.left
  redis.call('HSET', j.key, 'urgent', '1', 'eta', t + ahead / rate)
end
return expired
""",
)


def check(conn: redis.Redis, keys: Keys, qk: QueueKeys, now: float | None = None) -> list[str]:
    """Mark the model's jobs that need to go first, set their ETAs, and cancel the ones
    past a deadline they asked to expire at; the cancelled job ids."""
    now = time.time() if now is None else now
    expired = [text(i) for i in CHECK(conn, fair=qk.fair, ready=qk.ready, active=qk.active,
                                      now=repr(now), tau=RATE_TAU_S)]  # fmt: skip
    done = []
    for job_id in expired:
        try:
            cancel(conn, keys, job_id)
        except (JobConflict, JobNotFound):
            continue  # finished or gone meanwhile
        log.warning("job %s passed its deadline and was submitted with --expire: cancelled", job_id)
        done.append(job_id)
    return done


def deadline_view(record: JobRecord, now: float) -> dict[str, Any] | None:
    """Where a job stands against its deadline, for status: {deadline, state, eta,
    expire}; state is on_track, at_risk (it would miss it at its fair share: served
    first), late (past it), unknown (no rate measured yet), met or missed."""
    if not record.deadline:
        return None
    eta = record.eta or None
    if record.state.terminal or record.state.needs_finalize:
        end = record.finished_at or now
        state = "met" if end <= record.deadline and record.state.value == "completed" else "missed"
        eta = None
    elif now > record.deadline:
        state = "late"
    elif record.urgent:
        state = "at_risk"
    elif eta is None:
        state = "unknown"
    else:
        state = "on_track"
    return {"deadline": record.deadline, "state": state, "eta": eta, "expire": record.expire}


def describe(view: dict[str, Any]) -> str:
    """One line for ``batchgen status``."""

    def at(t: float) -> str:
        return datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds")

    words = {"on_track": "on track", "at_risk": "at risk: served first (earliest deadline)",
             "late": "late", "unknown": "no rate measured yet", "met": "met",
             "missed": "missed"}  # fmt: skip
    line = f"{at(view['deadline'])}: {words[view['state']]}"
    if view["eta"]:
        line += f", ETA {at(view['eta'])}"
    if view["state"] == "late":
        line += (
            "; cancelled at the deadline"
            if view["expire"]
            else ("; it keeps running (submitted without --expire)")
        )
    return line
