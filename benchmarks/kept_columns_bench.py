"""Kept columns: through Redis or a snapshot file? The two ways, measured.

    .venv/bin/python benchmarks/kept_columns_bench.py                 # 200k rows
    .venv/bin/python benchmarks/kept_columns_bench.py --rows 50000

Kept values for ``--rows`` rows (an int64, a float64, a ~40-character string, a
list of 3 int32, a timestamp) are stored three ways:

- redis-json: in each queue entry as JSON (as metadata travels today; types lost);
- redis-arrow: one Arrow IPC buffer (zstd) per 2,000-row submit chunk, in a hash;
- snapshot: the Parquet snapshot batchgen writes (kept.py).

For each: bytes per row (Redis: INFO used_memory growth in a private
redis-server; snapshot: file size), the time to store them, and the time to read
them all back in index order (what finalize needs). Then finalize itself
(``write_result``) for a job of that many rows, with and without the snapshot.
Prints a table and, last, one JSON object.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import redis

from batchgen.jobs.intake.kept import KEPT, Snapshot, SnapshotWriter, publish
from batchgen.jobs.ops.finalize.result import PartRecord, write_result
from batchgen.jobs.ops.job_record import JobRecord
from batchgen.jobs.ops.lifecycle import JobState
from batchgen.jobs.redis.redis_server import RedisServer
from batchgen.jobs.schema.rows import FinishReason, Row, to_table
from batchgen.jobs.storage.output_store import OutputDir

CHUNK = 2000


def kept_table(n: int) -> pa.Table:
    base = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)
    return pa.table({
        "doc_id": pa.array(range(n), pa.int64()),
        "score": pa.array([i / 7 for i in range(n)], pa.float64()),
        "title": [f"title number {i} of the benchmark set ..." for i in range(n)],
        "tags": pa.array([[i, i + 1, i + 2] for i in range(n)], pa.list_(pa.int32())),
        "published": pa.array([base + dt.timedelta(seconds=i) for i in range(n)],
                              pa.timestamp("ms", tz="UTC")),
    })  # fmt: skip


def used(conn: redis.Redis) -> int:
    return int(conn.info("memory")["used_memory"])


def redis_json(conn: Any, table: pa.Table) -> dict[str, float]:
    before = used(conn)
    start = time.perf_counter()
    for lo in range(0, table.num_rows, CHUNK):
        pipe = conn.pipeline(transaction=False)
        for row in table.slice(lo, CHUNK).to_pylist():
            pipe.xadd("s", {"j": "job", "r": json.dumps(row, default=str)})
        pipe.execute()
    stored = time.perf_counter() - start
    grown = used(conn) - before
    start = time.perf_counter()
    rows = [json.loads(f[b"r"]) for _, f in conn.xrange("s")]
    read = time.perf_counter() - start
    assert len(rows) == table.num_rows
    conn.delete("s")
    return {"bytes_per_row": grown / table.num_rows, "store_s": stored, "read_s": read}


def redis_arrow(conn: Any, table: pa.Table) -> dict[str, float]:
    before = used(conn)
    start = time.perf_counter()
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    for lo in range(0, table.num_rows, CHUNK):
        sink = pa.BufferOutputStream()
        part = table.slice(lo, CHUNK)
        with pa.ipc.new_stream(sink, part.schema, options=options) as writer:
            writer.write_table(part)
        conn.hset("kept", str(lo), sink.getvalue().to_pybytes())
    stored = time.perf_counter() - start
    grown = used(conn) - before
    start = time.perf_counter()
    parts = [
        pa.ipc.open_stream(conn.hget("kept", str(lo))).read_all()
        for lo in range(0, table.num_rows, CHUNK)
    ]
    back = pa.concat_tables(parts)
    read = time.perf_counter() - start
    assert back.equals(table)
    conn.delete("kept")
    return {"bytes_per_row": grown / table.num_rows, "store_s": stored, "read_s": read}


def snapshot(tmp: Path, table: pa.Table) -> dict[str, float]:
    spool = tmp / "spool"
    spool.mkdir()
    out = OutputDir.open(str(tmp / "out"))
    start = time.perf_counter()
    names = table.schema.names
    with SnapshotWriter(spool / KEPT, names, names, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=16_384):
            writer.write(batch)
    publish(spool, out)
    stored = time.perf_counter() - start
    start = time.perf_counter()
    back = Snapshot(out).read(0, table.num_rows)
    read = time.perf_counter() - start
    assert back.equals(table.combine_chunks())
    size = (tmp / "out" / KEPT).stat().st_size
    return {"bytes_per_row": size / table.num_rows, "store_s": stored, "read_s": read}


def finalize(tmp: Path, n: int, kept: list[str]) -> float:
    """write_result's wall time for an n-row job (parts of 10k rows already committed)."""
    out = OutputDir.open(str(tmp / "out"))
    parts_dir = tmp / "out" / "parts" / "job"
    if not parts_dir.exists():
        parts_dir.mkdir(parents=True)
        for lo in range(0, n, 10_000):
            rows = [Row(index=i, id=str(i), text=f"generated text {i}", token_ids=[1, 2, 3, 4],
                        finish_reason=FinishReason.STOP, prompt_tokens=9, completion_tokens=4)
                    for i in range(lo, min(n, lo + 10_000))]  # fmt: skip
            pq.write_table(to_table(rows), parts_dir / f"{lo}.parquet")
    parts = [PartRecord(f"parts/job/{lo}.parquet", min(10_000, n - lo), lo,
                        min(n, lo + 10_000) - 1, nbytes=2_000_000) for lo in range(0, n, 10_000)]  # fmt: skip
    record = JobRecord(id="job", state=JobState.RUNNING, total=n, kept_columns=kept)
    start = time.perf_counter()
    write_result(out, record, parts, {})
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    args = parser.parse_args()
    table = kept_table(args.rows)
    with tempfile.TemporaryDirectory(prefix="batchgen-kept-bench-") as name:
        tmp = Path(name)
        server = RedisServer(tmp / "redis")
        server.start()
        try:
            conn = redis.Redis.from_url(server.url)
            results = {"redis-json": redis_json(conn, table),
                       "redis-arrow": redis_arrow(conn, table)}  # fmt: skip
        finally:
            server.kill()
        results["snapshot"] = snapshot(tmp, table)
        plain = finalize(tmp, args.rows, [])
        joined = finalize(tmp, args.rows, table.schema.names)
    print(f"{'way':<12} {'bytes/row':>10} {'store s':>8} {'read s':>8}")
    for way, r in results.items():
        print(f"{way:<12} {r['bytes_per_row']:>10.1f} {r['store_s']:>8.2f} {r['read_s']:>8.2f}")
    print(f"finalize {args.rows} rows: {plain:.2f} s without kept columns, {joined:.2f} s with")
    print(json.dumps({"rows": args.rows, **results, "finalize_s": plain,
                      "finalize_with_snapshot_s": joined}))  # fmt: skip


if __name__ == "__main__":
    main()
