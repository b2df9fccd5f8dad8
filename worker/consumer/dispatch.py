"""The dispatch script: which requests a worker with room takes next, in one atomic step.

A worker asks for as many requests as its engine can admit. The script first
reads the stream (XREADGROUP ``>``): entries handed back with their tokens go
first, since work already begun is never set aside. It fills the rest from the backlogs of the
model's ready jobs (jobs/ops/fair_share/backlog.py), ``QUANTUM`` requests at a time from the job that
comes first in this order, kept in sorted sets (jobs/ops/fair_share/fair_index.py):

1. the highest priority class with ready jobs;
2. within it, its at-risk jobs (jobs/ops/fair_share/deadlines.py: they would miss their deadline at their
   fair share), earliest deadline first, as long as urgent picks have taken at most
   ``urgent_share`` of the tokens (``urgent_debt`` in the fair hash: an urgent pick
   adds its tokens, a fair pick pays them back at share / (1 - share) a token);
3. else the tenant with the smallest virtual time (tokens charged / its weight);
4. within the tenant, the job with the smallest virtual time (tokens charged).

Each request moved is charged its job's estimated cost (tokens: input estimate
and max_tokens), so shares are shares of tokens, not of requests; an urgent job's
tokens count against its own and its tenant's virtual time too. A tenant or job
that had no work gets its virtual time raised to the clock (the smallest charged
when last picked) before it competes, so idle time is not credit to spend later;
the clocks start again from 0 once no job has a backlog (fair_clock.py).
Within the chosen job the worker takes its own prefix groups first
(worker/loop/affinity.py), in input order across them, and takes from the fullest
other group only when those are empty: affinity reorders a job's requests, never
the jobs' shares, and no worker waits while any backlog holds work. A lone worker
owns every group, so it takes a job's requests in input order, as before backlogs.

The moved requests are XADDed to the stream (``j i r q``, or ``j i r x`` for a
retried request, whose backlog item carries its earlier deliveries: jobs/schema/entry.py) and
read by this worker in the same script, so from there on everything is as before:
the entry is pending at the worker (refresh, reclaim, hand-back, dead-letter and
commit unchanged). Redis per call: one XREADGROUP, per job taken from a few ZRANGEs
(class, tenant, job: O(log jobs)), an HMGET of its record, a LINDEX per own group and
two ZADDs, then per request an LPOP, a LINDEX (the merge in input order), an XADD
and the final XREADGROUP's share. A finished, cancelled or deleted job that comes
first leaves the index then, once.

A queued job whose first requests a worker takes here becomes ``running`` (its
``started_at`` then): status shows it running while those requests generate, not
only once a first row commits, which for long generations is minutes later.

The index's keys are built from the stream's (same hash tag, so the same slot:
Redis Cluster runs it on the model's shard).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import redis

from batchgen.jobs.ops.fair_share.deadlines import URGENT_SHARE
from batchgen.jobs.ops.fair_share.fair_index import FAIR_INDEX
from batchgen.jobs.ops.lifecycle import script
from batchgen.jobs.redis.keys import BACKLOG_GROUPS, GROUP, QueueKeys
from batchgen.jobs.schema.entry import LUA_FIELDS
from batchgen.worker.consumer.fair_clock import REST_FAIR_CLOCKS

QUANTUM = 16  # requests taken from the chosen job before the order is looked at again

DISPATCH = script(
    "dispatch",
    keys=[
        ("stream", "the model's request stream"),
        ("ready", "the model's jobs with a backlog"),
        ("fair", "the model's fair-share clocks and tenant weights"),
    ],
    args=[
        ("group", ""),
        ("me", "this consumer"),
        ("count", "requests this worker can admit now"),
        ("groups", "this worker's prefix groups, comma-separated, in order; '*': all"),
        ("urgent_share", "the most of the model's tokens urgent jobs take (deadlines.py)"),
        ("now", "unix s: a queued job whose requests this read takes is running from then"),
    ],
    prelude=LUA_FIELDS + FAIR_INDEX + REST_FAIR_CLOCKS,
    body=f"""
