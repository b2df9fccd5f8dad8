"""Kept columns: input columns come back in result.parquet after the generation
columns, in input order, with their Arrow types and values; the snapshot behind
them survives finalize and goes with ``delete --outputs``."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.jobs.intake.kept import KEPT, Snapshot, SnapshotWriter, publish
from batchgen.jobs.ops.finalize.result import PartRecord, write_result
from batchgen.jobs.ops.job_record import JobRecord
from batchgen.jobs.ops.lifecycle import JobState
from batchgen.jobs.schema.errors import OutputError
from batchgen.jobs.schema.rows import SCHEMA, FinishReason, Row, to_table
from batchgen.jobs.storage.output_store import OutputDir
from tests.test_pipeline_e2e import batchgen, submit
from tests.test_pipeline_e2e import env as env  # fixtures
from tests.test_pipeline_e2e import workers as workers

UTC = dt.UTC


def table() -> pa.Table:
    """Every kind of column the issue names, a null in each, and one named like a
    result column; row 2's prompt is empty (invalid, skipped: an error row in its place)."""
    return pa.table({
        "q": ["one", "two", "", "four"],
        "i": pa.array([1, None, 3, -(2**40)], pa.int64()),
        "f": pa.array([0.5, 1.25, None, float("-inf")], pa.float32()),
        "s": ["ä", None, "c", "{d}"],
        "l": pa.array([[1, 2], [], None, [4]], pa.list_(pa.int16())),
        "ts": pa.array([dt.datetime(2024, 1, 2, 3, 4, 5, 6000, tzinfo=UTC), None,
                        dt.datetime(2020, 1, 1, tzinfo=UTC),
                        dt.datetime(1999, 12, 31, 23, 59, 59, tzinfo=UTC)],
                       pa.timestamp("us", tz="UTC")),
        "nothing": pa.nulls(4),
        "text": ["t0", "t1", "t2", "t3"],
    })  # fmt: skip


KEPT_NAMES = ["q", "i", "f", "s", "l", "ts", "nothing", "input_text"]


@pytest.fixture(scope="module")
def model(toy_model) -> Path:
    return toy_model("llama")


def test_kept_columns_through_a_worker_and_delete(model, workers, env, tmp_path):
    pq.write_table(table(), tmp_path / "t.parquet")
    submit(env, model, tmp_path / "t.parquet", "kept", tmp_path, "--prompt-column", "q",
           "--keep-columns", "all", "--skip-invalid", "--max-tokens", "2")  # fmt: skip
    proc = workers(model, "--burst", "--max-num-seqs", "4")
    assert proc.wait(timeout=300) == 0, (tmp_path / "worker-0.log").read_text()[-3000:]
    dest = tmp_path / "kept.parquet"
    assert batchgen(env, "download", "kept", "-o", str(dest)).returncode == 0
    result = pq.read_table(dest)

    assert result.schema.names == [*SCHEMA.names, *KEPT_NAMES]
    source = table()  # every row's kept values, the invalid row's too
    for name, column in zip(KEPT_NAMES, source.schema.names):
        assert result.schema.field(name).type == source.schema.field(column).type, name
        assert result.column(name).to_pylist() == source.column(column).to_pylist(), name
    assert result.column("index").to_pylist() == [0, 1, 2, 3]
    assert result.column("id").to_pylist() == ["0", "1", "2", "3"]  # input row numbers
    reasons = result.column("finish_reason").to_pylist()
    assert reasons[2] == "error" and set(reasons[:2] + reasons[3:]) <= {"stop", "length"}
    assert result.column("error").to_pylist()[2] == "row 2, column q: prompt is empty"

    out = tmp_path / "out-kept"
    assert (out / KEPT).exists()  # finalize leaves it: finalizing again joins it again
    deleted = batchgen(env, "delete", "kept", "--outputs")
    assert deleted.returncode == 0, deleted.stderr
    assert not out.exists()


def test_join_is_windowed_across_row_groups_and_finalizing_twice_is_the_same(tmp_path):
    """Many windows over a snapshot of many row groups: each window's kept rows are
    exactly its indices; a second finalize (a retry's) writes the same file."""
    n = 50
    out = OutputDir.open(str(tmp_path / "out"))
    spool = tmp_path / "spool"
    spool.mkdir()
    source = pa.table({"k": pa.array(range(n), pa.int32()), "w": [f"w{i}" for i in range(n)]})
    with SnapshotWriter(spool / KEPT, ["k", "w"], ["k", "w"], source.schema) as writer:
        for start in range(0, n, 7):  # row groups of 7
            batch = source.slice(start, 7).to_batches()[0]
            writer.write(batch)
    publish(spool, out)
    rows = [Row(index=i, text=f"g{i}", finish_reason=FinishReason.STOP) for i in range(n)]
    parts = []
    (tmp_path / "out" / "parts" / "j").mkdir(parents=True)
    for lo in range(0, n, 10):
        name = f"parts/j/p{lo}.parquet"
        pq.write_table(to_table(rows[lo : lo + 10]), tmp_path / "out" / name)
        parts.append(PartRecord(name, 10, lo, lo + 9, nbytes=1000))
    record = JobRecord(id="j", state=JobState.RUNNING, total=n, kept_columns=["k", "w"])
    results = []
    for _ in range(2):
        counts = write_result(out, record, parts, {}, window_bytes=1500)  # ~1 part a window
        assert counts.rows == n
        results.append(pq.read_table(tmp_path / "out" / "result.parquet"))
    assert results[0].equals(results[1])
    got = results[0]
    assert got.column("k").to_pylist() == list(range(n))
    assert got.column("w").to_pylist() == [f"w{i}" for i in range(n)]
    assert got.column("text").to_pylist() == [f"g{i}" for i in range(n)]
    assert got.schema.field("k").type == pa.int32()
    # a partial download's window lacks rows: the kept rows are those of its indices
    sparse = Snapshot(out).join(to_table([rows[1], rows[4], rows[8]]), 0, 10)
    assert sparse.column("k").to_pylist() == [1, 4, 8]
    # without its snapshot, finalize fails naming it: never a result without the columns
    (tmp_path / "out" / KEPT).unlink()
    with pytest.raises(OutputError, match=f"cannot read .*{KEPT}"):
        write_result(out, record, parts, {})


def test_run_takes_a_csv_with_a_template_and_kept_columns(model, env, tmp_path):
    (tmp_path / "q.csv").write_text("topic,n_words,tag\ncats,3,a\ndogs,5,\n")
    out = batchgen(env, "run", str(tmp_path / "q.csv"), "--model", str(model), "-o",
                   str(tmp_path / "run.parquet"), "--device", "cpu", "--max-tokens", "2",
                   "--template", r"Write {n_words} words on {topic}\n", "--keep-columns",
                   "topic,tag", "--job-output", str(tmp_path / "run-job"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = pq.read_table(tmp_path / "run.parquet")
    assert rows.schema.names[-2:] == ["topic", "tag"]
    assert rows.column("topic").to_pylist() == ["cats", "dogs"]
    assert rows.column("tag").to_pylist() == ["a", ""]  # pyarrow reads an empty field as ""
    assert rows.column("completion_tokens").to_pylist() == [2, 2]
    bad = batchgen(env, "run", str(tmp_path / "q.csv"), "--model", str(model), "-o",
                   str(tmp_path / "x.parquet"), "--template", "{topic}", "--keep-columns", "a,")  # fmt: skip
    assert (bad.returncode, bad.stderr.count("\n")) == (2, 1), bad.stderr
    assert "--keep-columns 'a,': an empty column name" in bad.stderr
