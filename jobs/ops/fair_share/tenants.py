"""Tenants: who jobs are for, their weight in fair share, and their quotas.

A tenant's settings are one hash (``batchgen tenant set``): ``weight`` (its share
of a model's workers against the other tenants with work in the same priority
class; default 1, within ``WEIGHTS``), ``max_enqueued_tokens`` (OpenAI's batch queue limit: the
estimated input tokens of its unfinished jobs together) and ``max_jobs`` (its
unfinished jobs at once), and ``max_priority`` (the highest priority class its jobs
may ask for). A tenant without settings has weight 1 and no limits, but for the
priority class: a batch from a serve API key that is not an admin's may ask for
the normal class at most (``KEYED_MAX_PRIORITY``) unless its tenant's
``max_priority`` says otherwise; a CLI submit or an admin key, with nothing set,
for any (whoever reaches the CLI reaches Redis). A job asking above its limit is
refused (``check_priority``), never lowered silently.

Quotas are checked by one script on the tenant's own keys before a job is created
(``reserve``): it records the job's share (its estimated input tokens) in the
tenant's ``jobs`` hash only if the total stays within the limits, so two submits
can never both squeeze under one. The total is kept in ``held`` (jobs, tokens) by
that script and by ``release``'s, so a reserve costs the same with 10 or 10,000
unfinished jobs. The job's keys live in its model's hash slot and the tenant's in
another, so this is a step of its own: a share whose job was never created (a
submit that died in between) is dropped once it is a minute old, and a finished
job's share when it finishes (``release``) or, failing that, by a later reserve:
each looks at the next ``PRUNE_BATCH`` shares in turn (``prune``), refused ones
too. ``batchgen retry`` reserves a share the same way for the rows it queues again,
before it reopens the job: while it holds the job's lease a reserve leaves that
share alone, and the job's next finish releases it.

The weight also lives in each model's ``fair`` hash (``w:TENANT``), where the
dispatch script reads it: written when a job is created and by ``save``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis

from batchgen.jobs.ops.job_record import JobRecord
from batchgen.jobs.ops.lifecycle import JobState
from batchgen.jobs.redis import hash_codec
from batchgen.jobs.redis.keys import Keys, QueueKeys, text
from batchgen.jobs.redis.lua import LuaScript
from batchgen.jobs.schema.errors import QuotaExceeded, UsageError

WEIGHTS = (1e-3, 1e3)  # a weight's bounds: 1e6 to 1 at most between two tenants
KEYED_MAX_PRIORITY = 0  # a serve key's tenant without max_priority: the normal class
ORPHAN_S = 60  # a share this old whose job does not exist is a submit that died
PRUNE_BATCH = 10  # shares a reserve looks at (prune)

# OpenAI's code for a batch past the queue limit; its API has no limit on concurrent
# batches, so that refusal has a code of batchgen's own.
TOKENS_CODE = "token_limit_exceeded"
JOBS_CODE = "batch_limit_exceeded"


@dataclass(slots=True)
class Tenant:
    name: str
    weight: float = 1.0
    max_enqueued_tokens: int | None = None  # None: no limit
    max_jobs: int | None = None  # None: no limit
    max_priority: int | None = None  # None: KEYED_MAX_PRIORITY for serve keys, else no limit

    def check(self) -> Tenant:
        low, high = WEIGHTS
        if not low <= self.weight <= high:  # inf and nan too
            raise UsageError(
                f"tenant {self.name!r}: --weight {self.weight:g}: give a weight from {low:g} "
                f"to {high:g}"
            )
        for name in ("max_enqueued_tokens", "max_jobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise UsageError(f"tenant {self.name!r}: {name} must be 0 or more")
        if self.max_priority is not None:
            from batchgen.jobs.ops.fair_share.schedule import (
                check_priority as check_class,  # imports us
            )

            check_class(self.max_priority)
        return self


def load(conn: redis.Redis, keys: Keys, name: str) -> Tenant:
    raw = conn.hgetall(keys.tenant(name).settings)
    return hash_codec.from_hash(Tenant, raw, name=name)


def save(conn: redis.Redis, keys: Keys, tenant: Tenant) -> None:
    """Store the settings, and the weight where every model's dispatch reads it."""
    tenant.check()
    fields = {k: v for k, v in hash_codec.to_hash(tenant).items() if k != "name"}
    conn.hset(keys.tenant(tenant.name).settings, mapping=fields)  # type: ignore[arg-type]
    conn.sadd(keys.tenants, tenant.name)
    for tag in conn.hkeys(keys.queues):
        publish_weight(conn, keys.queue(text(tag)), tenant)