-- replies go back as one JSON string: Redis turns a Lua table of entries into a reply
-- several times slower than cjson encodes it
local out = {{}}
local n = tonumber(count)
local first = redis.call('XREADGROUP', 'GROUP', group, me, 'COUNT', n, 'STREAMS', stream, '>')
if first then for _, e in ipairs(first[1][2]) do out[#out + 1] = e end end
if #out >= n then return cjson.encode(out) end
local base = string.sub(stream, 1, #stream - 6)  -- 'P:{{TAG}}:' (the stream is P:{{TAG}}:stream)
local classes = base .. 'classes'
if redis.call('SCARD', ready) == 0 then rest_fair_clocks(fair); return cjson.encode(out) end  -- fair_clock.py
local mine, own = {{}}, {{}}
if groups == '*' then groups = '{",".join(str(g) for g in range(BACKLOG_GROUPS))}' end
for g in string.gmatch(groups, '%d+') do mine[#mine + 1] = g; own[g] = true end
local f = redis.call('HMGET', fair, 'clock', 'urgent_debt')
local clock, debt = tonumber(f[1] or '0'), tonumber(f[2] or '0')
local share = tonumber(urgent_share)
local tv, weight, jclock = {{}}, {{}}, {{}}
local function tenant(t)
  if tv[t] == nil then
    local v = redis.call('HMGET', fair, 't:' .. t, 'w:' .. t, 'c:' .. t)
    tv[t], weight[t], jclock[t] = tonumber(v[1] or '0'), tonumber(v[2] or '1'), tonumber(v[3] or '0')
  end
end

-- a job dispatch can take from: its record's fields, else nil
local function live(id)
  local v = redis.call('HMGET', base .. 'job:' .. id, 'state', 'closed', 'backlog', 'vtime', 'cost',
                       'urgent', 'tenant')
  if (v[1] ~= S.QUEUED and v[1] ~= S.RUNNING) or v[2] == '1' or tonumber(v[3] or '0') <= 0 then
    return nil
  end
  return v
end
local function drop(id, c, t)  -- out of the index and the ready set
  fx_leave(base, id, c, t)
  redis.call('SREM', ready, id)
end

-- the next job to take from: the top class's earliest-deadline urgent job while urgent
-- picks are within their share, else the class's tenant and job of least virtual time
local function next_job()
  while true do
    local c = redis.call('ZRANGE', classes, 0, 0)[1]
    if not c then return nil end
    local tenants = base .. 'tenants:' .. c
    local u = debt <= 0 and redis.call('ZRANGE', base .. 'urgent:' .. c, 0, 0)[1]
    local picked = false
    if u then
      local v = live(u)
      if v and v[6] == '1' then
        tenant(v[7] or '')
        return {{id = u, class = c, state = v[1], tenant = v[7] or '', urgent = true, vtime = tonumber(v[4] or '0'),
                cost = math.max(tonumber(v[5] or '1'), 1)}}
      end
      redis.call('ZREM', base .. 'urgent:' .. c, u)
      picked = true  -- look again
    end
    if not picked then
      local head = redis.call('ZRANGE', tenants, 0, 0, 'WITHSCORES')
      if #head == 0 then
        redis.call('ZREM', classes, c)
      else
        local t, score = head[1], tonumber(head[2])
        tenant(t)
        if tv[t] > score then
          redis.call('ZADD', tenants, fx_num(tv[t]), t)  -- charged in another class meanwhile
        else
          local id = redis.call('ZRANGE', base .. 'jobs:' .. c .. ':' .. t, 0, 0)[1]
          if not id then
            redis.call('ZREM', tenants, t)
          else
            local v = live(id)
            if v then
              return {{id = id, class = c, state = v[1], tenant = t, urgent = false, vtime = tonumber(v[4] or '0'),
                      cost = math.max(tonumber(v[5] or '1'), 1)}}
            end
            drop(id, c, t)
          end
        end
      end
    end
  end
end

local function pop(list, want, got)
  local items = redis.call('LPOP', list, want)
  if items then for _, item in ipairs(items) do got[#got + 1] = item end end
end

local function index_of(item) return tonumber(string.match(item, '^%d+')) end

-- up to `want` requests of one job: this worker's groups first, merged in input order,
-- then the fullest other group. A job's heads are read once per call.
local heads_of = {{}}
local function take(key, want)
  local got, heads = {{}}, heads_of[key]
  if not heads then
    heads = {{}}
    for _, g in ipairs(mine) do
      local head = redis.call('LINDEX', key .. ':q:' .. g, 0)
      if head then heads[#heads + 1] = {{list = key .. ':q:' .. g, index = index_of(head)}} end
    end
    heads_of[key] = heads
  end
  while #got < want and #heads > 0 do
    local at = 1
    for i = 2, #heads do if heads[i].index < heads[at].index then at = i end end
    local h = heads[at]
    if #heads == 1 then
      pop(h.list, want - #got, got)
      local head = redis.call('LINDEX', h.list, 0)
      if head then h.index = index_of(head) else table.remove(heads, at) end
      break
    end
    got[#got + 1] = redis.call('LPOP', h.list)
    local head = redis.call('LINDEX', h.list, 0)
    if head then h.index = index_of(head) else table.remove(heads, at) end
  end
  while #got < want do
    local best, most = nil, 0
    for g = 0, {BACKLOG_GROUPS - 1} do
      if not own[tostring(g)] then
        local len = redis.call('LLEN', key .. ':q:' .. g)
        if len > most then best, most = g, len end
      end
    end
    if not best then break end
    pop(key .. ':q:' .. best, want - #got, got)
  end
  return got
end

local need, added, charged = n - #out, 0, {{}}
while need > 0 do
  local j = next_job()
  if not j then break end
  local t = j.tenant
  local key = base .. 'job:' .. j.id
  local tvirtual, jvirtual = math.max(tv[t], clock), math.max(j.vtime, jclock[t])
  if not j.urgent then  -- the clocks follow fair picks only
    clock = tvirtual
    jclock[t] = math.max(jclock[t], jvirtual)
  end
  local want = math.min(need, {QUANTUM})
  local items = take(key, want)
  local emptied = #items < want  -- or its backlog count says so, below
  local id
  for _, item in ipairs(items) do
    local a = string.find(item, ' ', 1, true)
    local b = string.find(item, ' ', a + 1, true)
    local when = string.sub(item, a + 1, b - 1)
    -- 123 is '{{': a request that ran before (a retried row's) carries its deliveries
    local kind = string.byte(when, 1) == 123 and F.carried or F.queued
    id = redis.call('XADD', stream, '*', F.job, j.id, F.index, string.sub(item, 1, a - 1),
                    F.request, string.sub(item, b + 1), kind, when)
  end
  if #items > 0 then
    local cost = #items * j.cost
    if j.urgent then debt = debt + cost else debt = math.max(debt - cost * share / (1 - share), 0) end
    jvirtual = jvirtual + cost
    tv[t] = tvirtual + cost / weight[t]
    charged[t] = true
    redis.call('HSET', key, 'vtime', fx_num(jvirtual), 'last_id', id)
    if j.state == S.QUEUED then  -- a worker holds its first requests: running, not queued
      move(key, j.state, S.RUNNING, 'started_at', now)
      j.state = S.RUNNING
    end
    if redis.call('HINCRBY', key, 'backlog', -#items) <= 0 then emptied = true end
    redis.call('ZADD', base .. 'jobs:' .. j.class .. ':' .. t, fx_num(jvirtual), j.id)
    redis.call('ZADD', base .. 'tenants:' .. j.class, fx_num(tv[t]), t)
    need, added = need - #items, added + #items
  end
  if emptied then drop(j.id, j.class, t) end
end
redis.call('HSET', fair, 'clock', fx_num(clock), 'urgent_debt', fx_num(debt))
for t in pairs(charged) do
  redis.call('HSET', fair, 't:' .. t, fx_num(tv[t]), 'c:' .. t, fx_num(jclock[t]))
end
if redis.call('SCARD', ready) == 0 then rest_fair_clocks(fair) end  -- fair_clock.py
if added > 0 then
  local more = redis.call('XREADGROUP', 'GROUP', group, me, 'COUNT', added, 'STREAMS', stream, '>')
  for _, e in ipairs(more[1][2]) do out[#out + 1] = e end
end
return cjson.encode(out)
""",
)


def dispatch(
    conn: redis.Redis, qk: QueueKeys, consumer: str, count: int, groups: Sequence[int] | None
) -> list[tuple[str, dict[bytes, bytes]]]:
    """Up to ``count`` entries for ``consumer``: (entry id, fields as XREADGROUP gives
    them); ``groups``: its prefix groups in order (None: every group, in order)."""
    order = ",".join(str(g) for g in groups) if groups is not None else "*"
    raw = DISPATCH(conn, stream=qk.stream, ready=qk.ready, fair=qk.fair, group=GROUP,
                   me=consumer, count=count, groups=order, urgent_share=URGENT_SHARE,
                   now=time.time())  # fmt: skip
    entries: Any = json.loads(raw)
    if not isinstance(entries, list):  # cjson encodes an empty table as {}
        return []
    return [(entry_id, {flat[k].encode(): flat[k + 1].encode() for k in range(0, len(flat), 2)})
            for entry_id, flat in entries if flat]  # fmt: skip
