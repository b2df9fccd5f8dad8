"""The job lifecycle: its states, the moves between them, and the Lua every move runs in.

::

    queued ──first read─▶ running ──every input has a row──▶ finalizing ──▶ completed
      │  └────────────── every row (or lost entries) ─────────▲
      └──cancel──▶ cancelling ◀──cancel── running
                      └──finalize──▶ cancelled

    completed, cancelled ──retry (REOPEN)──▶ running

``JobState`` is stored in Redis as its value. Every script that moves a job
(submit's create, commit, dead-letter, cancel, the lost-entry check, finalize,
retry's re-open) starts with ``LUA_PRELUDE``: the state names as Lua constants
taken from the enum, the table of allowed moves taken from ``MOVES``, and the
helpers that make the moves (``move`` refuses one the table does not allow). No
script spells a state name itself.

``MOVES`` are the moves of a job's run; a finished job has none, so it is
``terminal`` (finalize cleans it up, its state expires). Only ``batchgen
retry`` (rerun.py) leads out of one again, by the moves in ``REOPEN`` and the
prelude's ``reopen``: the job goes back to ``running`` with its retried rows
missing, and is finalized again once they have rows.

The job record's ``closed`` flag is set by finalize when it starts: from then
on the set of committed parts is frozen and later commits are discarded.
Finalize never gives up: a failed one is retried with backoff (finalization.py)
while the job stays ``finalizing`` (or ``cancelling``) and status shows why.
"""

from __future__ import annotations

import enum

from batchgen.jobs.ops.fair_share.fair_index import FAIR_INDEX
from batchgen.jobs.redis.lua import LuaScript, lua_moves


class JobState(str, enum.Enum):
    """Stored in Redis as its value."""

    QUEUED = "queued"  # created; requests waiting (submit may still be enqueuing)
    RUNNING = "running"  # a worker took one of its requests (worker/consumer/dispatch.py) or a row was committed
    FINALIZING = "finalizing"  # every input has a row; the finalize task writes the output
    COMPLETED = "completed"
    CANCELLING = "cancelling"  # workers drop its requests; finalize fills cancelled rows
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        """No move of a run leads out of it (only a retry's ``REOPEN``)."""
        return not MOVES[self]

    @property
    def live(self) -> bool:
        """Requests of the job may still run."""
        return self in (JobState.QUEUED, JobState.RUNNING)

    @property
    def needs_finalize(self) -> bool:
        return self in (JobState.FINALIZING, JobState.CANCELLING)


MOVES: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.FINALIZING, JobState.CANCELLING}),
    JobState.RUNNING: frozenset({JobState.FINALIZING, JobState.CANCELLING}),
    JobState.FINALIZING: frozenset({JobState.COMPLETED}),
    JobState.CANCELLING: frozenset({JobState.CANCELLED}),
    JobState.COMPLETED: frozenset(),
    JobState.CANCELLED: frozenset(),
}

# What finalize turns a state into (FINAL in Lua).
FINAL_STATE = {JobState.FINALIZING: JobState.COMPLETED, JobState.CANCELLING: JobState.CANCELLED}

# The moves out of a finished job: ``batchgen retry`` re-opens it (REOPEN in Lua).
REOPEN: dict[JobState, JobState] = {
    JobState.COMPLETED: JobState.RUNNING,
    JobState.CANCELLED: JobState.RUNNING,
}


def _lua_tables() -> str:
    states = ", ".join(f"{s.name} = '{s.value}'" for s in JobState)
    final = ", ".join(f"{src.value} = '{dst.value}'" for src, dst in FINAL_STATE.items())
    reopen = ", ".join(f"{src.value} = '{dst.value}'" for src, dst in REOPEN.items())
    return (
        f"local S = {{{states}}}\nlocal MOVES = {lua_moves(MOVES)}\nlocal FINAL = {{{final}}}\n"
        f"local REOPEN = {{{reopen}}}\n"
    )


LUA_PRELUDE = (
    _lua_tables()
    + """
-- Move job (a record key) from its state to `to`; an illegal move is a bug: fail loudly
-- (callers check the state first and move before any other write).
local function move(job, from, to, ...)
  if not MOVES[from] or not MOVES[from][to] then
    error('batchgen: job ' .. job .. ' cannot move from ' .. tostring(from) .. ' to ' .. to)
  end
  redis.call('HSET', job, 'state', to, ...)
end

-- Move a finished job (a record key) back to where a retry starts it; only REOPEN's moves.
local function reopen(job, from, ...)
  if not REOPEN[from] then
    error('batchgen: job ' .. job .. ' cannot be reopened from ' .. tostring(from))
  end
  redis.call('HSET', job, 'state', REOPEN[from], ...)
end

-- 'missing' (no record), 'closed' (finalize froze its parts) or 'live'
local function job_status(job)
  local v = redis.call('HMGET', job, 'state', 'closed')
  if not v[1] then return 'missing' end
  if v[2] == '1' then return 'closed' end
  return 'live'
end

-- Add new rows' counters; queued -> running on the first, -> finalizing on the last.
-- True when this made the job need its finalize. `started` (optional): when the rows'
-- worker read the first of them; the job started at the earliest such time.
local function bump(job, d, f, pt, ct, cc, now, started)
  if d > 0 then redis.call('HINCRBY', job, 'done', d) end
  if f > 0 then redis.call('HINCRBY', job, 'failed', f) end
  if pt > 0 then redis.call('HINCRBY', job, 'prompt_tokens', pt) end
  if ct > 0 then redis.call('HINCRBY', job, 'completion_tokens', ct) end
  if cc > 0 then redis.call('HINCRBY', job, 'cached_tokens', cc) end
  local v = redis.call('HMGET', job, 'state', 'done', 'failed', 'total', 'started_at')
  local state = v[1]
  local at = tonumber(now)
  if started and tonumber(started) > 0 and tonumber(started) < at then at = tonumber(started) end
  if state == S.QUEUED then
    move(job, state, S.RUNNING, 'started_at', at)
    state = S.RUNNING
  elseif at < (tonumber(v[5]) or at) then
    redis.call('HSET', job, 'started_at', at)
  end
  if state == S.RUNNING and tonumber(v[2]) + tonumber(v[3]) >= tonumber(v[4]) then
    move(job, state, S.FINALIZING)
    return true
  end
  return false
end
"""
)


