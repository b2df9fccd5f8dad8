"""Job ids, output locations and downloads cannot reach outside where batchgen writes."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import redis

from batchgen.jobs.ops.export import download
from batchgen.jobs.ops.finalize.finalization import finalize
from batchgen.jobs.ops.submission import submit
from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.schema.errors import JobNotReady, UnsafeName
from batchgen.jobs.schema.rows import FinishReason, Row
from batchgen.jobs.schema.sampling import DEFAULTS
from batchgen.jobs.storage.names import check_job_id, check_output, default_output
from batchgen.jobs.storage.output_store import OutputDir
from batchgen.worker.consumer.queue import read_new
from batchgen.worker.consumer.sink import PartSink

KEYS = Keys("bg")


def rconn(url: str, **kwargs: Any) -> Any:
    """A client typed loosely: redis-py's reply unions make tests unreadable."""
    return redis.Redis.from_url(url, **kwargs)


@pytest.mark.parametrize(
    "job_id",
    ["../x", "/abs/path", "%2e%2e", "a\x00b", "..", "a/b", "", ".hidden", "a..b", "x" * 129],
)
def test_unsafe_job_ids_are_rejected(job_id: str):
    with pytest.raises(UnsafeName, match="is not a plain name"):
        check_job_id(job_id)


@pytest.mark.parametrize("job_id", ["job-1", "2025.11.29_run", "A"])
def test_plain_job_ids_pass(job_id: str):
    assert check_job_id(job_id) == job_id


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("out/../../etc", "contains '..'"),
        ("s3://bucket/%2e%2e/x", "contains percent-escapes"),
        ("/data/%2E%2E", "contains percent-escapes"),
        ("/data/a\x00b", "contains a NUL byte"),
        ("ftp://host/x", "unsupported scheme 'ftp'"),
        ("file://relative/x", "a file:// URI needs an absolute path"),
        ("s3://", "names no bucket or directory"),
    ],
)
def test_unsafe_outputs_are_rejected(raw: str, message: str):
    with pytest.raises(UnsafeName, match=message):
        check_output(raw)


def test_outputs_are_normalized(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert check_output("results/") == str(tmp_path / "results")
    assert check_output("file:///data/x/") == "/data/x"
    assert check_output("s3://bucket/prefix/") == "s3://bucket/prefix"


def test_default_output_refuses_a_job_dir_symlinked_out_of_the_root(tmp_path, monkeypatch):
    root = tmp_path / "root"
    root.mkdir()
    monkeypatch.setenv("BATCHGEN_OUTPUT_ROOT", str(root))
    assert default_output("ok") == str(root / "ok")
    (root / "evil").symlink_to(tmp_path)
    with pytest.raises(UnsafeName, match="points outside the output root"):
        default_output("evil")


def test_parts_dir_symlinked_outside_the_output_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / "parts").symlink_to(elsewhere)
    with pytest.raises(UnsafeName, match="outside the job's output directory"):
        OutputDir.open(str(out)).write_atomic(("parts", "a.parquet"), b"data")
    assert list(elsewhere.iterdir()) == []


def test_names_inside_an_output_dir_must_be_plain(tmp_path):
    out = OutputDir.open(str(tmp_path))
    for bad in ("../x", "/etc/passwd", "a/b", "%2e%2e"):
        with pytest.raises(UnsafeName):
            out.file(bad)


def _completed_job(conn, tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "a"}\n')
    out = tmp_path / "out"
    submit(conn, KEYS, source_path=str(src), model="m", output=str(out),
           defaults=dict(DEFAULTS), job_id="j")  # fmt: skip
    qk = KEYS.queue_for_model("m")
    (d,) = read_new(conn, qk, "w", 1, None)
    sink = PartSink(qk, "w")
    sink.add(d, str(out), Row(index=0, text="hi", finish_reason=FinishReason.STOP))
    assert sink.flush(conn).commit is not None
    return out


def test_download_before_completion_needs_partial(redis_url, tmp_path):
    conn = rconn(redis_url)
    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    out = tmp_path / "out"
    submit(conn, KEYS, source_path=str(src), model="m", output=str(out),
           defaults=dict(DEFAULTS), job_id="j")  # fmt: skip
    qk = KEYS.queue_for_model("m")
    ds = read_new(conn, qk, "w", 1, None)
    sink = PartSink(qk, "w")
    sink.add(ds[0], str(out), Row(index=0, text="hi", finish_reason=FinishReason.STOP))
    sink.flush(conn)
    with pytest.raises(JobNotReady) as info:
        download(conn, KEYS, "j", str(tmp_path / "dl.parquet"))
    assert str(info.value) == (
        "job 'j' is running (1/2 rows); wait for it (batchgen status j --watch) or pass "
        "--partial for the rows committed so far"
    )
    path, rows = download(conn, KEYS, "j", str(tmp_path / "dl.parquet"), partial=True)
    assert (path, rows) == (tmp_path / "dl.parquet", 1)


def test_download_serves_only_files_the_manifest_lists(redis_url, tmp_path):
    conn = rconn(redis_url)
    out = _completed_job(conn, tmp_path)
    assert finalize(conn, KEYS, "j") == "completed"
    _, rows = download(conn, KEYS, "j", str(tmp_path / "a.parquet"))
    assert rows == 1
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"] = ["../../etc/passwd"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UnsafeName, match="is not a plain file name"):
        download(conn, KEYS, "j", str(tmp_path / "b.parquet"))
    manifest["files"] = ["result.parquet"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    os.replace(out / "result.parquet", tmp_path / "moved.parquet")
    (out / "result.parquet").symlink_to(tmp_path / "moved.parquet")  # planted link out
    with pytest.raises(UnsafeName, match="outside the job's output directory"):
        download(conn, KEYS, "j", str(tmp_path / "c.parquet"))
    assert not (tmp_path / "b.parquet").exists() and not (tmp_path / "c.parquet").exists()
