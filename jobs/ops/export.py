"""download: copy a job's final Parquet out; before completion only with ``partial``.

Only files the manifest lists are served, each a plain name inside the job's
output directory. ``partial`` writes the rows committed so far (in input order,
without filling the missing ones) from a snapshot of the committed parts, with
the job's kept columns (kept.py) as the final file has them.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import redis

from batchgen.jobs.intake.kept import Snapshot
from batchgen.jobs.ops.finalize.result import (
    MANIFEST,
    RESULT,
    WINDOW_BYTES,
    WINDOW_ROWS,
    committed_parts,
    error_rows,
    plan_windows,
    read_window,
)
from batchgen.jobs.ops.job_record import load_job, queue_of_job
from batchgen.jobs.ops.lifecycle import JobState
from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.schema.errors import JobNotReady, OutputError, UsageError
from batchgen.jobs.schema.rows import SCHEMA
from batchgen.jobs.storage.names import check_file_name
from batchgen.jobs.storage.output_store import OutputDir


def destination(job_id: str, dest: str | None, force: bool = False) -> Path:
    """The file ``-o`` names (a folder: ``JOB.parquet`` in it). An existing file is
    refused unless ``force``, and so is a folder that does not exist: a typo there
    should not become a new directory tree, nor a result silently replace another."""
    path = Path(dest) if dest else Path(f"{job_id}.parquet")
    if path.is_dir():
        path = path / f"{job_id}.parquet"
    if path.exists() and not force:
        raise UsageError(f"{path} exists; pass --force to overwrite it, or choose another -o")
    if path.is_dir():
        raise UsageError(f"{path} is a directory")
    parent = path.parent
    if not parent.is_dir():
        raise UsageError(f"the folder {parent} does not exist; create it first (mkdir -p {parent})")
    return path


def download(
    conn: redis.Redis, keys: Keys, job_id: str, dest: str | None = None, partial: bool = False,
    force: bool = False,
) -> tuple[Path, int]:  # fmt: skip
    """(path written, rows); ``dest`` and ``force`` as ``destination`` takes them."""
    record = load_job(conn, keys, job_id)
    target = destination(job_id, dest, force)
    out = OutputDir.open(record.output)
    if record.state in (JobState.COMPLETED, JobState.CANCELLED):
        manifest = json.loads(out.read_bytes(MANIFEST))
        files = [check_file_name(name) for name in manifest.get("files", [])]
        if RESULT not in files:
            raise OutputError(f"the manifest of job {job_id!r} lists no {RESULT}")
        with out.open_input(RESULT) as src, _atomic_local(target) as tmp, open(tmp, "wb") as dst:
            while chunk := src.read(8 << 20):
                dst.write(chunk)
        return target, pq.ParquetFile(target).metadata.num_rows
    if not partial:
        extra = f": {record.error}" if record.error else ""
        raise JobNotReady(
            f"job {job_id!r} is {record.state.value} ({record.finished_rows}/{record.total} rows)"
            f"{extra}; wait for it (batchgen status {job_id} --watch) or pass --partial for "
            "the rows committed so far"
        )
    qk = queue_of_job(conn, keys, job_id)
    parts, errors = committed_parts(conn, qk, job_id), error_rows(conn, qk, job_id)
    rows = 0
    kept = Snapshot(out) if record.kept_columns else None
    schema = pa.schema([*SCHEMA, *kept.schema]) if kept is not None else SCHEMA
    max_rows = kept.window_rows(WINDOW_BYTES, WINDOW_ROWS) if kept is not None else WINDOW_ROWS
    with (
        _atomic_local(target) as tmp,
        pq.ParquetWriter(tmp, schema, compression="zstd") as writer,
    ):
        for lo, hi in plan_windows(parts, record.total, WINDOW_BYTES, max_rows):
            table = read_window(out, parts, lo, hi, errors)
            if kept is not None:
                table = kept.join(table, lo, hi)
            rows += table.num_rows
            writer.write_table(table)
    return target, rows


class _atomic_local:
    """A temp path beside ``target``, renamed onto it when the block succeeds."""

    def __init__(self, target: Path) -> None:
        self.target = target
        self.tmp = target.parent / f".{target.name}.{uuid.uuid4().hex}.tmp"

    def __enter__(self) -> Path:
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            os.replace(self.tmp, self.target)
        elif self.tmp.exists():
            self.tmp.unlink()