def check_priority(conn: redis.Redis, keys: Keys, tenant: str, priority: int, keyed: bool) -> None:
    """Refuse (UsageError) a job of ``tenant`` asking for a class above its limit;
    ``keyed``: it comes from a serve API key that is not an admin's."""
    limit = load(conn, keys, tenant).max_priority
    why = "its --max-priority"
    if limit is None and keyed:
        limit, why = KEYED_MAX_PRIORITY, "an API key's tenant without --max-priority"
    if limit is not None and priority > limit:
        raise UsageError(
            f"priority {priority}: tenant {tenant!r} may ask for class {limit} at most ({why}); "
            "nothing was queued"
        )


def publish_weight(conn: redis.Redis, qk: QueueKeys, tenant: Tenant) -> None:
    conn.hset(qk.fair, f"w:{tenant.name}", repr(float(tenant.weight)))


def names(conn: redis.Redis, keys: Keys) -> list[str]:
    return sorted(text(n) for n in conn.smembers(keys.tenants))


RESERVE = LuaScript.define(
    "reserve quota",
    keys=[
        ("settings", "the tenant's settings"),
        ("jobs", "its unfinished jobs' shares"),
        ("held", "their sum"),
    ],
    args=[("job_id", ""), ("tokens", "the job's estimated input tokens"), ("now", "unix s")],
    body="""
if redis.call('HEXISTS', jobs, job_id) == 1 then return {1, '', 0} end  -- a resumed submit
local v = redis.call('HMGET', settings, 'max_jobs', 'max_enqueued_tokens')
local h = redis.call('HMGET', held, 'jobs', 'tokens')
local max_jobs, max_tokens = tonumber(v[1]), tonumber(v[2])  -- JSON null: no limit
local n, sum = tonumber(h[1]) or 0, tonumber(h[2]) or 0
if max_jobs and n + 1 > max_jobs then return {0, 'jobs', n} end
if max_tokens and sum + tonumber(tokens) > max_tokens then return {0, 'tokens', sum} end
redis.call('HSET', jobs, job_id, tokens .. ' ' .. now)
redis.call('HINCRBY', held, 'jobs', 1)
redis.call('HINCRBY', held, 'tokens', tokens)
return {1, '', 0}
""",
)

RELEASE = LuaScript.define(
    "release quota",
    keys=[("jobs", "the tenant's unfinished jobs' shares"), ("held", "their sum")],
    args=[("*job_ids", "")],
    body="""
local released = 0
for _, job_id in ipairs(job_ids) do
  local share = redis.call('HGET', jobs, job_id)
  if share then
    redis.call('HDEL', jobs, job_id)
    redis.call('HINCRBY', held, 'jobs', -1)
    redis.call('HINCRBY', held, 'tokens', -tonumber(string.match(share, '^%d+')))
    released = released + 1
  end
end
if tonumber(redis.call('HGET', held, 'jobs') or '0') <= 0 then
  redis.call('DEL', held)  -- nothing held: no key left behind (its scan cursor included)
end
return released
""",
)


