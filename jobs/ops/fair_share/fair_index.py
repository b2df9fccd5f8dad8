"""The fair-share index: sorted sets that keep the model's ready jobs in dispatch order,
so that choosing the next job costs O(log jobs), not a look at every ready job.

Per model (keys.py), in the classic weighted fair queueing shape:

- ``classes``: the priority classes with ready jobs (score: minus the class, so the
  highest class is first);
- ``tenants:C``: the tenants with ready jobs in class C, by virtual time (the tokens
  charged to the tenant over its weight; ``t:TENANT`` in the fair hash);
- ``jobs:C:T``: tenant T's ready jobs in class C, by virtual time (tokens charged to
  the job; its record's ``vtime``);
- ``deadlines``: unfinished jobs with a deadline, by deadline (the deadline check
  visits them in turns); ``expiry``: those that asked to be cancelled at it;
  ``urgent:C``: class C's jobs at risk of missing theirs, by deadline (EDF).

A job enters when requests are appended to its backlog (``fx_enter``, from submit's
and retry's backlog push): its class, its tenant at ``max(tenant's virtual time,
the model's clock)`` and itself at ``max(its virtual time, the tenant's job clock)``,
so idle time is no credit. Nothing else adds to the index. A job leaves it
(``fx_leave``) when dispatch empties its backlog and when it is cancelled; otherwise
leaving is lazy: dispatch and the deadline check look at a member's record when it
comes first, and drop a job that is finished, deleted or out of backlog (and a tenant
or class left without jobs); every dropped member costs O(log jobs) once. A tenant's score can lag
its virtual time (charged in another class meanwhile): dispatch corrects it when the
tenant comes first. ``leave`` takes a deleted job out of every set. Scores go through ``fx_num`` (17 digits) wherever they are written,
so a score and the fair hash's copy compare exactly.
"""

from __future__ import annotations

import redis

from batchgen.jobs.redis.keys import QueueKeys
from batchgen.jobs.redis.lua import LuaScript

FAIR_INDEX = """
local function fx_num(x) return string.format('%.17g', x) end
local function fx_enter(base, job, job_id)
  local v = redis.call('HMGET', job, 'priority', 'tenant', 'vtime', 'deadline', 'expire')
  local c, t = v[1] or '0', v[2] or ''
  local f = redis.call('HMGET', base .. 'fair', 'clock', 't:' .. t, 'c:' .. t)
  redis.call('ZADD', base .. 'classes', -tonumber(c), c)
  redis.call('ZADD', base .. 'tenants:' .. c,
             fx_num(math.max(tonumber(f[1] or '0'), tonumber(f[2] or '0'))), t)
  redis.call('ZADD', base .. 'jobs:' .. c .. ':' .. t,
             fx_num(math.max(tonumber(v[3] or '0'), tonumber(f[3] or '0'))), job_id)
  local deadline = tonumber(v[4] or '0')
  if deadline > 0 then
    redis.call('ZADD', base .. 'deadlines', fx_num(deadline), job_id)
    if v[5] == '1' then redis.call('ZADD', base .. 'expiry', fx_num(deadline), job_id) end
  end
end
-- out of class c's dispatch order, with its tenant and class once they are left empty
local function fx_leave(base, job_id, c, t)
  local jobs, tenants = base .. 'jobs:' .. c .. ':' .. t, base .. 'tenants:' .. c
  redis.call('ZREM', jobs, job_id)
  redis.call('ZREM', base .. 'urgent:' .. c, job_id)
  if redis.call('EXISTS', jobs) == 0 then redis.call('ZREM', tenants, t) end
  if redis.call('EXISTS', tenants) == 0 then redis.call('ZREM', base .. 'classes', c) end
end
"""

# a deleted job leaves every part of the index at once (its record still there)
LEAVE = LuaScript.define(
    "leave fair index",
    keys=[("job", "the job record"), ("ready", "the model's jobs with a backlog")],
    args=[("job_id", "")],
    prelude=FAIR_INDEX,
    body="""
local base = string.sub(ready, 1, #ready - 5)  -- ready is P:{TAG}:ready
local v = redis.call('HMGET', job, 'priority', 'tenant')
fx_leave(base, job_id, v[1] or '0', v[2] or '')
redis.call('ZREM', base .. 'deadlines', job_id)
redis.call('ZREM', base .. 'expiry', job_id)
redis.call('SREM', ready, job_id)
""",
)


def leave(conn: redis.Redis, qk: QueueKeys, job_id: str) -> None:
    """Take a job out of the model's dispatch order and deadline sets (delete)."""
    LEAVE(conn, job=qk.job(job_id).job, ready=qk.ready, job_id=job_id)
