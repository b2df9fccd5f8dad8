"""Prometheus metrics for a supervisor's workers, served over HTTP.

Workers report through their heartbeats (Redis); at each scrape the supervisor
reads the heartbeats of its own workers plus the queue's depth, so one port
covers every engine process on the machine. prometheus_client writes the
exposition format (it escapes label values: a model path may hold any
character) and its WSGI app answers the scrapes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import redis
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from batchgen.jobs.schema.errors import UsageError

# A worker's heartbeat counters (they only grow while its process lives): counter ->
# (metric, labels besides the worker's, help). Two counters may share a metric.
COUNTERS: dict[str, tuple[str, dict[str, str], str]] = {
    "rows_ok": ("batchgen_requests_total", {"status": "ok"}, "Requests finished, by status."),
    "rows_error": ("batchgen_requests_total", {"status": "error"}, ""),
    "dead_lettered": ("batchgen_dead_lettered_total", {}, "Entries moved to the dead-letter stream."),
    "handed_back": ("batchgen_handed_back_total", {}, "Requests requeued with their tokens on shutdown."),
    "reclaimed": ("batchgen_reclaimed_total", {}, "Entries claimed from dead workers."),
    "lost_entries": ("batchgen_lost_entries_total", {}, "Pending entries found deleted."),
    "prompt_tokens": ("batchgen_prompt_tokens_total", {}, "Prompt tokens of finished requests."),
    "generation_tokens": ("batchgen_generation_tokens_total", {}, "Generated tokens."),
    "reasoning_tokens": (
        "batchgen_reasoning_tokens_total",
        {},
        "Generated tokens that wrote reasoning (rows of jobs with a reasoning parser).",
    ),
    "cached_tokens": (
        "batchgen_cached_tokens_total",
        {},
        "Prompt tokens not computed: prefix-cache hits, result-cache rows.",
    ),
    "commits": ("batchgen_commits_total", {}, "Atomic commit steps."),
    "storage_failures": (
        "batchgen_storage_failures_total",
        {},
        "Failed writes of a job's output part (each retried with backoff).",
    ),
    "redis_outages": (
        "batchgen_redis_outages_total",
        {},
        "Times a worker's loop found Redis unusable (unreachable, or BUSY, OOM, MISCONF, "
        "READONLY, LOADING) and backed off.",
    ),
}  # fmt: skip
# worker counters kept in microseconds, shown in seconds
SECONDS = {
    "engine_us": (
        "batchgen_engine_seconds_total",
        "Engine time of the rows made (each step shared by its requests).",
    ),
}
# the engine's own counters (Engine.stats(), since its process started)
ENGINE_COUNTERS = {
    "num_preemptions": ("batchgen_preemptions_total", "Preemptions by the engine."),
}
# the engine's state now (Engine.stats())
ENGINE_GAUGES = {
    "kv_usage": ("batchgen_kv_usage", "KV cache blocks in use (0..1)."),
    "num_running": ("batchgen_num_running", "Requests running in the engine."),
    "num_waiting": ("batchgen_num_waiting", "Requests waiting in the engine."),
    "prefix_cache_hit_rate": ("batchgen_prefix_cache_hit_rate", "Prefix cache hit rate."),
}
# a model's committed usage per tenant (jobs/ops/usage.py): counter -> (metric, divisor, help)
TENANT_COUNTERS = {
    "requests": ("batchgen_tenant_requests_total", 1, "Committed requests, by tenant."),
    "input_tokens": ("batchgen_tenant_input_tokens_total", 1, "Committed input tokens."),
    "cached_tokens": ("batchgen_tenant_cached_tokens_total", 1, "Committed cached input tokens."),
    "output_tokens": ("batchgen_tenant_output_tokens_total", 1, "Committed output tokens."),
    "engine_us": ("batchgen_tenant_engine_seconds_total", 1e6, "Engine time of committed rows."),
}


def families(
    workers: list[dict[str, Any]],
    queues: dict[str, dict[str, int]],
    usage: dict[str, dict[str, dict[str, int]]] | None = None,
) -> list[Metric]:
    """The metric families of ``workers`` (heartbeats), ``queues`` (model -> depths)
    and ``usage`` (model -> tenant -> counter: the model's committed usage by tenant;
    None: no tenant families at all, the default, since they name every tenant)."""
    counters: dict[str, CounterMetricFamily] = {}
    for key, (name, extra, help_text) in COUNTERS.items():
        if name not in counters:  # the family's first counter gives its help
            counters[name] = CounterMetricFamily(name, help_text, labels=["worker", *extra])
        for w in workers:
            value = int(w.get("counters", {}).get(key, 0))
            counters[name].add_metric([w["name"], *extra.values()], value)
    out: list[Metric] = list(counters.values())
    for key, (name, help_text) in SECONDS.items():
        seconds = CounterMetricFamily(name, help_text, labels=["worker"])
        for w in workers:
            seconds.add_metric([w["name"]], int(w.get("counters", {}).get(key, 0)) / 1e6)
        out.append(seconds)
    engine: list[tuple[type[CounterMetricFamily | GaugeMetricFamily], dict[str, tuple[str, str]]]]
    engine = [(CounterMetricFamily, ENGINE_COUNTERS), (GaugeMetricFamily, ENGINE_GAUGES)]
    for kind, table in engine:
        for key, (name, help_text) in table.items():
            stat = kind(name, help_text, labels=["worker"])
            for w in workers:
                stat.add_metric([w["name"]], float(w.get("engine", {}).get(key, 0) or 0))
            out.append(stat)
    held = GaugeMetricFamily(
        "batchgen_in_flight", "Requests a worker holds (running or awaiting commit).",
        labels=["worker"],
    )  # fmt: skip
    for w in workers:
        held.add_metric(
            [w["name"]], sum(w.get("in_flight", {}).values()) + int(w.get("buffered_rows", 0))
        )
    out.append(held)
    depth = {
        "entries": GaugeMetricFamily(
            "batchgen_queue_entries", "Entries in a model's stream (queued + pending).",
            labels=["model"],
        ),
        "pending": GaugeMetricFamily(
            "batchgen_queue_pending", "Entries delivered and not yet acknowledged.",
            labels=["model"],
        ),
        "lag": GaugeMetricFamily(
            "batchgen_queue_lag", "Entries in the stream not yet delivered.", labels=["model"]
        ),
        "backlog": GaugeMetricFamily(
            "batchgen_queue_backlog", "Requests in the jobs' backlogs, not dispatched.",
            labels=["model"],
        ),
    }  # fmt: skip
    for model, q in queues.items():
        depth["entries"].add_metric([model], q["entries"])
        depth["pending"].add_metric([model], q["pending"])
        depth["lag"].add_metric([model], max(q["entries"] - q["pending"], 0))
        depth["backlog"].add_metric([model], q.get("backlog", 0))
    out += depth.values()
    if usage is None:
        return out
    for key, (name, divisor, help_text) in TENANT_COUNTERS.items():
        tenants = CounterMetricFamily(name, help_text, labels=["model", "tenant"])
        for model, by_tenant in usage.items():
            for tenant, counts in sorted(by_tenant.items()):
                tenants.add_metric([model, tenant], counts.get(key, 0) / divisor)
        out.append(tenants)
    return out


class _Scrape(Collector):
    """A collector whose families are read afresh at each scrape."""

    def __init__(self, read: Callable[[], list[Metric]]) -> None:
        self.read = read

    def collect(self) -> Iterable[Metric]:
        return self.read()


def registry(read: Callable[[], list[Metric]]) -> CollectorRegistry:
    """A registry of its own (not prometheus_client's process-wide one, which
    would add the supervisor's Python and process metrics) holding ``read``."""
    reg = CollectorRegistry()
    reg.register(_Scrape(read))
    return reg


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # no line per scrape
        pass


def serve(port: int, reg: CollectorRegistry, host: str = "127.0.0.1") -> WSGIServer:
    """Serve ``reg`` at /metrics on ``host``:``port`` in a daemon thread; a port that
    cannot be bound is a UsageError. The default host is loopback only: the
    endpoint has no authentication (``worker --metrics-host`` opens it wider).

    A scrape while Redis cannot be read answers 503 and one line, and the next
    one tries again (prometheus_client's own server would answer 500 and print a
    traceback for each)."""
    metrics_app = make_wsgi_app(reg)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        try:
            return metrics_app(environ, start_response)
        except redis.RedisError as exc:
            start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
            return [f"# metrics unavailable: {exc}\n".encode()]

    try:
        server = make_server(host, port, app, ThreadingWSGIServer, handler_class=_Quiet)
    except OSError as exc:  # another process holds the port: one line, before any engine
        raise UsageError(
            f"--metrics-port {port}: cannot listen on {host}:{port}: {exc.strerror or exc}"
        ) from None
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics").start()
    return server
