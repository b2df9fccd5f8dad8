"""The dashboard's JSON (/api/, also for scripts), each key seeing its own tenant's jobs.

A job is a tenant's when serve submitted it for that tenant's batch
(``JobRecord.api_tenant``); jobs submitted otherwise (the CLI's) have none and only
admins see them. Another tenant's job is a 404, as for a job never made. The
workers are the fleet's (every key sees them); the tok/s series shows a key only
its own jobs' lines, and the fleet's total. A key that is not an admin, while the
workers hold requests of jobs it does not see, gets the overview's ``notice``
saying so and why, which the page shows (a one-key setup's own CLI jobs stay
hidden from its key: whoever holds that key is a client, not Redis's owner).
"""

from __future__ import annotations

import time
from typing import Any

import redis
from fastapi import APIRouter

from batchgen.jobs.ops.cancellation import cancel
from batchgen.jobs.ops.job_record import load_job
from batchgen.jobs.redis.keys import Keys
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
        mine = {j["job_id"] for j in dashboard.jobs(conn, keys, who.sees)}
        return [{**p, "jobs": {j: r for j, r in p["jobs"].items() if j in mine}} for p in points]

    @api.get("/api/overview")
    def api_overview(who: Who) -> Any:
        notice = None if who.admin else dashboard.unseen_notice(conn, keys, who.sees)
        return {"now": time.time(), "jobs": dashboard.jobs(conn, keys, who.sees),
                "workers": dashboard.workers(conn, keys),
                "tenants": dashboard.tenants(conn, keys, who.sees), "series": series(who),
                "notice": notice}  # fmt: skip

    @api.get("/api/jobs")
    def api_jobs(who: Who) -> Any:
        return dashboard.jobs(conn, keys, who.sees)

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
