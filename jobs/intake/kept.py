"""Kept columns (``--keep-columns``): input columns that come back in result.parquet.

Submit writes them, every row in input order, to a Parquet snapshot
(row k is the output's ``index`` k) in the job's output directory; finalize
reads it back window by window and puts its columns after the generation
columns (result.py). A snapshot, not the input: the input may change or vanish
after submit, and the values never pass through Redis (docs/tables.md,
"Kept columns", has the measurements behind that choice). It stays after
finalize, so finalizing again joins the same values; ``delete --outputs``
removes it.

Types are the input's own (Arrow types unchanged). A kept column whose name the
result already uses (``text``, ``id``, ...) comes back as ``input_<name>``.
"""

from __future__ import annotations

import bisect
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.jobs.schema.errors import UsageError
from batchgen.jobs.schema.rows import SCHEMA
from batchgen.jobs.storage.output_store import OutputDir

KEPT = "kept-columns.parquet"
PREFIX = "input_"
_COPY_CHUNK = 8 << 20


def result_names(columns: list[str]) -> list[str]:
    """Each kept column's name in the result."""
    taken = set(SCHEMA.names)
    out = [PREFIX + c if c in taken else c for c in columns]
    for column, name in zip(columns, out):
        if name in taken or out.count(name) > 1:
            raise UsageError(
                f"--keep-columns: column {column!r} would come back as {name!r}, a name the "
                "result already has; rename one of them in the input"
            )
    return out


class SnapshotWriter:
    """The kept columns of every row (invalid ones too: each has its output row), batch
    by batch, into a spool file."""

    def __init__(self, path: Path, columns: list[str], names: list[str], schema: pa.Schema):
        self.columns = columns
        self.path = path
        self.writer: pq.ParquetWriter | None = None
        if columns:
            fields = [schema.field(c).with_name(n) for c, n in zip(columns, names)]
            self.writer = pq.ParquetWriter(self.path, pa.schema(fields), compression="zstd")
            self.names = names

    def __enter__(self) -> SnapshotWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.writer is not None:
            self.writer.close()

    def write(self, batch: pa.RecordBatch) -> None:
        if self.writer is None:
            return
        part = pa.Table.from_batches([batch.select(self.columns)]).rename_columns(self.names)
        part = part.replace_schema_metadata(None)  # pandas' and the like: not the result's
        self.writer.write_table(part)


def join_parts(parts: list[Path], target: Path) -> None:
    """One snapshot from the parts parallel validators wrote, in order, a row group at a
    time (memory: one row group)."""
    if len(parts) == 1:
        parts[0].rename(target)
        return
    schema = pq.read_schema(parts[0])
    with pq.ParquetWriter(target, schema, compression="zstd") as writer:
        for part in parts:
            source = pq.ParquetFile(part)
            for i in range(source.num_row_groups):
                writer.write_table(source.read_row_group(i))
            part.unlink()


def publish(spool_dir: Path, out: OutputDir) -> None:
    """The spooled snapshot into the job's output directory, whole, unless an earlier
    submit of this same job (same fingerprint, so the same bytes) put it there."""
    if out.exists(KEPT):
        return
    with out.writing(KEPT) as sink, open(spool_dir / KEPT, "rb") as src:
        while chunk := src.read(_COPY_CHUNK):
            sink.write(chunk)


class Snapshot:
    """The kept columns of a job's output, read back by index range."""

    def __init__(self, out: OutputDir) -> None:
        self.file = pq.ParquetFile(out.open_input(KEPT))
        meta = self.file.metadata
        self.starts = [0]
        for i in range(meta.num_row_groups):
            self.starts.append(self.starts[-1] + meta.row_group(i).num_rows)
        size = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
        self.bytes_per_row = size // max(meta.num_rows, 1)
        self.schema = self.file.schema_arrow

    def window_rows(self, window_bytes: int, max_rows: int) -> int:
        """The most indices a window may span so that its kept rows fit the budget too."""
        return max(1, min(max_rows, window_bytes // max(self.bytes_per_row, 1)))

    def join(self, table: pa.Table, lo: int, hi: int) -> pa.Table:
        """``table`` (rows of indices in [lo, hi), sorted; some may be missing, as in a
        partial download) with the kept columns of its rows appended."""
        kept = self.read(lo, hi)
        if table.num_rows != hi - lo:
            kept = kept.take(pc.subtract(table.column("index"), lo))
        for column, values in zip(self.schema, kept.columns):
            table = table.append_column(column, values)
        return table

    def read(self, lo: int, hi: int) -> pa.Table:
        """Rows lo..hi-1 (the indices of a finalize window)."""
        if hi > self.starts[-1]:
            raise ValueError(f"{KEPT} holds {self.starts[-1]} rows, not {hi}")
        first = bisect.bisect_right(self.starts, lo) - 1
        last = bisect.bisect_left(self.starts, hi)
        table = self.file.read_row_groups(list(range(first, last)))
        return table.slice(lo - self.starts[first], hi - lo)
