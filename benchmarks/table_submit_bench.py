"""Submit from a Parquet folder: rows/s and peak RSS, validation + enqueue.

    .venv/bin/python benchmarks/table_submit_bench.py                      # 2M rows
    .venv/bin/python benchmarks/table_submit_bench.py --rows 500000 --keep all
    .venv/bin/python benchmarks/table_submit_bench.py --body-chars 400 --files 8

Writes a folder of Parquet files (``--files`` parts; an id, a title, a body of
``--body-chars`` characters, a per-row ``max_tokens``, a timestamp), then runs
``batchgen submit`` on it with ``--template "Summarise: {title}\\n{body}"`` in a
child process against a private redis-server (AOF everysec, as in production),
and reports the child's peak RSS (the kernel's high-water mark of the largest
process: submit or a validator) and the peak of the RSS summed over submit and
its validator processes (sampled), and the CPU seconds spent by submit, its
validators and redis-server: a rate per CPU second that other load on the
machine changes far less than the wall-clock rate. Prints a table
and, last, one JSON object. Target (issue 14): >= 50k rows/s, peak RSS < 1 GiB.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.jobs.redis.redis_server import RedisServer

TEMPLATE = "Summarise: {title}\n{body}"


def tree_rss_peak(proc: subprocess.Popen) -> int:
    """The peak of the RSS summed over ``proc`` and its children, sampled until it ends
    (shared pages count once per process: an upper bound of what they hold)."""
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        total = 0
        with contextlib.suppress(psutil.NoSuchProcess):
            for process in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    total += process.memory_info().rss
        peak = max(peak, total)
        time.sleep(0.05)
    return peak


def write_folder(folder: Path, rows: int, files: int, body_chars: int) -> int:
    """The input; its size in bytes. Written a slice at a time (bounded memory here too)."""
    folder.mkdir(parents=True)
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "while",
        "seven",
        "small",
        "birds",
        "sing",
    ]
    per_file = -(-rows // files)
    slice_rows = 100_000
    body = (" ".join(words) + " ") * (body_chars // 60 + 1)
    for f in range(files):
        lo, hi = f * per_file, min(rows, (f + 1) * per_file)
        with pq.ParquetWriter(folder / f"part-{f:04d}.parquet", _schema()) as writer:
            for start in range(lo, hi, slice_rows):
                end = min(hi, start + slice_rows)
                n = end - start
                writer.write_table(pa.table({
                    "doc_id": pa.array([f"doc-{i}" for i in range(start, end)]),
                    "title": pa.array([f"{words[i % 14]} {i}" for i in range(start, end)]),
                    "body": pa.array([body[i % 50 : i % 50 + body_chars]
                                      for i in range(start, end)]),
                    "max_tokens": pa.array([16 + i % 8 for i in range(start, end)], pa.int64()),
                    "published": pa.array([1_700_000_000_000 + i for i in range(start, end)],
                                          pa.timestamp("ms")),
                }, schema=_schema()), row_group_size=n)  # fmt: skip
    return sum(p.stat().st_size for p in folder.iterdir())


def _schema() -> pa.Schema:
    return pa.schema([("doc_id", pa.string()), ("title", pa.string()), ("body", pa.string()),
                      ("max_tokens", pa.int64()), ("published", pa.timestamp("ms"))])  # fmt: skip


def submit_once(
    folder: Path, url: str, out: Path, keep: str | None
) -> tuple[float, float, float, float, str]:
    """(wall seconds, peak RSS MiB of the submit process, peak RSS MiB summed over it and
    its validator processes (sampled every 50 ms), their CPU seconds, its stdout)."""
    args = [sys.executable, "-m", "batchgen", "submit", str(folder), "--model", "bench",
            "--output", str(out), "--template", TEMPLATE, "--id-column", "doc_id",
            "--sampling-columns", "max_tokens", "--redis", url, "--json"]  # fmt: skip
    if keep:
        args += ["--keep-columns", keep]
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tree_peak = tree_rss_peak(proc)
    wall = time.perf_counter() - start
    stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"submit failed: {stderr}")
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # submit and its validators
    cpu = usage.ru_utime + usage.ru_stime
    return wall, usage.ru_maxrss / 1024, tree_peak / (1 << 20), cpu, stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--body-chars", type=int, default=200)
    parser.add_argument("--keep", default=None, help="--keep-columns for the submit")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="batchgen-table-bench-") as tmp:
        root = Path(tmp)
        size = write_folder(root / "input", args.rows, args.files, args.body_chars)
        server = RedisServer(root / "redis")
        server.start()
        redis_cpu_s = 0.0
        try:
            redis_cpu = psutil.Process(server.process.pid).cpu_times() if server.process else None
            wall, rss, tree, cpu, stdout = submit_once(
                root / "input", server.url, root / "out", args.keep
            )
            if server.process:
                after = psutil.Process(server.process.pid).cpu_times()
                redis_cpu_s = (
                    after.user
                    + after.system
                    - (redis_cpu.user + redis_cpu.system if redis_cpu else 0)
                )
        finally:
            server.kill()
    result = json.loads(stdout)
    assert result["total"] == args.rows, result
    report = {
        "rows": args.rows, "input_mb": round(size / 1e6, 1), "files": args.files,
        "keep_columns": args.keep, "wall_s": round(wall, 2),
        "rows_per_s": round(args.rows / wall), "peak_rss_mib": round(rss, 1),
        "peak_rss_tree_mib": round(tree, 1), "submit_cpu_s": round(cpu, 2),
        "redis_cpu_s": round(redis_cpu_s, 2),
        "rows_per_cpu_s": round(args.rows / (cpu + redis_cpu_s)), "cpus": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }  # fmt: skip
    for name, value in report.items():
        print(f"{name:<16} {value}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
