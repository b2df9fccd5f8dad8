"""Pass 1 of submit gives the same answer however many processes validate the file."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from batchgen.jobs.intake.validate import BIG_LINE_BYTES, SpoolDir, _ranges, validate_file
from batchgen.jobs.schema.sampling import DEFAULTS


@pytest.fixture
def messy(tmp_path):
    lines = []
    for i in range(300):
        if i % 37 == 5:
            lines.append('{"prompt": ""}')
        elif i % 50 == 7:
            lines.append("")
        elif i == 120:
            lines.append('{"prompt": "' + "x" * 5000 + '"}')  # over the 4 KiB limit below
        else:
            lines.append(json.dumps({"id": i, "prompt": f"p{i}"}))
    path = tmp_path / "messy.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode() + b"\r\n")
    return path


def test_parallel_validation_equals_sequential(messy):
    with SpoolDir() as one_dir, SpoolDir() as many_dir:
        one = validate_file(str(messy), dict(DEFAULTS), one_dir, max_line_bytes=4096, procs=1)
        many = validate_file(str(messy), dict(DEFAULTS), many_dir, max_line_bytes=4096, procs=3)
        assert len(many.spools) == 3
        assert (many.total, many.error_count, many.sha256) == (
            one.total,
            one.error_count,
            one.sha256,
        )
        assert [str(e) for e in many.errors] == [str(e) for e in one.errors]
        assert list(many.entries()) == list(one.entries())
    assert one.error_count == 9  # 8 empty prompts + the long line
    assert [e.line for e in one.errors] == [6, 43, 80, 117, 121, 154, 191, 228, 265]
    assert (
        str(one.errors[4])
        == "line 121, column 1: line is 5,014 bytes, over the limit of 4,096 bytes"
    )
    assert one.total == 300 - 6  # every line but the blank ones (invalid ones too)
    assert one.valid == 300 - 6 - 9


def test_ranges_cut_at_line_boundaries_and_number_lines(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"a\nbb\nccc\n\ndddd\n")
    data = path.read_bytes()
    # 15 bytes, cut targets 5 and 10, each moved on past the line it falls in;
    # the third range would be empty
    assert _ranges(str(path), 3) == [(0, 9, 1), (9, 15, 4)]
    assert _ranges(str(path), 1) == [(0, len(data), 1)]


def test_ranges_skip_a_long_line_in_bounded_reads(tmp_path):
    path = tmp_path / "long.jsonl"
    with open(path, "wb") as f:
        f.write(b"a\n")
        for _ in range(24):
            f.write(b"x" * (1 << 20))
        f.write(b"\nb\n")
    tracemalloc.start()
    ranges = _ranges(str(path), 4)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    # every cut falls in the long line and moves on past it: one range, then "b"
    assert ranges == [(0, 2 + (24 << 20) + 1, 1), (2 + (24 << 20) + 1, path.stat().st_size, 3)]
    assert peak < 10 << 20, peak  # never the rest of the line at once


def test_big_lines_validated_in_parallel_equal_sequential(tmp_path):
    # lines over BIG_LINE_BYTES are parsed one at a time across the processes
    path = tmp_path / "big.jsonl"
    prompt = "\U0001f600" + "x" * BIG_LINE_BYTES
    with open(path, "w") as f:
        for i in range(12):
            line = {"id": i, "prompt": prompt} if i % 4 else {"id": i, "prompt": prompt, "x": 1}
            f.write(json.dumps(line) + "\n")
    with SpoolDir() as one_dir, SpoolDir() as many_dir:
        one = validate_file(str(path), dict(DEFAULTS), one_dir, procs=1)
        many = validate_file(str(path), dict(DEFAULTS), many_dir, procs=4)
        assert len(many.spools) == 4
        assert (many.total, many.error_count, many.sha256) == (one.total, 3, one.sha256)
        assert [str(e) for e in many.errors] == [str(e) for e in one.errors]
        # an invalid line's entry is its error, with the line's own id
        assert [json.loads(e).get("id") for e in many.entries()] == [str(i) for i in range(12)]
    assert [e.line for e in one.errors] == [1, 5, 9]
