"""How far one Redis carries: N worker processes with a zero-cost engine against one
real redis-server on loopback, each request going the whole way (read from the
stream, row into a Parquet part, commit, ack).

    .venv/bin/python -m benchmarks.redis_capacity                    # N = 1, 2, 4, 8
    .venv/bin/python -m benchmarks.redis_capacity --workers 1 4 --requests 20000

For each N: requests/s end to end, and from Redis's own INFO (deltas over the run):
commands and network bytes per request, and the Redis main thread's CPU seconds per
request, less what Redis spends idle (its cron, the benchmark's polling; measured
for 2 s before each run). Redis runs commands on one thread, so ``1 / cpu_s_per_request`` is the rate
at which that thread is saturated: the ceiling of one primary on this machine, what
the sizing table divides by the per-GPU request rate.

A request's cost depends on how many rows share a commit (and a read): a GPU
finishing r requests/s commits about r x flush_interval_s (2 s) rows at a time, so
each per-GPU rate of the table is measured at its own batch (flush_rows and the
engine's capacity set to it): 1 row a commit at 0.5/s, 4 at 2/s, 20 at 10/s.
Prints a table, then one JSON object. Private server, AOF everysec as in
production, in a temp dir.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from batchgen.jobs.ops.job_record import load_job
from batchgen.jobs.ops.lifecycle import JobState
from batchgen.jobs.ops.submission import submit
from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.redis.redis_server import RedisServer
from batchgen.jobs.schema.sampling import DEFAULTS
from batchgen.worker.loop import EngineAPI, LoopConfig, QueueLoop
from benchmarks.pipeline_bench import ZeroEngine, _params, write_prompts

KEYS = Keys("cap")
MODEL = "capacity-null"
PER_GPU = (0.5, 2.0, 10.0)  # requests/s one GPU finishes, for the sizing table


def rows_per_commit(rate: float) -> int:
    """Rows a GPU finishing ``rate`` requests/s brings to each commit: what finished
    within one flush interval (LoopConfig.flush_interval_s), at least one."""
    return max(1, round(rate * LoopConfig(model=MODEL).flush_interval_s))


def _worker(url: str, name: str, batch: int, ready: Any, go: Any, stop: Any) -> None:
    conn = redis.Redis.from_url(url)
    config = LoopConfig(model=MODEL, name=name, prefix=KEYS.prefix, block_ms=100,
                        flush_rows=batch)  # fmt: skip
    loop = QueueLoop(conn, EngineAPI(ZeroEngine(max_num_seqs=batch), _params, ()), config)
    ready.release()
    go.wait()
    loop.run(until=stop.is_set)


def _redis_counters(conn: redis.Redis) -> dict[str, Any]:
    info: Any = conn.info()
    return {
        "commands": info["total_commands_processed"],
        "bytes": info["total_net_input_bytes"] + info["total_net_output_bytes"],
        "cpu_s": info["used_cpu_sys_main_thread"] + info["used_cpu_user_main_thread"],
    }


def run(server: RedisServer, tmp: Path, workers: int, requests: int, batch: int) -> dict[str, Any]:
    conn: Any = redis.Redis.from_url(server.url)
    conn.flushall()
    job_id = f"cap{workers}-{batch}"
    path = tmp / f"{job_id}.jsonl"
    write_prompts(path, requests, seed=workers)
    submit(conn, KEYS, source_path=str(path), model=MODEL, output=str(tmp / job_id),
           defaults=dict(DEFAULTS), job_id=job_id)  # fmt: skip
    ctx = multiprocessing.get_context("fork")
    ready, go, stop = ctx.Semaphore(0), ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=_worker, args=(server.url, f"w{k}", batch, ready, go, stop))
             for k in range(workers)]  # fmt: skip
    for proc in procs:
        proc.start()
    for _ in procs:
        ready.acquire()
    idle = _redis_counters(conn)  # Redis's own upkeep and our polling: not the requests'
    idle_start = time.perf_counter()
    for _ in range(100):
        load_job(conn, KEYS, job_id)
        time.sleep(0.02)
    busy = _redis_counters(conn)
    idle_rate = {k: (busy[k] - idle[k]) / (time.perf_counter() - idle_start) for k in idle}
    conn.config_resetstat()  # commandstats (and the command and byte counts) from here
    before = _redis_counters(conn)
    start = time.perf_counter()
    go.set()
    deadline = start + 600
    while load_job(conn, KEYS, job_id).state in (JobState.QUEUED, JobState.RUNNING):
        assert time.perf_counter() < deadline, "the job did not finish in 600 s"
        time.sleep(0.02)
    elapsed = time.perf_counter() - start
    after = {k: v - idle_rate[k] * elapsed for k, v in _redis_counters(conn).items()}
    stop.set()
    for proc in procs:
        proc.join(60)
    top = sorted(conn.info("commandstats").items(), key=lambda kv: -kv[1]["usec"])[:4]
    record = load_job(conn, KEYS, job_id)
    assert record.done == requests, (record.done, requests)
    redis_cpu = (after["cpu_s"] - before["cpu_s"]) / requests
    return {
        "workers": workers,
        "rows_per_commit": batch,
        "requests": requests,
        "requests_per_s": round(requests / elapsed),
        "commands_per_request": round((after["commands"] - before["commands"]) / requests, 2),
        "bytes_per_request": round((after["bytes"] - before["bytes"]) / requests),
        "redis_cpu_us_per_request": round(redis_cpu * 1e6, 1),
        "redis_ceiling_requests_per_s": round(1 / redis_cpu) if redis_cpu else 0,
        "top_commands_us_per_request": {
            name.removeprefix("cmdstat_"): round(stat["usec"] / requests, 1) for name, stat in top
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--requests", type=int, default=4000)
    args = parser.parse_args()
    batches = {rate: rows_per_commit(rate) for rate in PER_GPU}
    with tempfile.TemporaryDirectory(prefix="batchgen-capacity-") as folder:
        tmp = Path(folder)
        server = RedisServer(tmp / "redis")
        server.start()
        try:
            runs = [run(server, tmp, n, max(500, args.requests * batch // 20), batch)
                    for batch in sorted(set(batches.values())) for n in args.workers]  # fmt: skip
        finally:
            server.kill()
    print(f"{'rows/commit':>11} {'N':>3} {'req/s':>8} {'cmds/req':>9} {'bytes/req':>10} "
          f"{'redis us/req':>13} {'ceiling req/s':>14}")  # fmt: skip
    for r in runs:
        print(f"{r['rows_per_commit']:>11} {r['workers']:>3} {r['requests_per_s']:>8} "
              f"{r['commands_per_request']:>9} {r['bytes_per_request']:>10} "
              f"{r['redis_cpu_us_per_request']:>13} {r['redis_ceiling_requests_per_s']:>14}")  # fmt: skip
    sizing = []
    for rate, batch in batches.items():
        ceiling = min(r["redis_ceiling_requests_per_s"] for r in runs
                      if r["rows_per_commit"] == batch)  # fmt: skip
        sizing.append({"per_gpu_requests_per_s": rate, "rows_per_commit": batch,
                       "ceiling_requests_per_s": ceiling, "gpus": int(ceiling / rate)})  # fmt: skip
        print(
            f"at {rate} requests/s per GPU ({batch} rows a commit): one Redis thread "
            f"saturates at {ceiling} requests/s = {int(ceiling / rate)} GPUs"
        )
    print(json.dumps({"runs": runs, "sizing": sizing}))


if __name__ == "__main__":
    main()