def script(name: str, *, keys, args=(), body: str, prelude: str = "") -> LuaScript:
    """A LuaScript that starts with the lifecycle prelude (and ``prelude`` after it)."""
    return LuaScript.define(name, keys=keys, args=args, body=body, prelude=LUA_PRELUDE + prelude)


CREATE = script(
    "create job",
    keys=[("job", "the job record"), ("active", "the queue's unfinalized jobs")],
    args=[("job_id", ""), ("*fields", "the record (but its state) as field, value, ...")],
    body="""
if redis.call('EXISTS', job) == 1 then return 0 end
redis.call('HSET', job, 'state', S.QUEUED, unpack(fields))
redis.call('SADD', active, job_id)
return 1
""",
)

CANCEL = script(
    "cancel job",
    keys=[
        ("job", "the job record"),
        ("cancelled", "the queue's cancelled jobs (workers poll)"),
        ("ready", "the queue's jobs with a backlog"),
        ("*backlogs", "the job's backlog lists (dropped: those requests never run)"),
    ],
    args=[
        ("job_id", ""),
        ("events", "the queue's events channel (workers listen)"),
        ("now", "unix seconds"),
    ],
    body="""
local state = redis.call('HGET', job, 'state')
if not state then return '' end
if state == S.QUEUED or state == S.RUNNING then
  move(job, state, S.CANCELLING, 'cancelled_at', now, 'backlog', 0, 'urgent', '0')
  redis.call('DEL', unpack(backlogs))
  redis.call('SREM', ready, job_id)
  local v = redis.call('HMGET', job, 'priority', 'tenant')
  fx_leave(string.sub(ready, 1, #ready - 5), job_id, v[1] or '0', v[2] or '')
  redis.call('SADD', cancelled, job_id)
  redis.call('PUBLISH', events, 'cancel:' .. job_id)
  return S.CANCELLING
end
return state
""",
    prelude=FAIR_INDEX,
)

MARK_LOST = script(
    "mark lost entries",
    keys=[("stream", "the model's request stream"), ("job", "the job record")],
    body="""
local v = redis.call('HMGET', job, 'state', 'enqueued', 'total', 'done', 'failed', 'last_id',
                     'backlog')
local state = v[1]
if not state then return 'missing' end
if state ~= S.QUEUED and state ~= S.RUNNING then return state end
local enqueued, total = tonumber(v[2]), tonumber(v[3])
local finished = tonumber(v[4]) + tonumber(v[5])
if enqueued < total or finished >= total or not v[6] or v[6] == '' then return state end
if tonumber(v[7] or '0') > 0 then return state end  -- requests wait in its backlog
-- an entry up to the newest one of this job may still be read: nothing is lost yet
if #redis.call('XRANGE', stream, '-', v[6], 'COUNT', 1) > 0 then return state end
move(job, state, S.FINALIZING, 'lost', total - finished)
return 'lost'
""",
)

CLOSE = script(
    "close job",
    keys=[("job", "the job record")],
    body="""
local state = redis.call('HGET', job, 'state')
if state == S.FINALIZING or state == S.CANCELLING then
  redis.call('HSET', job, 'closed', '1')
end
return state
""",
)

FINISH = script(
    "finish job",
    keys=[("job", "the job record"), ("done", "the job's done-marks")],
    args=[
        ("now", "unix seconds"),
        ("failed", "rows that are not stop/length"),
        ("cancelled", "of those, the cancelled ones"),
    ],
    body="""
local state = redis.call('HGET', job, 'state')
if not FINAL[state] then return state end
move(job, state, FINAL[state], 'finished_at', now, 'failed', failed, 'cancelled_rows', cancelled,
     'error', '')
redis.call('HDEL', job, 'finalize_retry_at')
redis.call('DEL', done)
return FINAL[state]
""",
)

RETIRE = script(
    "retire job",
    keys=[
        ("job", "the job record"),
        ("active", "the queue's unfinalized jobs"),
        ("parts", "the job's committed parts (their files are deleted)"),
        ("errors", "the job's error rows"),
        ("dead", "the job's dead letters"),
        ("expiring", "finished jobs by expiry time"),
    ],
    args=[("job_id", ""), ("now", "unix seconds")],
    body="""
local v = redis.call('HMGET', job, 'state', 'retention_s')
local state = v[1]
if not state or not MOVES[state] or next(MOVES[state]) ~= nil then return 0 end  -- not terminal
redis.call('SREM', active, job_id)
redis.call('DEL', parts)
local keep = tonumber(v[2]) or 0
if keep > 0 then  -- the finished job's state goes after its retention (its outputs stay)
  for _, key in ipairs({job, errors, dead}) do redis.call('EXPIRE', key, keep) end
  redis.call('ZADD', expiring, tonumber(now) + keep, job_id)
end
return 1
""",
)
