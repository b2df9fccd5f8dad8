"""The final dataset: committed rows read back in input order, one per input, and a manifest.

Only committed parts are read, minus the indices each part's commit record
says it lost, plus the dead-letter error rows; an index without a row is
filled (``cancelled`` for a cancelled job, else a ``lost`` error row). Rows are
read in index windows so memory stays bounded for huge jobs. A job's kept input
columns (kept.py) are joined on, window by window, after the generation columns.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import redis

import batchgen
from batchgen.jobs.environment import FINALIZE_WINDOW_BYTES
from batchgen.jobs.intake.kept import Snapshot
from batchgen.jobs.ops.job_record import JobRecord
from batchgen.jobs.ops.lifecycle import JobState
from batchgen.jobs.redis.keys import QueueKeys, text, text_hash
from batchgen.jobs.schema.rows import SCHEMA, FinishReason, Row, conform, from_dict, to_table
from batchgen.jobs.storage.output_store import OutputDir

log = logging.getLogger(__name__)

RESULT = "result.parquet"
MANIFEST = "manifest.json"
WINDOW_ROWS = 1 << 20
WINDOW_BYTES = int(FINALIZE_WINDOW_BYTES.default)  # rows held in memory at once (about)
LOST = "lost: the queue entry was deleted before a row was committed (was the stream trimmed?)"


@dataclass(slots=True)
class PartRecord:
    name: str
    rows: int
    lo: int
    hi: int
    lost: frozenset[int] = field(default_factory=frozenset)
    nbytes: int = 0  # its rows' size in memory

    @classmethod
    def parse(cls, name: object, raw: object) -> PartRecord:
        data = json.loads(text(raw))
        lost = data.get("lost") or []
        return cls(text(name), int(data["rows"]), int(data["lo"]), int(data["hi"]),
                   frozenset(lost if isinstance(lost, list) else []),
                   int(data.get("bytes") or 0))  # fmt: skip


@dataclass(slots=True)
class Counts:
    rows: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)
    filled: int = 0  # rows finalize made up (lost or cancelled before running)


def committed_parts(conn: redis.Redis, qk: QueueKeys, job_id: str) -> list[PartRecord]:
    raw = conn.hgetall(qk.job(job_id).parts)
    return sorted((PartRecord.parse(k, v) for k, v in raw.items()), key=lambda p: p.lo)


def error_rows(conn: redis.Redis, qk: QueueKeys, job_id: str) -> dict[int, Row]:
    raw = conn.hgetall(qk.job(job_id).errors)
    return {int(k): from_dict(json.loads(v)) for k, v in text_hash(raw).items()}


def plan_windows(
    parts: list[PartRecord], total: int, budget_bytes: int, max_rows: int = WINDOW_ROWS
) -> list[tuple[int, int]]:
    """Index ranges [lo, hi) covering 0..total in order, each needing at most about
    ``budget_bytes`` of rows in memory: every part overlapping a window is read whole.

    A window ends before the first part (by its lowest index) that would push it
    over the budget, but takes at least one, so a part bigger than the budget gets
    a window of its own; at most ``max_rows`` indices (rows that finalize fills).
    """
    by_lo = sorted(parts, key=lambda p: p.lo)
    out: list[tuple[int, int]] = []
    start, i = 0, 0
    while start < max(total, 1):
        memory = sum(p.nbytes for p in by_lo[:i] if p.hi >= start)  # reaching in from before
        taken = False
        while i < len(by_lo):
            j = i
            while j < len(by_lo) and by_lo[j].lo == by_lo[i].lo:
                j += 1
            size = sum(p.nbytes for p in by_lo[i:j])
            if (taken and memory + size > budget_bytes) or by_lo[i].lo >= start + max_rows:
                break
            memory, i, taken = memory + size, j, True
        end = by_lo[i].lo if i < len(by_lo) else total
        end = min(max(end, start + 1), start + max_rows, max(total, 1))
        out.append((start, end))
        start = end
    return out


def read_window(
    out: OutputDir, parts: list[PartRecord], lo: int, hi: int, errors: dict[int, Row]
) -> pa.Table:
    """Committed winning rows with lo <= index < hi, sorted, one per index at most."""
    tables = []
    for part in parts:
        if part.hi < lo or part.lo >= hi:
            continue
        with out.open_input(*part.name.split("/")) as src:
            table = conform(pq.read_table(src, schema=SCHEMA))
        index = table.column("index")
        keep = pc.and_(pc.greater_equal(index, lo), pc.less(index, hi))
        if part.lost:
            lost = pa.array(sorted(part.lost), type=pa.int64())
            keep = pc.and_(keep, pc.invert(pc.is_in(index, value_set=lost)))
        tables.append(table.filter(keep))
    extra = [row for i, row in errors.items() if lo <= i < hi]
    if extra:
        tables.append(to_table(extra))
    if not tables:
        return SCHEMA.empty_table()
    merged = pa.concat_tables(tables).sort_by("index")
    return _first_per_index(merged)


def _first_per_index(table: pa.Table) -> pa.Table:
    index = table.column("index").to_numpy()
    if len(index) < 2 or (index[1:] != index[:-1]).all():
        return table
    log.error("duplicate committed rows for one index; keeping the first (a bug)")
    keep = [0] + [i for i in range(1, len(index)) if index[i] != index[i - 1]]
    return table.take(pa.array(keep))


def _fill(table: pa.Table, lo: int, hi: int, cancelled: bool) -> tuple[pa.Table, int]:
    present = set(table.column("index").to_pylist())
    if len(present) == hi - lo:
        return table, 0
    reason = FinishReason.CANCELLED if cancelled else FinishReason.ERROR
    error = "cancelled before it ran" if cancelled else LOST
    now = int(time.time() * 1000)
    filler = [
        Row(index=i, finish_reason=reason, error=error, finished_at=now)
        for i in range(lo, hi)
        if i not in present
    ]
    return pa.concat_tables([table, to_table(filler)]).sort_by("index"), len(filler)


def write_result(
    out: OutputDir,
    record: JobRecord,
    parts: list[PartRecord],
    errors: dict[int, Row],
    window_bytes: int = WINDOW_BYTES,
) -> Counts:
    """Stream the result into ``out``: window by window (``plan_windows``), never whole."""
    cancelled = record.state == JobState.CANCELLING
    counts = Counts()
    kept = Snapshot(out) if record.kept_columns else None
    schema, max_rows = SCHEMA, WINDOW_ROWS
    if kept is not None:  # its rows count against the window's memory too
        schema = pa.schema([*SCHEMA, *kept.schema])
        max_rows = kept.window_rows(window_bytes, WINDOW_ROWS)
    with out.writing(RESULT) as sink, pq.ParquetWriter(sink, schema, compression="zstd") as writer:
        for lo, hi in plan_windows(parts, record.total, window_bytes, max_rows):
            table, filled = _fill(read_window(out, parts, lo, hi, errors), lo, hi, cancelled)
            if kept is not None:
                table = kept.join(table, lo, hi)
            counts.filled += filled
            counts.rows += table.num_rows
            for item in pc.value_counts(table.column("finish_reason")).to_pylist():
                reason, n = item["values"], item["counts"]
                counts.by_reason[reason] = counts.by_reason.get(reason, 0) + n
            writer.write_table(table)
    return counts


def manifest(record: JobRecord, counts: Counts, finished_at: float) -> dict[str, Any]:
    return {
        "batchgen_version": batchgen.__version__,
        "job": record.spec(),
        "state": "cancelled" if record.state == JobState.CANCELLING else "completed",
        "model": {"name": record.model, "fingerprint": record.model_fingerprint or None},
        "files": [RESULT],
        "counts": {
            "rows": counts.rows,
            "total": record.total,
            "skipped_invalid_lines": record.skipped,
            "by_finish_reason": dict(sorted(counts.by_reason.items())),
            "filled_by_finalize": counts.filled,
            "retried": record.retried,  # rows `batchgen retry` ran again, every round
            "retry_rounds": record.retry_rounds,
        },
        "tokens": {
            "prompt": record.prompt_tokens,
            "completion": record.completion_tokens,
            "cached": record.cached_tokens,
        },
        "timing": {
            "created_at": record.created_at,
            "started_at": record.started_at or None,
            "finished_at": finished_at,
            "wall_s": round(finished_at - record.created_at, 3),
        },
        "columns": [*SCHEMA.names, *record.kept_columns],
    }
