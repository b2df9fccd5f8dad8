"""The jobs by submit time, for listings (``batchgen jobs``, ``status``, serve's
/api/jobs and /api/overview): a sorted set of every job and one per serve tenant
(``JobRecord.api_tenant``; a CLI job has none), scored by ``created_at``.

A page costs a ZREVRANGE and one HGETALL a job shown, and a count one ZCARD: never a
read of every job, and a key that is not an admin's reads only its tenant's index.
Submit adds a job once its record exists (again on a resumed submit, so a submit
killed in between is listed once resumed). ``forget`` drops jobs that left the job
index (deleted, or their state expired after its retention); an entry whose record
is gone anyway (Redis lost it) leaves the index when a listing meets it.

Jobs submitted before the index existed are only in the job index (``keys.jobs``):
the first listing on such a Redis adds them (``backfill``, once: ``keys.jobs_indexed``
says it is done, so every later listing pays one EXISTS for it). It reads the old jobs
500 at a time and may run twice at once (two listings): an addition is idempotent.
"""

from __future__ import annotations

from typing import Any

import redis

from batchgen.jobs.ops.job_record import JobRecord
from batchgen.jobs.redis.keys import Keys, text
from batchgen.jobs.redis.redis_errors import RedisRefused

CHUNK = 500  # jobs read at a time when a listing asks for all of them
OUTAGE_WRITES = ("OOM", "READONLY", "MISCONF")  # refusals of writes only: reads work


def add(conn: redis.Redis, keys: Keys, record: JobRecord) -> None:
    """List the job (``conn`` may be a pipeline)."""
    conn.zadd(keys.jobs_by_time, {record.id: record.created_at})
    if record.api_tenant:
        conn.zadd(keys.api_tenant_jobs(record.api_tenant), {record.id: record.created_at})


def backfill(conn: redis.Redis, keys: Keys) -> int:
    """List the jobs submitted before the index existed, once a Redis; how many were
    not listed yet. While Redis refuses writes (OOM, READONLY, MISCONF) it waits for a
    later listing: this one shows the index as it is."""
    if conn.exists(keys.jobs_indexed):
        return 0
    added, cursor = 0, 0
    try:
        while conn.hlen(keys.jobs) > conn.zcard(keys.jobs_by_time):  # else all are listed
            scanned: Any = conn.hscan(keys.jobs, cursor, count=CHUNK)
            cursor, chunk = scanned
            added += _list_unlisted(conn, keys, chunk)
            if not cursor:
                break
        conn.set(keys.jobs_indexed, "1")
    except RedisRefused as exc:
        if exc.code in OUTAGE_WRITES:
            return added
        raise
    return added


def _list_unlisted(conn: redis.Redis, keys: Keys, tags: dict[Any, Any]) -> int:
    """Add those of the jobs (job id -> queue tag, as ``keys.jobs`` holds them) that the
    index lacks; a job whose record is gone is left out."""
    ids = [text(j) for j in tags]
    if not ids:
        return 0
    scores: Any = conn.zmscore(keys.jobs_by_time, ids)
    missing = [(j, text(tags[k])) for j, k, s in zip(ids, tags, scores) if s is None]
    pipe = conn.pipeline(transaction=False)
    for job_id, tag in missing:
        pipe.hmget(keys.queue(tag).job(job_id).job, "created_at", "api_tenant")
    added = 0
    for (job_id, _), (created_at, api_tenant) in zip(missing, pipe.execute()):
        if created_at is None:
            continue
        record = JobRecord(id=job_id, created_at=float(created_at), api_tenant=text(api_tenant))
        add(pipe, keys, record)
        added += 1
    pipe.execute()
    return added


def forget(conn: redis.Redis, keys: Keys, job_ids: list[str]) -> None:
    """The jobs are gone: out of every index. A serve tenant is a fair-share tenant
    too (serve submits under the key's tenant), so ``keys.tenants`` names every index."""
    if not job_ids:
        return
    pipe = conn.pipeline(transaction=False)
    pipe.zrem(keys.jobs_by_time, *job_ids)
    for tenant in conn.smembers(keys.tenants):
        pipe.zrem(keys.api_tenant_jobs(text(tenant)), *job_ids)
    pipe.execute()


def _index(keys: Keys, api_tenant: str | None) -> str:
    return keys.jobs_by_time if api_tenant is None else keys.api_tenant_jobs(api_tenant)


def count(conn: redis.Redis, keys: Keys, api_tenant: str | None = None) -> int:
    """How many jobs there are (None: all), or of a serve tenant."""
    backfill(conn, keys)
    return int(conn.zcard(_index(keys, api_tenant)))


def page(
    conn: redis.Redis,
    keys: Keys,
    api_tenant: str | None = None,
    offset: int = 0,
    limit: int | None = None,
) -> list[JobRecord]:
    """Jobs newest first, from the ``offset``-th on, ``limit`` at most (None: all):
    every job (``api_tenant`` None) or a serve tenant's."""
    backfill(conn, keys)
    index = _index(keys, api_tenant)
    found: list[JobRecord] = []
    start = offset
    while limit is None or len(found) < limit:
        want = CHUNK if limit is None else limit - len(found)
        ids = [text(j) for j in conn.zrevrange(index, start, start + want - 1)]
        if not ids:
            break
        tags: Any = conn.hmget(keys.jobs, ids)
        pipe = conn.pipeline(transaction=False)
        for job_id, tag in zip(ids, tags):
            pipe.hgetall(keys.queue(text(tag)).job(job_id).job)
        gone = []
        for job_id, tag, raw in zip(ids, tags, pipe.execute()):
            if tag and raw:
                found.append(JobRecord.from_hash(job_id, raw))
            else:
                gone.append(job_id)
        if gone:
            conn.zrem(index, *gone)
        start += len(ids) - len(gone)
    return found


def among(conn: redis.Redis, keys: Keys, api_tenant: str, job_ids: list[str]) -> set[str]:
    """Those of ``job_ids`` that are ``api_tenant``'s."""
    if not job_ids:
        return set()
    scores: Any = conn.zmscore(keys.api_tenant_jobs(api_tenant), job_ids)
    return {j for j, s in zip(job_ids, scores) if s is not None}