def reserve(conn: redis.Redis, keys: Keys, record: JobRecord, tokens: int) -> None:
    """Hold the job's share of its tenant's quotas (``tokens``: the estimated input
    tokens it queues: a submit's whole input, a retry's retried rows); QuotaExceeded
    (nothing held) if it does not fit."""
    tk = keys.tenant(record.tenant)
    prune(conn, keys, record.tenant)
    ok, which, held = RESERVE(conn, settings=tk.settings, jobs=tk.jobs, held=tk.held,
                              job_id=record.id, tokens=tokens, now=int(time.time()))  # fmt: skip
    if ok:
        return
    tenant = load(conn, keys, record.tenant)
    who = f"tenant {record.tenant!r}" if record.tenant else "jobs without a tenant"
    if text(which) == "tokens":
        raise QuotaExceeded(
            f"Enqueued token limit reached for {record.model} by {who}. Limit: "
            f"{tenant.max_enqueued_tokens:,} enqueued tokens; unfinished jobs hold {int(held):,} "
            f"and this one needs {tokens:,} (estimated). Please try again once "
            "some in_progress jobs have been completed. Nothing was queued.",
            TOKENS_CODE,
        )
    raise QuotaExceeded(
        f"Concurrent job limit reached for {who}: {tenant.max_jobs} unfinished jobs at most. "
        "Please try again once one has been completed. Nothing was queued.",
        JOBS_CODE,
    )


def release(conn: redis.Redis, keys: Keys, tenant: str, *job_ids: str) -> None:
    """The jobs finished (or are gone): their share of the quotas is free again."""
    tk = keys.tenant(tenant)
    RELEASE(conn, jobs=tk.jobs, held=tk.held, job_ids=list(job_ids))


def prune(conn: redis.Redis, keys: Keys, tenant: str, now: float | None = None) -> list[str]:
    """Drop shares of jobs that finished, or that were never created; their ids. Each
    call looks at the next ``PRUNE_BATCH`` shares or so (HSCAN, its cursor kept in
    ``held``; all of them while they fit Redis's small-hash encoding, 128 by default),
    so a submit costs the same with 200 or 10,000 unfinished jobs; every share is
    looked at within (shares / PRUNE_BATCH) submits (refused ones too)."""
    now = time.time() if now is None else now
    tk = keys.tenant(tenant)
    start: Any = conn.hget(tk.held, "cursor")
    scanned: Any = conn.hscan(tk.jobs, int(start or 0), count=PRUNE_BATCH)
    cursor, raw = scanned
    if int(cursor):
        conn.hset(tk.held, "cursor", cursor)
    else:  # the scan wrapped: 0, the default, is not stored (a tenant with nothing holds no key)
        conn.hdel(tk.held, "cursor")
    shares = {text(k): text(v) for k, v in raw.items()}
    if not shares:
        return []
    ids = sorted(shares)
    tags = conn.hmget(keys.jobs, ids)
    pipe = conn.pipeline(transaction=False)
    for job_id, tag in zip(ids, tags):
        pipe.hget(keys.queue(text(tag)).job(job_id).job, "state")
    gone, ended = [], []
    for job_id, tag, state in zip(ids, tags, pipe.execute()):
        since = float(shares[job_id].split(" ")[1])
        missing = not tag or state is None
        if missing and now - since > ORPHAN_S:
            gone.append(job_id)
        elif state and JobState(text(state)).terminal:
            ended.append((job_id, keys.queue(text(tag)).job(job_id).finalizer))
    if ended:  # a finished job's share, unless a retry (or finalize) holds its lease: the
        # retry reserved it for the rows it is about to queue again (rerun.py)
        pipe = conn.pipeline(transaction=False)
        for _, lease in ended:
            pipe.exists(lease)
        gone += [job_id for (job_id, _), leased in zip(ended, pipe.execute()) if not leased]
    if gone:
        release(conn, keys, tenant, *gone)
    return gone


def holding(conn: redis.Redis, keys: Keys, tenant: str) -> dict[str, Any]:
    """What the tenant's unfinished jobs hold of its quotas: {jobs, enqueued_tokens}."""
    jobs, tokens = conn.hmget(keys.tenant(tenant).held, ["jobs", "tokens"])
    return {"jobs": int(jobs or 0), "enqueued_tokens": int(tokens or 0)}
