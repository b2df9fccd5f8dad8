"""The result cache's payoff: a rerun where 90% of the rows were generated before.

    .venv/bin/python benchmarks/cache_bench.py                       # 2000 rows, 90% unchanged
    .venv/bin/python benchmarks/cache_bench.py --rows 500 --reused 0.5 --max-tokens 16

A tiny toy checkpoint on CPU, a private redis-server (AOF everysec) in a temp
dir, one in-process queue loop per job on one warm engine (one untimed warm-up
job first). Job "first": ``--rows`` distinct greedy prompts with ``--cache``
(every row a miss, generated and stored). Job "rerun": the same number of rows,
``--reused`` of them the first job's prompts and the rest new, also with
``--cache``. Each job's wall time runs from submit until its result.parquet is
written (submit, the loop, finalize). Also reported: the rerun's rows served
from the cache and the rows the engine generated, the time each job spent in
the cache's lookups and stores, and the same rerun without ``--cache`` as a
reference (it runs last, so the engine's prefix cache may still hold some of
the reused prompts). Prints a table, then one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import pyarrow.parquet as pq  # noqa: E402
import redis  # noqa: E402

from batchgen.jobs.ops.finalize import finalize_tasks as tasks  # noqa: E402
from batchgen.jobs.ops.job_record import load_job  # noqa: E402
from batchgen.jobs.ops.lifecycle import JobState  # noqa: E402
from batchgen.jobs.ops.submission import submit  # noqa: E402
from batchgen.jobs.redis.keys import Keys  # noqa: E402
from batchgen.jobs.redis.redis_server import RedisServer  # noqa: E402
from batchgen.jobs.schema.sampling import DEFAULTS  # noqa: E402
from batchgen.jobs.storage.result_cache import ResultCache  # noqa: E402
from batchgen.worker.engine_config import EngineConfig  # noqa: E402
from batchgen.worker.loop import LoopConfig, QueueLoop  # noqa: E402
from batchgen.worker.loop.engine_api import EngineAPI, load_engine  # noqa: E402

KEYS = Keys("bench")
ENGINE = EngineConfig(device="cpu")
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "river",
    "stone",
    "cloud",
    "paper",
    "lamp",
    "orbit",
    "cedar",
    "pixel",
    "harbor",
]


IN_CACHE = [0.0]  # seconds the loop spent in the cache's lookups and stores


def _timed(method: Any) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            IN_CACHE[0] += time.perf_counter() - start

    return run


ResultCache.lookup = _timed(ResultCache.lookup)  # type: ignore[method-assign]
ResultCache.store = _timed(ResultCache.store)  # type: ignore[method-assign]


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"{seed}-{i}: " + " ".join(rng.choices(WORDS, k=rng.randint(6, 30))) for i in range(n)]


def run_job(
    conn: redis.Redis, api: EngineAPI, model: Path, tmp: Path, lines: list[str], job_id: str,
    cache: str, max_tokens: int,
) -> dict[str, Any]:  # fmt: skip
    src = tmp / f"{job_id}.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in lines))
    out = tmp / f"out-{job_id}"
    IN_CACHE[0] = 0.0
    start = time.perf_counter()
    submit(conn, KEYS, source_path=str(src), model=str(model), output=str(out),
           defaults={**DEFAULTS, "max_tokens": max_tokens}, job_id=job_id, cache=cache)  # fmt: skip
    config = LoopConfig(model=str(model), name=f"w-{job_id}", prefix=KEYS.prefix,
                        block_ms=20, flush_interval_s=0.5, engine=ENGINE)  # fmt: skip
    loop = QueueLoop(conn, api, config)

    def done() -> bool:
        return load_job(conn, KEYS, job_id).state not in (JobState.QUEUED, JobState.RUNNING)

    loop.run(until=done)
    tasks.run_pending(conn, KEYS, loop.qk.tag)
    wall = time.perf_counter() - start
    table = pq.read_table(out / "result.parquet", columns=["cached", "completion_tokens"])
    cached = sum(table.column("cached").to_pylist())
    return {"job": job_id, "rows": table.num_rows, "wall_s": round(wall, 2),
            "in_cache_s": round(IN_CACHE[0], 2),
            "cached_rows": cached, "generated_rows": loop.counters.get("rows_ok", 0),
            "completion_tokens": sum(table.column("completion_tokens").to_pylist())}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--reused", type=float, default=0.9, help="share of the first job's rows")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from batchgen.toy import write_toy_checkpoint

    reused = int(args.rows * args.reused)
    first_lines = prompts(args.rows, 1)
    rerun_lines = first_lines[:reused] + prompts(args.rows - reused, 2)
    results: dict[str, Any] = {"rows": args.rows, "reused": reused, "max_tokens": args.max_tokens}
    with tempfile.TemporaryDirectory(prefix="batchgen-cache-bench-") as tmpdir:
        tmp = Path(tmpdir)
        model = write_toy_checkpoint(tmp / "tiny", arch="llama", size="tiny")
        api = load_engine(str(model), ENGINE)
        server = RedisServer(tmp / "redis")
        server.start()
        try:
            conn = redis.Redis.from_url(server.url, socket_timeout=60)
            cache = str(tmp / "cache")
            run_job(conn, api, model, tmp, prompts(32, 3), "warmup", "", args.max_tokens)
            first = run_job(conn, api, model, tmp, first_lines, "first", cache, args.max_tokens)
            rerun = run_job(conn, api, model, tmp, rerun_lines, "rerun", cache, args.max_tokens)
            plain = run_job(conn, api, model, tmp, rerun_lines, "plain", "", args.max_tokens)
        finally:
            server.kill()
    results.update(first=first, rerun=rerun, rerun_without_cache=plain,
                   rerun_speedup=round(first["wall_s"] / rerun["wall_s"], 2))  # fmt: skip
    print(f"{'job':<22} {'rows':>6} {'cached':>7} {'generated':>10} {'wall s':>8} "
          f"{'in cache s':>11}")  # fmt: skip
    for name, r in (("first (--cache)", first), ("rerun (--cache)", rerun),
                    ("rerun without --cache", plain)):  # fmt: skip
        print(f"{name:<22} {r['rows']:>6} {r['cached_rows']:>7} {r['generated_rows']:>10} "
              f"{r['wall_s']:>8.2f} {r['in_cache_s']:>11.2f}")  # fmt: skip
    print(f"rerun speedup over the first run: {results['rerun_speedup']:.2f}x")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
