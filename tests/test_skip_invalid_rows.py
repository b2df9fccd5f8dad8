"""``--skip-invalid`` keeps every line's place: a real submit and a real worker process on
a private Redis, 86 lines of which 5 are invalid (the tester's file), and a table with
bad rows and kept columns. The output holds one row per input line, ``index`` is the
line's place, each invalid line is an error row naming it, and a retry leaves those alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.jobs.redis.redis_server import RedisServer
from tests.cli_session import Shell, rows, shells, write_jsonl

BAD = {  # 1-based line -> (the line, its error)
    7: ('{"id": "L7", "prompt": "seven", "max_token": 2}',
        "line 7, column 33: unknown field 'max_token' (did you mean 'max_tokens'?)"),
    23: ('{"prompt": "twenty-three", "max_tokens": 2', "line 23, column 43: malformed JSON: "
         "Expecting ',' delimiter"),
    45: ('{"id": 45, "prompt": "", "max_tokens": 2}', "line 45, column 22: prompt is empty"),
    60: ('{"prompt": "sixty", "temperature": NaN}',
         "line 60, column 36: NaN is not a valid JSON number"),
    86: ('{"prompt": "last", "max_tokens": 0}',
         "line 86, column 34: max_tokens must be an integer from 1 to 1048576, got 0"),
}  # fmt: skip
KEPT_IDS = {7: "L7", 45: "45"}  # bad lines that parsed and carried an id keep it; the rest None


@pytest.fixture
def shell(tmp_path: Path, toy_model, private_redis: RedisServer) -> Iterator[Shell]:
    (tmp_path / "tiny").symlink_to(toy_model("llama"))
    yield from shells(tmp_path, tmp_path / "home", private_redis.url)


def test_every_line_keeps_its_index_and_skipped_ones_are_error_rows(shell):
    lines = [BAD[n][0] if n in BAD else f'{{"id": "L{n}", "prompt": "line {n}", "max_tokens": 2}}'
             for n in range(1, 87)]  # fmt: skip
    write_jsonl(shell.cwd / "p.jsonl", lines)
    out = shell.run("submit", "p.jsonl", "--model", "tiny", "--skip-invalid", "--job-id", "s",
                    "--output", str(shell.cwd / "out-s"))  # fmt: skip
    assert (out.returncode, out.stdout) == (0, "s\n")
    tiny = shell.cwd / "tiny"
    note = (f"batchgen: note: no worker serves {tiny} yet, so the job waits; start one with "
            f"`batchgen worker --model {tiny}`\n")  # fmt: skip
    assert (
        out.stderr
        == "skipped 5 invalid line(s), each an error row:\n"
        + "".join(f"  {error}\n" for _, error in BAD.values())
        + note
    )
    table = pa.table({
        "key": [f"k{i}" for i in range(10)], "q": [f"row {i}" for i in range(10)],
        "max_tokens": [2, 2, 2, 0, 2, 2, 2, None, 2, 2], "extra": list(range(100, 110)),
    })  # fmt: skip
    table = table.set_column(1, "q", pa.array([f"row {i}" if i != 7 else None for i in range(10)]))
    pq.write_table(table, shell.cwd / "t.parquet")
    out = shell.run("submit", "t.parquet", "--model", "tiny", "--skip-invalid", "--job-id", "t",
                    "--prompt-column", "q", "--id-column", "key", "--keep-columns", "key,extra",
                    "--sampling-columns", "max_tokens", "--output", str(shell.cwd / "out-t"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stderr == (
        "skipped 2 invalid row(s), each an error row:\n"
        "  row 3, column max_tokens: max_tokens must be an integer from 1 to 1048576, got 0\n"
        "  row 7, column q: prompt must be a string\n" + note
    )
    worker = shell.start("worker", "--model", "tiny", "--device", "cpu", "--burst")
    assert worker.wait(timeout=300) == 0, (shell.cwd / "worker.log").read_text()[-3000:]

    shell.ok("download", "s", "-o", "s.parquet")
    got = rows(shell.cwd / "s.parquet")
    assert got["index"] == list(range(86))
    for index in range(86):
        line = index + 1
        if line in BAD:
            assert (got["id"][index], got["finish_reason"][index], got["error"][index]) == (
                KEPT_IDS.get(line), "error", BAD[line][1])  # fmt: skip
        else:
            assert (got["id"][index], got["finish_reason"][index]) == (f"L{line}", "length")
    status = shell.status("s")
    assert (status["total"], status["done"], status["failed"], status["cancelled"]) == (
        86, 81, 5, 0)  # fmt: skip
    assert status["skipped_invalid"] == 5
    text = shell.ok("status", "s")
    assert "rows       done 81, failed 5, cancelled 0\n" in text
    assert "invalid    5 input lines, error rows (--skip-invalid)\n" in text

    shell.ok("download", "t", "-o", "t-out.parquet")
    got = rows(shell.cwd / "t-out.parquet")
    assert got["index"] == list(range(10))
    assert got["key"] == [f"k{i}" for i in range(10)]  # kept columns: every row, bad ones too
    assert got["extra"] == list(range(100, 110))
    assert got["id"] == [f"k{i}" for i in range(10)]  # the bad rows' ids kept too
    assert [r for r in got["finish_reason"]] == ["error" if i in (3, 7) else "length"
                                                  for i in range(10)]  # fmt: skip
    assert got["error"][7] == "row 7, column q: prompt must be a string"

    # retry: the invalid lines would fail the same way, so nothing is queued
    assert shell.ok("retry", "s") == (
        "s: nothing to retry (its 5 failed row(s) are invalid input lines, which would fail "
        "the same way)\n"
    )
    assert shell.status("s")["state"] == "completed"
