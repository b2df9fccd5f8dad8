"""What must hold after the soak's storm, checked row by row and key by key."""

from __future__ import annotations

import subprocess
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow.parquet as pq

from batchgen.jobs.redis.keys import GROUP, Keys, QueueKeys
from benchmarks.soak_chaos import JOBS, CancelRecord

if TYPE_CHECKING:
    from benchmarks.soak import SoakResult

FINAL_FILES = ["batchgen-job.json", "manifest.json", "result.parquet"]
OK = ("stop", "length")


def check_world(
    result: SoakResult,
    conn: Any,
    lines: dict[str, list[dict[str, Any]]],
    outputs: dict[str, Path],
    qk: QueueKeys,
    cancel: CancelRecord,
    reference: Callable[[list[dict]], list[list[int]]] | None,
    cli: list[str],
    env: dict[str, str],
) -> None:
    problems = result.problems
    for job in JOBS:
        rows = pq.read_table(outputs[job] / "result.parquet").to_pydict()
        n = len(lines[job])
        result.rows += len(rows["index"])
        result.duplicated += sum(c - 1 for c in Counter(rows["index"]).values() if c > 1)
        made = [reason in OK for reason in rows["finish_reason"]]
        errors = [e for e, r in zip(rows["error"], rows["finish_reason"]) if r == "error"]
        result.error_rows += len(errors)
        result.lost += sum((e or "").startswith("lost") for e in errors)
        # a cancelled row that finalize filled has no id: the request went with its entry
        ids = [line["id"] if ok else None for line, ok in zip(lines[job], made)]
        if rows["index"] != list(range(n)) or rows["id"] != ids:
            problems.append(f"{job}: not one row per line with its id, in input order")
        if errors:
            problems.append(f"{job}: {len(errors)} error rows, e.g. {errors[0][:120]!r}")
        reasons = set(rows["finish_reason"])
        allowed = {*OK, "cancelled"} if job == "cancelled" else set(OK)
        if not reasons <= allowed:
            problems.append(f"{job}: finish reasons {sorted(reasons)}")
        if reference is not None:  # the rows made (a cancelled one has no tokens to compare)
            made_at = [i for i, ok in enumerate(made) if ok]
            expected = reference([lines[job][i] for i in made_at])
            wrong = [i for i, want in zip(made_at, expected) if rows["token_ids"][i] != want]
            if wrong:
                problems.append(f"{job}: {len(wrong)} rows differ from a fault-free run")
        if job == "cancelled":
            result.late_cancelled_rows = _late(rows, cancel)
            if result.late_cancelled_rows:
                problems.append(f"{result.late_cancelled_rows} rows made after the cancel")
        files = sorted(p.name for p in outputs[job].iterdir())
        result.orphan_files += len(set(files) - set(FINAL_FILES))
        if files != FINAL_FILES:
            problems.append(f"{job}: its output holds {files}")
    result.pending_at_end = int(conn.xpending(qk.stream, GROUP)["pending"])
    if result.pending_at_end or conn.xlen(qk.stream):
        problems.append(f"{result.pending_at_end} pending, {conn.xlen(qk.stream)} in the stream")
    for job in JOBS:
        done = subprocess.run([*cli, "delete", job], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            problems.append(f"delete {job}: {done.stderr.strip()}")
    # each job's tombstone stays (status says it was deleted); nothing else may name it
    tombstones = {Keys(qk.prefix).deleted(j) for j in JOBS}
    left = [
        key
        for key, dump in dump_redis(conn).items()
        if key not in tombstones and any(j in key or j in dump for j in JOBS)
    ]
    result.keys_left = len(left)
    if left:
        problems.append(f"keys still mention the jobs after delete: {left[:5]}")


def _late(rows: dict[str, list], cancel: CancelRecord) -> int:
    """Rows made after the cancel beyond the step each worker was in when it applied it."""
    late = 0
    for reason, worker, finished in zip(rows["finish_reason"], rows["worker"], rows["finished_at"]):
        if reason not in OK:
            continue
        made = finished.timestamp() * 1000
        limit = cancel.seen.get(worker, cancel.at_ms)  # a worker killed before it: no later
        late += made > limit + 1
    return late


def dump_redis(conn: Any) -> dict[str, str]:
    """Every key of the Redis behind ``conn`` and a repr of its value."""
    out = {}
    for raw in conn.scan_iter(count=1000):
        key = raw.decode()
        kind = conn.type(key).decode()
        read = {"hash": conn.hgetall, "set": conn.smembers, "stream": conn.xrange,
                "list": lambda k: conn.lrange(k, 0, -1), "zset": lambda k: conn.zrange(k, 0, -1),
                "string": conn.get}  # fmt: skip
        out[key] = repr(read.get(kind, conn.type)(key))
    return out
