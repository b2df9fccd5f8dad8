"""Deadlines: which jobs would miss theirs at their fair share, served first within
bounds, and ETAs.

Every worker runs ``check`` about once a second (at most one run a second per
model does the work); one script, on the model's keys, O(CHECK_BATCH x log jobs)
however many jobs wait:

1. the fleet's rate: the model's committed work (each committed row adds its job's
   estimated cost in tokens, worker/consumer/commit.py) per second, a moving average over ~30 s;
2. the next ``CHECK_BATCH`` unfinished jobs with a deadline (fair_index.py's
   ``deadlines``, in turns: each job is looked at every jobs / CHECK_BATCH runs):
   its fair share ``s`` (nothing while a higher priority class has work; else its
   tenant's weight over the weights of the tenants with work in its class, split
   among the tenant's jobs there), and the time its remaining work takes:

   - it fits at ``s``: on track (``eta`` at its share);
   - it fits only at ``URGENT_SHARE`` of the model: ``urgent``, at risk; dispatch
     serves the class's at-risk jobs first, earliest deadline first, but with at most
     ``URGENT_SHARE`` of the tokens together, and never ahead of a higher class
     (worker/consumer/dispatch.py); ``eta`` at that share;
   - it does not fit even then (or its class has no share now): ``late``; it goes
     on at its fair share and takes nothing from the others (``eta`` at its share);
3. jobs past their deadline that asked to ``expire`` are returned (``expiry``, by
   deadline), and cancelled (finished rows kept, the rest cancelled rows). A job
   from ``batchgen serve`` expires at its batch's ``expires_at`` by serve's own sweep
   (as OpenAI's do); a CLI job without ``--expire`` keeps running and ``status``
   reports it late.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime
from typing import Any

import redis

from batchgen.jobs.ops.cancellation import cancel
from batchgen.jobs.ops.fair_share.fair_index import FAIR_INDEX
from batchgen.jobs.ops.job_record import JobRecord
from batchgen.jobs.ops.lifecycle import script
from batchgen.jobs.redis.keys import Keys, QueueKeys, text
from batchgen.jobs.schema.errors import JobConflict, JobNotFound

log = logging.getLogger(__name__)

RATE_TAU_S = 30.0  # the rate's moving average forgets over about this long
URGENT_SHARE = 0.5  # the most of a model's tokens its at-risk jobs take together
CHECK_BATCH = 100  # deadline jobs a check looks at: all of them in turns of this many

CHECK = script(
    "deadlines",
    keys=[
        ("fair", "the model's fair-share state: committed work, the rate"),
        ("ready", "the model's jobs with a backlog"),
    ],
    args=[
        ("now", "unix s"),
        ("tau", "the rate average's time constant, s"),
        ("urgent_share", "the most of the model urgent jobs take"),
        ("batch", "deadline jobs looked at in one run"),
    ],
    prelude=FAIR_INDEX,
    body="""
local t = tonumber(now)
local f = redis.call('HMGET', fair, 'checked_at', 'work', 'rate', 'rate_at', 'rate_work',
                     'deadline_cursor')
if t - tonumber(f[1] or '0') < 0.5 then return {} end  -- another worker just did it
redis.call('HSET', fair, 'checked_at', t)
local work, rate = tonumber(f[2] or '0'), tonumber(f[3] or '0')
local at, was = tonumber(f[4] or '0'), tonumber(f[5] or '0')
if at == 0 then
  redis.call('HSET', fair, 'rate_at', t, 'rate_work', work)
elseif t - at >= 1 then
  local inst = (work - was) / (t - at)
  if inst > 0 or redis.call('SCARD', ready) > 0 then  -- an idle fleet keeps the rate it last had
    if rate > 0 then rate = rate + (1 - math.exp(-(t - at) / tonumber(tau))) * (inst - rate)
    else rate = inst end
  end
  redis.call('HSET', fair, 'rate', rate, 'rate_at', t, 'rate_work', work)
