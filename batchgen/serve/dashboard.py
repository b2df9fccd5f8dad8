"""The data behind the dashboard (and the /api/ endpoints for scripts)."""

from __future__ import annotations

import json
from typing import Any

import redis

from batchgen.jobs.ops import job_index
from batchgen.jobs.ops.job_record import queue_of_job
from batchgen.jobs.ops.status_report import job_status, listed_statuses
from batchgen.jobs.ops.usage import tenants_report
from batchgen.jobs.redis.heartbeat import live_workers
from batchgen.jobs.redis.keys import Keys, text
from batchgen.serve.api_keys import Principal
from batchgen.serve.series import worker_rate

MAX_JOBS = 200
SHOWN_DEAD = 50


def workers(conn: redis.Redis, keys: Keys) -> list[dict[str, Any]]:
    """The live workers; tok/s: over the last minute, as each generated them (series.py)."""
    scored: Any = conn.zrange(keys.workers, 0, -1, withscores=True)
    beats = {text(n): float(s) for n, s in scored}
    out = []
    for w in live_workers(conn, keys):
        held = sum(int(n) for n in w.get("in_flight", {}).values())
        out.append({"name": w["name"], "host": w.get("host"), "model": w.get("model"),
                    "device": w.get("device"), "in_flight": held,
                    "tokens_per_s": worker_rate(w),
                    "last_heartbeat": beats.get(w["name"]),
                    "started_at": w.get("started_at")})  # fmt: skip
    return sorted(out, key=lambda w: (w["host"] or "", w["name"]))


def listed_tenant(who: Principal) -> str | None:
    """Whose jobs ``who`` lists: every job's (None) for an admin, else its tenant's."""
    return None if who.admin else who.tenant


def jobs(
    conn: redis.Redis, keys: Keys, who: Principal, offset: int = 0, limit: int = MAX_JOBS
) -> list[dict[str, Any]]:
    """The jobs ``who`` sees, newest first: ``limit`` from the ``offset``-th on."""
    listed = listed_statuses(conn, keys, listed_tenant(who), offset, limit)
    return [s.to_dict() for s in listed]


def unseen_notice(conn: redis.Redis, keys: Keys, who: Principal) -> str | None:
    """Why the live workers are busy with more than the jobs a key sees, for a key that
    does not see every job: the requests they hold for jobs not its own (every key sees
    the workers' in-flight counts anyway); None when they hold none."""
    if who.admin:
        return None
    held_by_job: dict[str, int] = {}
    for w in live_workers(conn, keys):
        for job_id, n in w.get("in_flight", {}).items():
            held_by_job[job_id] = held_by_job.get(job_id, 0) + int(n)
    mine = job_index.among(conn, keys, who.tenant, list(held_by_job))
    held = sum(n for job_id, n in held_by_job.items() if job_id not in mine)
    if not held:
        return None
    return (f"The live workers hold {held} requests of jobs this key does not see: jobs "
            "submitted with the CLI (batchgen submit, batchgen run) belong to no tenant and "
            "show only to an admin key, as do other tenants' jobs. Sign in with an admin key "
            "to see them (a --keys-file line: KEY TENANT admin).")  # fmt: skip


def tenants(conn: redis.Redis, keys: Keys, who: Principal) -> list[dict[str, Any]]:
    """The tenants ``who`` sees: settings, what they hold of their quotas, usage."""
    return [t for t in tenants_report(conn, keys) if who.sees(t["tenant"])]


def job_detail(conn: redis.Redis, keys: Keys, job_id: str) -> dict[str, Any]:
    """Status, plus dead letters and error rows with their reasons (the first few)."""
    out = job_status(conn, keys, job_id).to_dict()
    jk = queue_of_job(conn, keys, job_id).job(job_id)
    dead = []
    entries: Any = conn.xrange(jk.dead, "-", "+", count=SHOWN_DEAD)
    for entry_id, fields in entries:
        f = {text(k): text(v) for k, v in fields.items()}
        dead.append({"entry": text(entry_id), "index": int(f.get("i") or 0),
                     "reason": f.get("reason"), "deliveries": int(f.get("deliveries") or 0),
                     "worker": f.get("worker")})  # fmt: skip
    errors = []
    for index, raw in conn.hscan_iter(jk.errors, count=SHOWN_DEAD):
        row = json.loads(raw)
        errors.append({"index": int(index), "id": row.get("id"), "error": row.get("error")})
        if len(errors) >= SHOWN_DEAD:
            break
    out["dead_letters"] = dead
    out["errors"] = sorted(errors, key=lambda e: e["index"])
    return out
