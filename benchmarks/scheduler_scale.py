"""What the scheduler costs Redis as jobs pile up: N queued jobs on one model (a third
with deadlines, several tenants), on a private redis-server.

    .venv/bin/python -m benchmarks.scheduler_scale                  # N = 100, 1000, 5000
    .venv/bin/python -m benchmarks.scheduler_scale --jobs 100 2000 --calls 200
    .venv/bin/python -m benchmarks.scheduler_scale --jobs 5000 --lines 8 --load

For each N: the Redis time of each dispatch call (a worker asking for 16 requests;
SLOWLOG at a 0 µs threshold records every EVALSHA's time inside Redis), per call and
per dispatched request; the Redis time of each deadline check; and the round-trip
latency of another client's PING meanwhile (p50, p99, max). Jobs are created by the
real create and append-chunk scripts (no files: submit's parsing is not what this
measures), each with ``--lines`` requests. With ``--load``, then everything at once
on the same N (load()): dispatchers, deadline checks, the dashboard's listings and
the PINGs, with tenants of unequal weights, for Redis's latency under load and each
tenant's share. Prints a table (two with ``--load``), then one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import redis

from batchgen.jobs.ops import job_index
from batchgen.jobs.ops.chunk_append import APPEND_CHUNK
from batchgen.jobs.ops.fair_share import backlog, deadlines
from batchgen.jobs.ops.job_record import JobRecord
from batchgen.jobs.ops.lifecycle import CREATE
from batchgen.jobs.redis.keys import Keys, QueueKeys
from batchgen.jobs.redis.redis_server import RedisServer
from batchgen.jobs.redis.stream import ensure_group
from batchgen.jobs.schema.entry import QueuedRequest
from batchgen.jobs.schema.sampling import DEFAULTS
from batchgen.worker.consumer.dispatch import DISPATCH, dispatch

KEYS = Keys("scale")
MODEL = "scale-model"
TENANTS = 4


def populate(conn: redis.Redis, qk: QueueKeys, n: int, lines: int, now: float) -> None:
    """``n`` jobs of ``lines`` requests, tenants t0..t3 in turn (serve's tenants too),
    every third with a deadline between 1 and 24 h from ``now``; in the job index and
    the listings' index (job_index.py) as submit leaves them."""
    ensure_group(conn, qk)
    conn.sadd(KEYS.tenants, *(f"t{t}" for t in range(TENANTS)))
    encoded = [
        QueuedRequest(prompt=f"line {i}", sampling=dict(DEFAULTS)).encode() for i in range(lines)
    ]
    items = backlog.items(enumerate(encoded), queued_ms=int(now * 1000))
    pipe = conn.pipeline(transaction=False)
    for k in range(n):
        job_id = f"j{k:05d}"
        tenant = f"t{k % TENANTS}"
        record = JobRecord(id=job_id, model=MODEL, queue=MODEL, tag=qk.tag, total=lines,
                           tenant=tenant, api_tenant=tenant, cost=20.0,
                           created_at=now + k / 1000)  # fmt: skip
        if k % 3 == 0:
            record.deadline = now + 3600 * (1 + (k * 7919) % 23)
        jk = qk.job(job_id)
        fields = [x for f, v in record.to_hash().items() if f != "state" for x in (f, v)]
        CREATE(pipe, job=jk.job, active=qk.active, job_id=job_id, fields=fields)
        APPEND_CHUNK(pipe, job=jk.job, ready=qk.ready, backlogs=jk.backlogs, job_id=job_id,
                     events=qk.events, start=0, items=items)  # fmt: skip
        pipe.hset(KEYS.jobs, job_id, qk.tag)
        job_index.add(pipe, KEYS, record)
        if k % 200 == 199:
            pipe.execute()
    pipe.execute()


def slowlog_us(conn: redis.Redis, sha: str) -> list[int]:
    """Redis time (µs) of each logged EVALSHA of the script ``sha``, oldest first."""
    entries = conn.slowlog_get(100_000)
    wanted = sha.encode()
    found = [e for e in entries if len(e["command"].split()) > 1
             and e["command"].split()[1] == wanted]  # fmt: skip
    return [int(e["duration"]) for e in reversed(found)]


class Pinger(threading.Thread):
    """Another client: a PING every millisecond, its round trips in ms."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.conn = redis.Redis.from_url(url, socket_timeout=600)
        self.stop = threading.Event()
        self.ms: list[float] = []
        self.busy = 0  # BUSY replies: a script ran past lua-time-limit

    def run(self) -> None:
        while not self.stop.is_set():
            t = time.perf_counter()
            try:
                self.conn.ping()
            except redis.ResponseError:
                self.busy += 1
            self.ms.append((time.perf_counter() - t) * 1000)
            time.sleep(0.001)


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))] if ordered else 0.0


def measure(url: str, n: int, lines: int, calls: int, checks: int) -> dict[str, Any]:
    conn = redis.Redis.from_url(url, socket_timeout=600)
    conn.flushall()
    qk = KEYS.queue_for_model(MODEL)
    now = time.time()
    populate(conn, qk, n, lines, now)
    conn.hset(qk.fair, "work", 0.0)
    deadlines.check(conn, KEYS, qk, now=now)  # the rate's first sample, then 1,000 tokens/s
    conn.hincrbyfloat(qk.fair, "work", 1000.0)
    conn.config_set("slowlog-max-len", 100_000)
    conn.config_set("slowlog-log-slower-than", 0)
    conn.slowlog_reset()
    pinger = Pinger(url)
    pinger.start()
    time.sleep(0.2)
    dispatched = 0
    for c in range(calls):
        dispatched += len(dispatch(conn, qk, f"w{c % 4}", 16, None))
    for k in range(checks):
        deadlines.check(conn, KEYS, qk, now=now + 1 + k)
    time.sleep(0.2)
    pinger.stop.set()
    pinger.join()
    conn.config_set("slowlog-log-slower-than", 10_000)
    dispatch_us = slowlog_us(conn, DISPATCH.script.sha)
    check_us = slowlog_us(conn, deadlines.CHECK.script.sha)
    return {
        "jobs": n, "dispatch_calls": len(dispatch_us), "dispatched": dispatched,
        "dispatch_ms_median": statistics.median(dispatch_us) / 1000,
        "dispatch_ms_max": max(dispatch_us) / 1000,
        "dispatch_us_per_request": sum(dispatch_us) / max(dispatched, 1),
        "check_ms_median": statistics.median(check_us) / 1000,
        "check_ms_max": max(check_us) / 1000,
        "ping_ms_p50": pct(pinger.ms, 0.5), "ping_ms_p99": pct(pinger.ms, 0.99),
        "ping_ms_max": max(pinger.ms), "pings": len(pinger.ms),
        "busy_replies": pinger.busy,
    }  # fmt: skip


WEIGHTS = (1.0, 1.0, 2.0, 4.0)  # tenants t0..t3 in the load test


def _dispatcher(url: str, name: str, target: int, taken: Any, stop: Any) -> None:
    """A worker's dispatch calls, 16 requests each, counting each tenant's requests
    (``taken``, shared), until ``target`` requests are dispatched or none are left."""
    conn = redis.Redis.from_url(url, socket_timeout=600)
    qk = KEYS.queue_for_model(MODEL)
    while not stop.is_set():
        got = dispatch(conn, qk, name, 16, None)
        with taken.get_lock():
            for _, fields in got:
                taken[int(fields[b"j"].decode()[1:]) % TENANTS] += 1
            if sum(taken) >= target or not got:
                stop.set()


def _pinger(url: str, stop: Any, out: Any) -> None:
    """Another client in a process of its own: a PING every millisecond; sends its round
    trips (ms) and the BUSY replies it got."""
    pinger = Pinger(url)
    pinger.start()
    stop.wait()
    pinger.stop.set()
    pinger.join()
    out.send((pinger.ms, pinger.busy))


def load(url: str, n: int, lines: int, workers: int, share: float) -> dict[str, Any]:
    """Everything at once on ``n`` jobs: ``workers`` processes dispatching 16 requests
    a call, a deadline check a second and the dashboard's listings every 2 s (an
    admin's page and a tenant's, 200 jobs each), another client's PING every
    millisecond (a process of its own); until ``share`` of the requests are
    dispatched (before the heaviest tenant's backlog runs out, so every tenant
    competes throughout). Tenants t0..t3 weigh WEIGHTS: each one's share of the
    dispatched requests (all of one cost) against its weight's."""
    from batchgen.serve import dashboard
    from batchgen.serve.api_keys import Principal

    conn = redis.Redis.from_url(url, socket_timeout=600)
    conn.flushall()
    qk = KEYS.queue_for_model(MODEL)
    now = time.time()
    populate(conn, qk, n, lines, now)
    for t, weight in enumerate(WEIGHTS):
        conn.hset(qk.fair, f"w:t{t}", repr(weight))
    conn.config_set("slowlog-max-len", 1_000_000)
    conn.config_set("slowlog-log-slower-than", 0)
    conn.slowlog_reset()
    ctx = multiprocessing.get_context("fork")
    taken, stop = ctx.Array("l", TENANTS), ctx.Event()
    ping_out, ping_in = ctx.Pipe(duplex=False)
    pinger = ctx.Process(target=_pinger, args=(url, stop, ping_in))
    pinger.start()
    time.sleep(0.2)
    target = int(n * lines * share)
    procs = [ctx.Process(target=_dispatcher, args=(url, f"w{i}", target, taken, stop))
             for i in range(workers)]  # fmt: skip
    start = time.perf_counter()
    for proc in procs:
        proc.start()
    checks, listings = 0, []
    while not stop.wait(1.0):
        deadlines.check(conn, KEYS, qk)
        checks += 1
        if checks % 2 == 0:
            began = time.perf_counter()
            dashboard.jobs(conn, KEYS, Principal("root", admin=True))
            dashboard.jobs(conn, KEYS, Principal("t1"))
            listings.append((time.perf_counter() - began) * 1000)
    elapsed = time.perf_counter() - start
    for proc in procs:
        proc.join()
    ping_ms, busy = ping_out.recv()
    pinger.join()
    conn.config_set("slowlog-log-slower-than", 10_000)
    scripts = {DISPATCH.script.sha: "dispatch", deadlines.CHECK.script.sha: "deadline check"}
    entries = [e for e in conn.slowlog_get(1_000_000)
               if e["command"].split()[0].upper() not in (b"SLOWLOG", b"CONFIG")]  # fmt: skip
    slowest: Any = max(entries, key=lambda e: e["duration"])
    words = slowest["command"].split()
    named = scripts.get(words[1].decode(), "") if len(words) > 1 else ""
    dispatch_us = slowlog_us(conn, DISPATCH.script.sha)
    counts = list(taken[:])
    dispatched = sum(counts)
    shares = [round(x / max(dispatched, 1), 4) for x in counts]
    fair = [w / sum(WEIGHTS) for w in WEIGHTS]
    return {
        "jobs": n, "workers": workers, "dispatched": dispatched, "seconds": round(elapsed, 2),
        "requests_per_s": round(dispatched / elapsed), "shares": shares,
        "fair_shares": [round(f, 4) for f in fair],
        "share_error_max": round(max(abs(s - f) / f for s, f in zip(shares, fair)), 4),
        "dispatch_us_per_request": round(sum(dispatch_us) / max(dispatched, 1)),
        "slowest_command_ms": slowest["duration"] / 1000,
        "slowest_command": named or words[0].decode(),
        "deadline_checks": checks, "listing_ms_max": round(max(listings, default=0.0), 1),
        "ping_ms_p50": pct(ping_ms, 0.5), "ping_ms_p99": pct(ping_ms, 0.99),
        "ping_ms_max": max(ping_ms), "pings": len(ping_ms), "busy_replies": busy,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, nargs="+", default=[100, 1000, 5000])
    parser.add_argument("--lines", type=int, default=4, help="requests a job")
    parser.add_argument("--calls", type=int, default=100, help="dispatch calls of 16 requests")
    parser.add_argument("--checks", type=int, default=10, help="deadline checks")
    parser.add_argument("--load", action="store_true",
                        help="then the load test (load()) at each N")  # fmt: skip
    parser.add_argument("--workers", type=int, default=4,
                        help="the load test's dispatching processes")  # fmt: skip
    parser.add_argument("--share", type=float, default=0.4,
                        help="the load test dispatches this share of the requests")  # fmt: skip
    args = parser.parse_args()
    results, loads = [], []
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(tmp, appendonly=False)
        server.start()
        try:
            for n in args.jobs:
                results.append(measure(server.url, n, args.lines, args.calls, args.checks))
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)
                if args.load:
                    loads.append(load(server.url, n, args.lines, args.workers, args.share))
                    print(json.dumps(loads[-1]), file=sys.stderr, flush=True)
        finally:
            server.stop()
    print("| jobs | dispatch ms (median / max) | Redis µs / request | deadline check ms "
          "(median / max) | other client's PING ms (p50 / p99 / max) | BUSY replies |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['jobs']:,} | {r['dispatch_ms_median']:.2f} / {r['dispatch_ms_max']:.2f} | "
              f"{r['dispatch_us_per_request']:.0f} | {r['check_ms_median']:.2f} / "
              f"{r['check_ms_max']:.2f} | {r['ping_ms_p50']:.2f} / {r['ping_ms_p99']:.2f} / "
              f"{r['ping_ms_max']:.2f} | {r['busy_replies']} |")  # fmt: skip
    if loads:
        print()
        print("| jobs | requests/s (dispatched) | tenants' shares (fair: 1/8, 1/8, 2/8, 4/8) | "
              "Redis µs / request | slowest command ms | listing ms max | other client's "
              "PING ms (p50 / p99 / max) | BUSY replies |")  # fmt: skip
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in loads:
            shares = ", ".join(f"{x:.3f}" for x in r["shares"])
            print(f"| {r['jobs']:,} | {r['requests_per_s']:,} ({r['dispatched']:,}) | {shares} "
                  f"(off by {100 * r['share_error_max']:.1f}% at most) | "
                  f"{r['dispatch_us_per_request']} | {r['slowest_command_ms']:.1f} "
                  f"({r['slowest_command']}) | "
                  f"{r['listing_ms_max']:.0f} | {r['ping_ms_p50']:.2f} / {r['ping_ms_p99']:.2f} / "
                  f"{r['ping_ms_max']:.2f} | {r['busy_replies']} |")  # fmt: skip
    print(json.dumps({"results": results, "load": loads}))


if __name__ == "__main__":
    main()