end
local base = string.sub(fair, 1, #fair - 4)  -- 'P:{TAG}:'
local n, share_cap = tonumber(batch), tonumber(urgent_share)
local function active(state) return state == S.QUEUED or state == S.RUNNING end

-- jobs past the deadline they asked to expire at (they leave once cancelled)
local expired = {}
for _, id in ipairs(redis.call('ZRANGEBYSCORE', base .. 'expiry', '-inf', t, 'LIMIT', 0, n)) do
  if active(redis.call('HGET', base .. 'job:' .. id, 'state')) then expired[#expired + 1] = id
  else redis.call('ZREM', base .. 'expiry', id) end
end

-- the next `batch` deadline jobs, in turns: each one's fair share, and where it stands
local top = redis.call('ZRANGE', base .. 'classes', 0, 0)[1]
top = top and tonumber(top)
local weights = {}
local function weight(tenant)
  if not weights[tenant] then weights[tenant] = tonumber(redis.call('HGET', fair, 'w:' .. tenant) or '1') end
  return weights[tenant]
end
local class_weight = {}  -- the weights of the tenants with ready jobs in a class, summed
local function total_weight(c)
  if not class_weight[c] then
    local sum = 0
    for _, tenant in ipairs(redis.call('ZRANGE', base .. 'tenants:' .. c, 0, -1)) do
      sum = sum + weight(tenant)
    end
    class_weight[c] = sum
  end
  return class_weight[c]
end
local deadlines = base .. 'deadlines'
local from, total = tonumber(f[6] or '0'), redis.call('ZCARD', deadlines)
if from >= total or total <= n then from = 0 end
local turn = redis.call('ZRANGE', deadlines, from, from + n - 1)
local after = from + #turn
if #turn < n and from > 0 then  -- wrap around to the first ones
  after = math.min(n - #turn, from)
  for _, id in ipairs(redis.call('ZRANGE', deadlines, 0, after - 1)) do turn[#turn + 1] = id end
end
redis.call('HSET', fair, 'deadline_cursor', after)
for _, id in ipairs(turn) do
  local key = base .. 'job:' .. id
  local v = redis.call('HMGET', key, 'state', 'priority', 'tenant', 'deadline', 'total', 'done',
                       'failed', 'cost')
  local c, tenant, deadline = v[2] or '0', v[3] or '', tonumber(v[4] or '0')
  local urgent = base .. 'urgent:' .. c
  if not active(v[1]) then
    redis.call('ZREM', deadlines, id)
    redis.call('ZREM', urgent, id)
  elseif rate > 0 then
    local left = (tonumber(v[5] or '0') - tonumber(v[6] or '0') - tonumber(v[7] or '0'))
                 * math.max(tonumber(v[8] or '1'), 1)
    local s = 0  -- its fair share: none while a higher class has work
    if not top or tonumber(c) >= top then
      local jobs = base .. 'jobs:' .. c .. ':' .. tenant
      local total = total_weight(c)
      if not redis.call('ZSCORE', base .. 'tenants:' .. c, tenant) then total = total + weight(tenant) end
      local mine = redis.call('ZCARD', jobs)
      if not redis.call('ZSCORE', jobs, id) then mine = mine + 1 end
      s = weight(tenant) / total / mine
    end
    local fair_eta = s > 0 and t + left / (rate * s) or 0
    if s > 0 and fair_eta <= deadline then  -- on track at its share
      redis.call('HSET', key, 'urgent', '0', 'late', '0', 'eta', fair_eta)
      redis.call('ZREM', urgent, id)
    elseif s > 0 and t + left / (rate * math.max(s, share_cap)) <= deadline then  -- at risk
      redis.call('HSET', key, 'urgent', '1', 'late', '0', 'eta', t + left / (rate * math.max(s, share_cap)))
      redis.call('ZADD', urgent, fx_num(deadline), id)
    else  -- it cannot make it at any share it may take: back to its fair share
      redis.call('HSET', key, 'urgent', '0', 'late', '1', 'eta', fair_eta)
      redis.call('ZREM', urgent, id)
    end
  end
end
return expired
""",
)


def check(conn: redis.Redis, keys: Keys, qk: QueueKeys, now: float | None = None) -> list[str]:
    """Mark the model's jobs that need to go first, set their ETAs, and cancel the ones
    past a deadline they asked to expire at; the cancelled job ids."""
    now = time.time() if now is None else now
    expired = [text(i) for i in CHECK(conn, fair=qk.fair, ready=qk.ready, now=repr(now),
                                      tau=RATE_TAU_S, urgent_share=URGENT_SHARE,
                                      batch=CHECK_BATCH)]  # fmt: skip
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
    elif now > record.deadline or record.late:
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
    if view["state"] == "late" and view["eta"] and view["eta"] > view["deadline"]:
        line += " (it cannot make it at any share it may take: served at its fair share)"
    if view["state"] == "late":
        line += (
            "; cancelled at the deadline"
            if view["expire"]
            else ("; it keeps running (submitted without --expire)")
        )
    return line
