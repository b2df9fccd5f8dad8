"""The dispatch script: which requests a worker with room takes next, in one atomic step.

A worker asks for as many requests as its engine can admit. The script first
reads the stream (XREADGROUP ``>``): entries handed back with their tokens go
first, since work already begun is never set aside. It fills the rest from the backlogs of the
model's ready jobs (backlog.py), ``QUANTUM`` requests at a time from the job that
comes first in this order:

1. urgent jobs (deadlines.py: they would miss their deadline at their fair share),
   earliest deadline first;
2. higher priority class;
3. the tenant with the smallest virtual time (tokens charged / its weight);
4. within the tenant, the job with the smallest virtual time (tokens charged).

Each request moved is charged its job's estimated cost (tokens: input estimate
and max_tokens), so shares are shares of tokens, not of requests. A tenant or job
that had no work gets its virtual time raised to the clock (the smallest charged
when last picked) before it competes, so idle time is not credit to spend later.
Within the chosen job the worker takes its own prefix groups first
(worker/loop/affinity.py), in input order across them, and takes from the fullest
other group only when those are empty: affinity reorders a job's requests, never
the jobs' shares, and no worker waits while any backlog holds work. A lone worker
owns every group, so it takes a job's requests in input order, as before backlogs.

The moved requests are XADDed to the stream (``j i r q``, or ``j i r x`` for a
retried request, whose backlog item carries its earlier deliveries: entry.py) and
read by this worker in the same script, so from there on everything is as before:
the entry is pending at the worker (refresh, reclaim, hand-back, dead-letter and
commit unchanged). Redis per call: one XREADGROUP, SMEMBERS of the ready set and an
HMGET per ready job, a LINDEX per own group of each job it takes from, then per
request an LPOP, a LINDEX (the merge in input order), an XADD and the final
XREADGROUP's share.

The job records are found from the ready set's ids (same hash tag, so the same
slot as the stream: Redis Cluster runs it on the model's shard).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import redis

from batchgen.jobs.ops.lifecycle import script
from batchgen.jobs.redis.keys import BACKLOG_GROUPS, GROUP, QueueKeys
from batchgen.jobs.schema.entry import LUA_FIELDS

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
    ],
    prelude=LUA_FIELDS,
    body=f"""
-- replies go back as one JSON string: Redis turns a Lua table of entries into a reply
-- several times slower than cjson encodes it
local out = {{}}
local n = tonumber(count)
local first = redis.call('XREADGROUP', 'GROUP', group, me, 'COUNT', n, 'STREAMS', stream, '>')
if first then for _, e in ipairs(first[1][2]) do out[#out + 1] = e end end
if #out >= n then return cjson.encode(out) end
local ids = redis.call('SMEMBERS', ready)
if #ids == 0 then return cjson.encode(out) end

local mine, own = {{}}, {{}}
if groups == '*' then groups = '{",".join(str(g) for g in range(BACKLOG_GROUPS))}' end
for g in string.gmatch(groups, '%d+') do mine[#mine + 1] = g; own[g] = true end
local base = string.sub(stream, 1, #stream - 6)  -- 'P:{{TAG}}:' (the stream is P:{{TAG}}:stream)
local clock = tonumber(redis.call('HGET', fair, 'clock') or '0')
local tv, weight, jclock, jobs = {{}}, {{}}, {{}}, {{}}
for _, id in ipairs(ids) do
  local key = base .. 'job:' .. id
  local v = redis.call('HMGET', key, 'state', 'closed', 'backlog', 'tenant', 'priority', 'urgent',
                       'deadline', 'vtime', 'cost')
  if (v[1] ~= S.QUEUED and v[1] ~= S.RUNNING) or v[2] == '1' or tonumber(v[3] or '0') <= 0 then
    redis.call('SREM', ready, id)
  else
    local t = v[4] or ''
    if tv[t] == nil then
      tv[t] = math.max(tonumber(redis.call('HGET', fair, 't:' .. t) or '0'), clock)
      weight[t] = tonumber(redis.call('HGET', fair, 'w:' .. t) or '1')
      jclock[t] = tonumber(redis.call('HGET', fair, 'c:' .. t) or '0')
    end
    jobs[#jobs + 1] = {{id = id, key = key, tenant = t, priority = tonumber(v[5] or '0'),
      urgent = v[6] == '1', deadline = tonumber(v[7] or '0'),
      vtime = math.max(tonumber(v[8] or '0'), jclock[t]), cost = math.max(tonumber(v[9] or '1'), 1)}}
  end
end

local function before(a, b)
  if a.urgent ~= b.urgent then return a.urgent end
  if a.urgent and a.deadline ~= b.deadline then return a.deadline < b.deadline end
  if a.priority ~= b.priority then return a.priority > b.priority end
  if tv[a.tenant] ~= tv[b.tenant] then return tv[a.tenant] < tv[b.tenant] end
  if a.vtime ~= b.vtime then return a.vtime < b.vtime end
  return a.id < b.id
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
while need > 0 and #jobs > 0 do
  local at = 1
  for i = 2, #jobs do if before(jobs[i], jobs[at]) then at = i end end
  local j = jobs[at]
  if not j.urgent then  -- the clocks follow fair picks only
    clock = math.max(clock, tv[j.tenant])
    jclock[j.tenant] = math.max(jclock[j.tenant], j.vtime)
  end
  local want = math.min(need, {QUANTUM})
  local items = take(j.key, want)
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
    j.vtime = j.vtime + cost
    tv[j.tenant] = tv[j.tenant] + cost / weight[j.tenant]
    charged[j.tenant] = true
    redis.call('HSET', j.key, 'vtime', j.vtime, 'last_id', id)
    redis.call('HINCRBY', j.key, 'backlog', -#items)
    need, added = need - #items, added + #items
  end
  if #items < want then  -- its backlog is empty
    redis.call('SREM', ready, j.id)
    table.remove(jobs, at)
  end
end
redis.call('HSET', fair, 'clock', clock)
for t in pairs(charged) do redis.call('HSET', fair, 't:' .. t, tv[t], 'c:' .. t, jclock[t]) end
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
                   me=consumer, count=count, groups=order)  # fmt: skip
    entries: Any = json.loads(raw)
    if not isinstance(entries, list):  # cjson encodes an empty table as {}
        return []
    return [(entry_id, {flat[k].encode(): flat[k + 1].encode() for k in range(0, len(flat), 2)})
            for entry_id, flat in entries if flat]  # fmt: skip
