"""A prompts file as numbered lines: LF or CRLF ends, a UTF-8 BOM at its start,
blank lines skipped (they still count), and a limit on a line's length that
holds however long a line runs: the rest of a longer one is skipped in bounded
reads, never held, and reported with its size."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

MAX_LINE_BYTES = 8 << 20  # a line's content (without its end) is read at most this far
_BOM = b"\xef\xbb\xbf"
_SKIP_CHUNK = 1 << 20


@dataclass(slots=True)
class LineError:
    line: int
    column: int
    message: str
    row_id: str | None = None  # the id the line carried, when it parsed and had a valid one

    def __str__(self) -> str:
        return f"line {self.line}, column {self.column}: {self.message}"


@dataclass(slots=True)
class RowError:
    """A table row's error (tables.py): its 0-based row and the column at fault."""

    row: int
    column: str | None  # None: the row as a whole (a template's prompt)
    message: str
    row_id: str | None = None  # the row's id column's value, when a valid id

    def __str__(self) -> str:
        where = f", column {self.column}" if self.column is not None else ""
        return f"row {self.row}{where}: {self.message}"


InputError = LineError | RowError


def read_lines(
    stream: BinaryIO,
    max_line_bytes: int = MAX_LINE_BYTES,
    first_number: int = 1,
    limit: int | None = None,
) -> Iterator[tuple[int, bytes | LineError]]:
    """(line number, content) per non-blank line, or a LineError for one too long.

    Content is the line's bytes without its LF or CRLF end (and without a UTF-8
    BOM at the start of the file); ``max_line_bytes`` limits it. Memory stays
    bounded by that limit: a longer line is skipped in chunks without being
    held. ``first_number``/``limit``: read a range of the file that starts here,
    at line ``first_number``, and ends (at a line boundary) ``limit`` bytes on.
    """
    number = first_number - 1
    consumed = 0
    while limit is None or consumed < limit:
        # the most a line within the limit can take: CRLF, and on line 1 a BOM
        cap = max_line_bytes + 2 + (len(_BOM) if number == 0 else 0)
        raw = stream.readline(cap)
        if not raw:
            return
        consumed += len(raw)
        number += 1
        start = len(_BOM) if number == 1 and raw.startswith(_BOM) else 0
        if len(raw) == cap and not raw.endswith(b"\n"):  # the line goes on: skip the rest
            size, tail = len(raw), raw[-2:]
            while not tail.endswith(b"\n"):
                chunk = stream.readline(_SKIP_CHUNK)
                if not chunk:
                    break
                consumed += len(chunk)
                size += len(chunk)
                tail = (tail + chunk[-2:])[-2:]
            yield number, _too_long(number, size - start - _line_end(tail), max_line_bytes)
            continue
        end = len(raw) - _line_end(raw[-2:])
        if end - start > max_line_bytes:
            yield number, _too_long(number, end - start, max_line_bytes)
            continue
        raw = raw[start:end]
        if raw and not raw.isspace():
            yield number, raw


def _line_end(tail: bytes) -> int:
    """Length of the line end that ``tail``, a line's last two bytes, holds."""
    return 2 if tail == b"\r\n" else 1 if tail.endswith(b"\n") else 0


def _too_long(number: int, size: int, max_line_bytes: int) -> LineError:
    return LineError(
        number, 1, f"line is {size:,} bytes, over the limit of {max_line_bytes:,} bytes"
    )
