"""Prefix-aware dispatch: a fleet of CPU workers on prompts that share long prefixes.

    .venv/bin/python -m benchmarks.prefix_affinity_bench                 # the issue's sizes
    .venv/bin/python -m benchmarks.prefix_affinity_bench --per-prefix 40 --prefix-tokens 256

``--prefixes`` distinct prefixes of ``--prefix-tokens`` tokens, ``--per-prefix`` lines
each with a short question after it, shuffled, one job; a toy checkpoint (built here);
``python -m batchgen.worker.loop`` processes on the CPU, each with a KV pool of
``--kv-blocks`` blocks (16 tokens), room for the requests it runs and a few prefixes,
not all of them. Three runs: one worker (it owns every prefix group), then
``--workers`` workers without affinity (``LoopConfig.prefix_affinity`` off: each takes
the job's requests in input order, as before affinity) and with it. Per run: the
fleet's prefix-hit rate (cached / prompt tokens of the result's rows), each worker's,
each worker's rows (none starved), rows/s, and the workers' CPU seconds per row (a
steadier figure than wall time on a shared machine). Prints a table, then one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import pyarrow.parquet as pq
import redis

from batchgen.jobs.ops.finalize import finalize_tasks as tasks
from batchgen.jobs.ops.job_record import load_job
from batchgen.jobs.ops.submission import submit
from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.redis.redis_server import RedisServer
from batchgen.jobs.schema.sampling import DEFAULTS
from batchgen.toy import write_toy_checkpoint
from batchgen.worker.engine_config import EngineConfig
from batchgen.worker.loop.loop_config import LoopConfig

KEYS = Keys("bg")
WORDS = ["alpha", "river", "stone", "quiet", "market", "yellow", "seven", "paper", "window",
         "garden", "silver", "orbit", "candle", "forest", "harbor", "lemon"]  # fmt: skip


def prefixes(model: Path, count: int, tokens: int, seed: int = 0) -> list[str]:
    """``count`` different texts of ``tokens`` tokens each (the toy tokenizer's)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    rng = random.Random(seed)
    out = []
    for k in range(count):
        text = f"System {k}: " + " ".join(rng.choice(WORDS) for _ in range(tokens))
        out.append(tokenizer.decode(tokenizer.encode(text).ids[:tokens]))
    return out


def write_lines(path: Path, shared: list[str], per_prefix: int, seed: int = 1) -> int:
    lines = [{"id": f"p{k}-{i}", "prompt": f"{text} Question {i}: which word comes next?",
              "max_tokens": 4} for k, text in enumerate(shared) for i in range(per_prefix)]  # fmt: skip
    random.Random(seed).shuffle(lines)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return len(lines)


def run(url: str, model: Path, tmp: Path, workers: int, affinity: bool, src: Path, n: int,
        args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    conn: Any = redis.Redis.from_url(url)
    conn.flushall()
    job_id = f"prefix-{workers}-{'on' if affinity else 'off'}"
    out = tmp / job_id
    submit(conn, KEYS, source_path=str(src), model=str(model), output=str(out),
           defaults=dict(DEFAULTS), job_id=job_id)  # fmt: skip
    engine = EngineConfig(device="cpu", max_num_seqs=args.max_num_seqs,
                          num_kv_blocks=args.kv_blocks, max_model_len=1024)  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BATCHGEN_HOME": str(tmp / "home")}
    procs = []
    start = time.monotonic()
    for k in range(workers):
        config = LoopConfig(model=str(model), name=f"w{k}", redis_url=url, engine=engine,
                            heartbeat_s=1.0, block_ms=200,
                            prefix_affinity=affinity)  # fmt: skip
        proc = subprocess.Popen([sys.executable, "-m", "batchgen.worker.loop"], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)  # fmt: skip
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(config.to_dict()).encode())
        proc.stdin.close()
        procs.append(proc)
    try:
        deadline = start + args.timeout
        while load_job(conn, KEYS, job_id).finished_rows < n:
            assert time.monotonic() < deadline, "the job did not finish in time"
            time.sleep(0.2)
        wall = time.monotonic() - start
        cpu = sum(sum(psutil.Process(p.pid).cpu_times()[:2]) for p in procs)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)
    while load_job(conn, KEYS, job_id).state.value != "completed":
        tasks.run_pending(conn, KEYS, load_job(conn, KEYS, job_id).tag)
        time.sleep(0.1)
    rows = pq.read_table(out / "result.parquet", columns=["prompt_tokens", "cached_tokens",
                                                           "worker"]).to_pylist()  # fmt: skip
    per_worker: dict[str, list[int]] = {}
    for row in rows:
        got = per_worker.setdefault(row["worker"], [0, 0, 0])
        got[0] += row["cached_tokens"]
        got[1] += row["prompt_tokens"]
        got[2] += 1
    cached = sum(c for c, _, _ in per_worker.values())
    prompt = sum(p for _, p, _ in per_worker.values())
    return {
        "workers": workers,
        "affinity": affinity,
        "rows": len(rows),
        "hit_rate": round(cached / prompt, 3),
        "worker_hit_rates": {w: round(c / p, 3) for w, (c, p, _) in sorted(per_worker.items())},
        "worker_rows": {w: k for w, (_, _, k) in sorted(per_worker.items())},
        "wall_s": round(wall, 1),
        "rows_per_s": round(len(rows) / wall, 1),
        "cpu_s_per_row": round(cpu / len(rows), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=512)
    parser.add_argument("--per-prefix", type=int, default=250)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--kv-blocks", type=int, default=224)
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="batchgen-prefix-") as folder:
        tmp = Path(folder)
        model = tmp / "toy"
        write_toy_checkpoint(model, arch="llama", size="tiny")
        src = tmp / "prompts.jsonl"
        n = write_lines(src, prefixes(model, args.prefixes, args.prefix_tokens), args.per_prefix)
        server = RedisServer(tmp / "redis")
        server.start()
        try:
            plan = [(1, True), (args.workers, False), (args.workers, True)]
            runs = [run(server.url, model, tmp, w, a, src, n, args) for w, a in plan]
        finally:
            server.kill()
    print(f"{args.prefixes} prefixes x {args.per_prefix} lines ({args.prefix_tokens} tokens "
          f"each), shuffled; KV pool {args.kv_blocks} blocks a worker")  # fmt: skip
    print(f"{'workers':>7} {'affinity':>8} {'hit rate':>9} {'per worker':>14} "
          f"{'rows a worker':>14} {'rows/s':>7} {'cpu s/row':>10}")  # fmt: skip
    for r in runs:
        rates, counts = r["worker_hit_rates"].values(), r["worker_rows"].values()
        spread = f"{min(rates):.3f}..{max(rates):.3f}"
        rows = f"{min(counts)}..{max(counts)}"
        print(f"{r['workers']:>7} {'on' if r['affinity'] else 'off':>8} {r['hit_rate']:>9.3f} "
              f"{spread:>14} {rows:>14} {r['rows_per_s']:>7} {r['cpu_s_per_row']:>10}")  # fmt: skip
    print(json.dumps({"settings": vars(args), "runs": runs, "load_avg_before": load_before,
                      "load_avg_after": os.getloadavg()}))  # fmt: skip


if __name__ == "__main__":
    main()
