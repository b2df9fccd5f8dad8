"""Usage: what jobs and tenants consumed, as the commit step counted it (exactly once).

Per job, on its record: input tokens, cached input tokens (prefix-cache hits, and
every input token of a row the result cache served), output tokens, and engine
time (each engine step's time shared equally by the requests in it). Per tenant,
on each model's ``usage`` hash (``TENANT|counter``), the same counters and the
committed requests; a tenant's usage is the sum over the models. Work thrown
away (a crashed worker's, a request handed back and resumed elsewhere) is not
charged: what is counted is what the committed rows took. A failed row (error,
cancelled) is not billed: its input tokens are counted apart, as
``failed_input_tokens``, and it adds no input, cached or output tokens.
"""

from __future__ import annotations

from typing import Any

import redis

from batchgen.jobs.ops.fair_share import tenants
from batchgen.jobs.ops.job_record import JobRecord
from batchgen.jobs.redis.keys import Keys, QueueKeys, text

COUNTERS = ("requests", "input_tokens", "cached_tokens", "output_tokens", "engine_us",
            "failed_input_tokens")  # fmt: skip


def job_usage(record: JobRecord) -> dict[str, Any]:
    return {
        "input_tokens": record.prompt_tokens,
        "cached_input_tokens": record.cached_tokens,
        "output_tokens": record.completion_tokens,
        "engine_s": round(record.engine_us / 1e6, 3),
        "failed_input_tokens": record.failed_prompt_tokens,
    }


def model_usage(conn: redis.Redis, qk: QueueKeys) -> dict[str, dict[str, int]]:
    """tenant -> its counters on one model ("" is jobs without a tenant)."""
    out: dict[str, dict[str, int]] = {}
    for field, value in conn.hgetall(qk.usage).items():
        tenant, _, counter = text(field).rpartition("|")
        if counter in COUNTERS:
            out.setdefault(tenant, dict.fromkeys(COUNTERS, 0))[counter] = int(value)
    return out


def tenant_usage(conn: redis.Redis, keys: Keys) -> dict[str, dict[str, int]]:
    """tenant -> its counters summed over every model."""
    out: dict[str, dict[str, int]] = {}
    for tag in conn.hkeys(keys.queues):
        for tenant, counts in model_usage(conn, keys.queue(text(tag))).items():
            mine = out.setdefault(tenant, dict.fromkeys(COUNTERS, 0))
            for name, value in counts.items():
                mine[name] += value
    return out


def tenants_report(conn: redis.Redis, keys: Keys) -> list[dict[str, Any]]:
    """Every tenant with settings or usage: its settings, what it holds of its quotas,
    and its usage (``batchgen tenant list``, the dashboard, Prometheus)."""
    used = tenant_usage(conn, keys)
    report = []
    for name in sorted(set(tenants.names(conn, keys)) | set(used)):
        settings = tenants.load(conn, keys, name)
        counts = used.get(name, dict.fromkeys(COUNTERS, 0))
        report.append({
            "tenant": name,
            "weight": settings.weight,
            "max_enqueued_tokens": settings.max_enqueued_tokens,
            "max_jobs": settings.max_jobs,
            "max_priority": settings.max_priority,
            **tenants.holding(conn, keys, name),
            "usage": {
                "requests": counts["requests"],
                "input_tokens": counts["input_tokens"],
                "cached_input_tokens": counts["cached_tokens"],
                "output_tokens": counts["output_tokens"],
                "engine_s": round(counts["engine_us"] / 1e6, 3),
                "failed_input_tokens": counts["failed_input_tokens"],
            },
        })  # fmt: skip
    return report
