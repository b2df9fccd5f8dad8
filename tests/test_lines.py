"""Reading a prompts file as lines: the line limit, line ends, BOM, blank lines."""

from __future__ import annotations

import io
import tracemalloc

import pytest

from batchgen.jobs.intake.lines import LineError, read_lines


def test_bom_crlf_and_blank_lines_are_accepted_and_counted():
    data = b'\xef\xbb\xbf{"prompt": "a"}\r\n\r\n   \n{"prompt": "b"}\r\n{"prompt": "c"}'
    lines = list(read_lines(io.BytesIO(data)))
    assert lines == [(1, b'{"prompt": "a"}'), (4, b'{"prompt": "b"}'), (5, b'{"prompt": "c"}')]


def test_a_50_mb_line_is_rejected_with_memory_bounded(tmp_path):
    path = tmp_path / "big.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"prompt": "first"}\n{"prompt": "')
        for _ in range(50):
            f.write(b"x" * (1 << 20))
        f.write(b'"}\n{"prompt": "last"}\n')
    tracemalloc.start()
    with open(path, "rb") as f:
        lines = list(read_lines(f, max_line_bytes=1 << 20))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 8 << 20, peak  # never the whole 50 MB line
    assert lines[0] == (1, b'{"prompt": "first"}')
    assert lines[2] == (3, b'{"prompt": "last"}')
    error = lines[1][1]
    assert isinstance(error, LineError)
    assert (
        str(error)
        == "line 2, column 1: line is 52,428,814 bytes, over the limit of 1,048,576 bytes"
    )


MAX = 64  # a small line limit for the framing tests below


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        # content at the limit, whatever ends the line (or none)
        (b"a" * MAX + b"\n", [(1, b"a" * MAX)]),
        (b"a" * MAX + b"\r\n" + b"b", [(1, b"a" * MAX), (2, b"b")]),
        (b"\xef\xbb\xbf" + b"a" * MAX + b"\r\nb\n", [(1, b"a" * MAX), (2, b"b")]),
        (b"b\n" + b"a" * MAX, [(1, b"b"), (2, b"a" * MAX)]),
        # one byte over: its size without the line end, the next line read as usual
        (b"a" * (MAX + 1) + b"\r\nb", [(1, "line is 65 bytes"), (2, b"b")]),
        (b"\xef\xbb\xbf" + b"a" * (MAX + 1) + b"\nb", [(1, "line is 65 bytes"), (2, b"b")]),
        (b"b\n" + b"a" * (MAX + 1), [(1, b"b"), (2, "line is 65 bytes")]),
        # skipped in 1 MiB reads, the CRLF split across two of them
        (b"b\n" + b"a" * ((1 << 20) + MAX + 1) + b"\r\nc",
         [(1, b"b"), (2, "line is 1,048,641 bytes"), (3, b"c")]),
        # whitespace only
        (b" \t\r\n\n\r\n  \x0b\x0c ", []),
    ],
)  # fmt: skip
def test_the_line_limit_counts_content_not_the_line_end(data: bytes, expected: list):
    lines = [
        (n, line if isinstance(line, bytes) else str(line))
        for n, line in read_lines(io.BytesIO(data), max_line_bytes=MAX)
    ]
    assert lines == [
        (n, x if isinstance(x, bytes) else f"line {n}, column 1: {x}, over the limit of 64 bytes")
        for n, x in expected
    ]
