"""How big a CSV row may be, and which row and column broke that limit.

pyarrow reads CSV in blocks and cannot read a row that spans more than two of
them (its default block is 1 MiB: a 3 MB cell failed the whole submit with
"straddling object straddles two block boundaries"). Blocks here are
``BLOCK_BYTES``, twice a JSONL line's limit, so a row holding a value up to that
limit always reads, and a longer value is its row's error (tables.py), skipped
with --skip-invalid. A row over ``BLOCK_BYTES`` may not read: then a streaming
scan of the files (quotes honoured, memory constant) finds the first such row,
and the error names it (0-based over the data rows of the files in order) and
its longest column.
"""

from __future__ import annotations

import csv
import re

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.dataset as ds
import pyarrow.fs as pafs

from batchgen.jobs.intake.lines import MAX_LINE_BYTES
from batchgen.jobs.schema.errors import UsageError

BLOCK_BYTES = 2 * MAX_LINE_BYTES
SCAN_CHUNK = 1 << 20
_SPECIAL = re.compile(rb'[",\n]')


def csv_format() -> ds.CsvFileFormat:
    return ds.CsvFileFormat(read_options=pacsv.ReadOptions(block_size=BLOCK_BYTES))


def is_row_too_long(exc: Exception) -> bool:
    return "straddl" in str(exc)


def row_too_long(fs: pafs.FileSystem, files: list[str]) -> UsageError:
    """The error for a CSV row too long to read, naming the first row over BLOCK_BYTES."""
    first = 0
    for path in files:
        with fs.open_input_stream(path) as src:
            found, rows, header_end = _long_row(src, BLOCK_BYTES)
        if found is not None:
            row, field = found
            names = _header(fs, path, header_end)
            column = names[field] if field < len(names) else f"#{field + 1}"
            return UsageError(
                f"row {first + row}, column {column}: the row is over {BLOCK_BYTES:,} bytes, "
                f"the most a CSV row may hold (a value may hold {MAX_LINE_BYTES:,}); shorten "
                "it or leave the row out"
            )
        first += rows
    return UsageError(f"a CSV row is too long to read (over {BLOCK_BYTES:,} bytes); shorten it")


def _header(fs: pafs.FileSystem, path: str, size: int) -> list[str]:
    """The column names of a CSV file whose header is its first ``size`` bytes."""
    if not 0 < size <= SCAN_CHUNK:
        return []
    with fs.open_input_stream(path) as src:
        line = bytes(src.read(size)).decode("utf-8", "replace")
    return next(csv.reader([line.rstrip("\r\n")]), [])


def _long_row(src: pa.NativeFile, limit: int) -> tuple[tuple[int, int] | None, int, int]:
    """((data row, its longest field) of the first row over ``limit`` bytes, or None;
    the data rows seen; the header's size in bytes)."""
    row = -1  # the header
    quoted = False
    field = longest = longest_len = 0
    field_start = row_start = offset = header_end = 0
    while chunk := src.read(SCAN_CHUNK):
        for match in _SPECIAL.finditer(chunk):
            at = offset + match.start()
            char = chunk[match.start()]
            if char == 0x22:  # '"' opens or closes a quoted value ('""' does both)
                quoted = not quoted
                continue
            if quoted:
                continue
            if at - field_start > longest_len:
                longest, longest_len = field, at - field_start
            if char == 0x2C:  # ','
                field, field_start = field + 1, at + 1
                continue
            if at - row_start > limit:  # '\n': the row ends
                return (max(row, 0), longest), row, header_end
            row, field, longest, longest_len = row + 1, 0, 0, 0
            field_start = row_start = at + 1
            header_end = header_end or row_start
        offset += len(chunk)
    if offset - row_start > limit:  # a last row without a newline
        return (max(row, 0), longest), row, header_end
    return None, row + (offset > row_start), header_end
