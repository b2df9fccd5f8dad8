"""The dashboard's JSON (/api/, also for scripts), each key seeing its own tenant's jobs.

A job is a tenant's when serve submitted it for that tenant's batch
(``JobRecord.api_tenant``); jobs submitted otherwise (the CLI's) have none and only
admins see them. Another tenant's job is a 404, as for a job never made. The
workers are the fleet's (every key sees them); the tok/s series shows a key only
its own jobs' lines, and the fleet's total. A key that is not an admin, while the
workers hold requests of jobs it does not see, gets the overview's ``notice``
saying so and why, which the page shows (a one-key setup's own CLI jobs stay
hidden from its key: whoever holds that key is a client, not Redis's owner).

Listings are pages of an index by submit time (jobs/ops/job_index.py): the overview shows the
newest ``MAX_JOBS`` and ``total_jobs``, /api/jobs takes ``offset`` and ``limit``
(``MAX_JOBS`` at most); a page costs Redis a command a job shown, whatever the number
of jobs, and a key that is not an admin's reads its tenant's index only.

While Redis refuses writes (OOM, READONLY, MISCONF: outage_probe) the overview's
``outage`` says so in the line ``batchgen status`` prints, and the page shows it; a
server that refuses reads too (BUSY, LOADING) makes every /api call a 503 whose error
says why (app.py), which the page shows in place of its last update time.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import redis
from fastapi import APIRouter, Query

from batchgen.jobs.ops import job_index
from batchgen.jobs.ops.cancellation import cancel
from batchgen.jobs.ops.job_record import load_job
from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.redis.outage_probe import refused_writes
from batchgen.jobs.schema.errors import JobNotFound
from batchgen.serve import dashboard
from batchgen.serve.api_keys import Principal
from batchgen.serve.auth import Who
from batchgen.serve.openai_errors import not_found
from batchgen.serve.series import read_series


def router(conn: redis.Redis, keys: Keys) -> APIRouter:
    api = APIRouter()

    def own_job(job_id: str, who: Principal) -> None:
        """404 unless the job exists for ``who``."""
        try:
            tenant = load_job(conn, keys, job_id).api_tenant
        except JobNotFound:
            raise not_found("job", job_id) from None
        if not who.sees(tenant):
            raise not_found("job", job_id)

    def series(who: Principal) -> list[dict[str, Any]]:
        points = read_series(conn, keys)
        if who.admin:
            return points
        named = sorted({j for p in points for j in p["jobs"]})
        mine = job_index.among(conn, keys, who.tenant, named)
        return [{**p, "jobs": {j: r for j, r in p["jobs"].items() if j in mine}} for p in points]

    @api.get("/api/overview")
    def api_overview(who: Who) -> Any:
        return {"now": time.time(), "jobs": dashboard.jobs(conn, keys, who),
                "total_jobs": job_index.count(conn, keys, dashboard.listed_tenant(who)),
                "workers": dashboard.workers(conn, keys),
                "tenants": dashboard.tenants(conn, keys, who), "series": series(who),
                "notice": dashboard.unseen_notice(conn, keys, who),
                "outage": refused_writes(conn, keys)}  # fmt: skip

    @api.get("/api/jobs")
    def api_jobs(
        who: Who,
        offset: Annotated[int, Query(ge=0)] = 0,
        limit: Annotated[int, Query(ge=1, le=dashboard.MAX_JOBS)] = dashboard.MAX_JOBS,
    ) -> Any:
        return dashboard.jobs(conn, keys, who, offset, limit)

    @api.get("/api/jobs/{job_id}")
    def api_job(job_id: str, who: Who) -> Any:
        own_job(job_id, who)
        return dashboard.job_detail(conn, keys, job_id)

    @api.post("/api/jobs/{job_id}/cancel")
    def api_cancel(job_id: str, who: Who) -> Any:
        own_job(job_id, who)
        return {"job_id": job_id, "state": cancel(conn, keys, job_id).value}

    @api.get("/api/workers")
    def api_workers(who: Who) -> Any:
        return dashboard.workers(conn, keys)

    @api.get("/api/series")
    def api_series(who: Who) -> Any:
        return series(who)

    return api
