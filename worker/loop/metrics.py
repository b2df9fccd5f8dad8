"""Prometheus text metrics for a supervisor's workers, served over HTTP.

Workers report through their heartbeats (Redis); the supervisor's endpoint
renders the heartbeats of its own workers plus the queue's depth, so one port
covers every engine process on the machine.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

COUNTERS = {
    "rows_ok": ("batchgen_requests_total", 'status="ok"', "Requests finished, by status."),
    "rows_error": ("batchgen_requests_total", 'status="error"', None),
    "dead_lettered": (
        "batchgen_dead_lettered_total",
        "",
        "Entries moved to the dead-letter stream.",
    ),
    "handed_back": (
        "batchgen_handed_back_total",
        "",
        "Requests requeued with their tokens on shutdown.",
    ),
    "reclaimed": ("batchgen_reclaimed_total", "", "Entries claimed from dead workers."),
    "lost_entries": ("batchgen_lost_entries_total", "", "Pending entries found deleted."),
    "prompt_tokens": ("batchgen_prompt_tokens_total", "", "Prompt tokens of finished requests."),
    "generation_tokens": ("batchgen_generation_tokens_total", "", "Generated tokens."),
    "cached_tokens": (
        "batchgen_cached_tokens_total",
        "",
        "Prompt tokens not computed: prefix-cache hits, result-cache rows.",
    ),
    "commits": ("batchgen_commits_total", "", "Atomic commit steps."),
}
# worker counters kept in microseconds, shown in seconds
SECONDS = {
    "engine_us": (
        "batchgen_engine_seconds_total",
        "Engine time of the rows made (each step shared by its requests).",
    ),
}
# a model's committed usage per tenant (jobs/ops/usage.py)
TENANT_COUNTERS = {
    "requests": ("batchgen_tenant_requests_total", 1, "Committed requests, by tenant."),
    "input_tokens": ("batchgen_tenant_input_tokens_total", 1, "Committed input tokens."),
    "cached_tokens": ("batchgen_tenant_cached_tokens_total", 1, "Committed cached input tokens."),
    "output_tokens": ("batchgen_tenant_output_tokens_total", 1, "Committed output tokens."),
    "engine_us": ("batchgen_tenant_engine_seconds_total", 1e-6, "Engine time of committed rows."),
}
GAUGES = {
    "kv_usage": ("batchgen_kv_usage", "KV cache blocks in use (0..1)."),
    "num_running": ("batchgen_num_running", "Requests running in the engine."),
    "num_waiting": ("batchgen_num_waiting", "Requests waiting in the engine."),
    "num_preemptions": ("batchgen_preemptions_total", "Preemptions by the engine."),
    "prefix_cache_hit_rate": ("batchgen_prefix_cache_hit_rate", "Prefix cache hit rate."),
}


def render(
    workers: list[dict[str, Any]],
    queues: dict[str, dict[str, int]],
    usage: dict[str, dict[str, dict[str, int]]] | None = None,
) -> str:
    """``usage``: model -> tenant -> counter (the model's committed usage by tenant)."""
    lines: list[str] = []
    seen: set[str] = set()

    def header(name: str, kind: str, help_text: str | None) -> None:
        if name not in seen:
            seen.add(name)
            lines.append(f"# HELP {name} {help_text or name}")
            lines.append(f"# TYPE {name} {kind}")

    for key, (name, extra, help_text) in COUNTERS.items():
        header(name, "counter", help_text)
        for w in workers:
            labels = f'worker="{w["name"]}"' + (f",{extra}" if extra else "")
            lines.append(f"{name}{{{labels}}} {int(w.get('counters', {}).get(key, 0))}")
    for key, (name, help_text) in SECONDS.items():
        header(name, "counter", help_text)
        for w in workers:
            value = int(w.get("counters", {}).get(key, 0)) / 1e6
            lines.append(f'{name}{{worker="{w["name"]}"}} {value}')
    for key, (name, help_text) in GAUGES.items():
        header(name, "counter" if name.endswith("_total") else "gauge", help_text)
        for w in workers:
            value = w.get("engine", {}).get(key, 0) or 0
            lines.append(f'{name}{{worker="{w["name"]}"}} {float(value)}')
    header("batchgen_in_flight", "gauge", "Requests a worker holds (running or awaiting commit).")
    for w in workers:
        held = sum(w.get("in_flight", {}).values()) + int(w.get("buffered_rows", 0))
        lines.append(f'batchgen_in_flight{{worker="{w["name"]}"}} {held}')
    header("batchgen_queue_entries", "gauge", "Entries in a model's stream (queued + pending).")
    header("batchgen_queue_pending", "gauge", "Entries delivered and not yet acknowledged.")
    header("batchgen_queue_lag", "gauge", "Entries in the stream not yet delivered.")
    header("batchgen_queue_backlog", "gauge", "Requests in the jobs' backlogs, not dispatched.")
    for model, q in queues.items():
        label = f'model="{model}"'
        lines.append(f"batchgen_queue_entries{{{label}}} {q['entries']}")
        lines.append(f"batchgen_queue_pending{{{label}}} {q['pending']}")
        lines.append(f"batchgen_queue_lag{{{label}}} {max(q['entries'] - q['pending'], 0)}")
        lines.append(f"batchgen_queue_backlog{{{label}}} {q.get('backlog', 0)}")
    for key, (name, scale, help_text) in TENANT_COUNTERS.items():
        header(name, "counter", help_text)
        for model, by_tenant in (usage or {}).items():
            for tenant, counts in sorted(by_tenant.items()):
                value = counts.get(key, 0) * scale
                lines.append(f'{name}{{model="{model}",tenant="{tenant}"}} {value:g}')
    return "\n".join(lines) + "\n"


def serve(port: int, snapshot: Callable[[], str]) -> ThreadingHTTPServer:
    """Serve ``snapshot()`` at /metrics on ``port`` in a daemon thread."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            try:
                body = snapshot().encode()
                code = 200
            except Exception as exc:  # Redis down: say so, keep serving
                body, code = f"# metrics unavailable: {exc}\n".encode(), 503
            self.send_response(code)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics").start()
    return server
