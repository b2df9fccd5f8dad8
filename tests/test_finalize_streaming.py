"""Finalize streams the result: windows bounded by bytes, never the whole file in memory,
to a local disk or a real S3 API (moto's server, reached by pyarrow's own client)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import redis

from batchgen.jobs.ops.export import download
from batchgen.jobs.ops.finalize.finalization import finalize
from batchgen.jobs.ops.finalize.result import PartRecord, plan_windows
from batchgen.jobs.ops.submission import submit
from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.schema.rows import FinishReason, Row
from batchgen.jobs.schema.sampling import DEFAULTS
from batchgen.worker.consumer.queue import read_new
from batchgen.worker.consumer.sink import PartSink

KEYS = Keys("bg")
QK = KEYS.queue_for_model("m")
MB = 1 << 20


def part(lo: int, hi: int, nbytes: int) -> PartRecord:
    return PartRecord(f"parts/j/{lo}.parquet", hi - lo + 1, lo, hi, nbytes=nbytes)


def test_windows_hold_parts_up_to_the_budget_and_cover_every_index_once():
    parts = [part(0, 9, 4 * MB), part(10, 19, 4 * MB), part(20, 29, 4 * MB), part(30, 39, 4 * MB)]
    assert plan_windows(parts, 40, 8 * MB) == [(0, 20), (20, 40)]
    assert plan_windows(parts, 40, 4 * MB) == [(0, 10), (10, 20), (20, 30), (30, 40)]
    assert plan_windows(parts, 40, 1 * MB) == [(0, 10), (10, 20), (20, 30), (30, 40)]  # >= 1 part
    assert plan_windows(parts, 40, 64 * MB) == [(0, 40)]
    # a part whose indices span far (a request handed back and finished late) is read
    # in every window it reaches into, and counted there
    spanning = [*parts, part(5, 35, 3 * MB)]
    assert plan_windows(spanning, 40, 8 * MB) == [(0, 10), (10, 20), (20, 30), (30, 40)]
    assert plan_windows(spanning, 40, 11 * MB) == [(0, 20), (20, 40)]  # 4 + 3 + 4 each
    # rows nobody committed (cancelled, lost) are filled at most max_rows at a time
    assert plan_windows([], 25, 8 * MB, max_rows=10) == [(0, 10), (10, 20), (20, 25)]
    assert plan_windows([part(0, 4, MB)], 25, 8 * MB, max_rows=10) == [(0, 10), (10, 20), (20, 25)]


def rconn(url: str) -> Any:
    return redis.Redis.from_url(url)


def big_job(conn, tmp_path: Path, output: str, n_parts: int, rows: int, text_kb: int) -> None:
    """A finalizing job of ``n_parts`` committed parts of ``rows`` rows of ``text_kb`` KiB."""
    n = n_parts * rows
    src = tmp_path / "big.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(n)))
    submit(conn, KEYS, source_path=str(src), model="m", output=output, defaults=dict(DEFAULTS),
           job_id="big")  # fmt: skip
    deliveries = read_new(conn, QK, "w", n, None)
    for k in range(n_parts):
        sink = PartSink(QK, f"w{k}")
        for d in deliveries[k * rows : (k + 1) * rows]:
            text = f"{d.index:08d}" * (text_kb * 128)
            sink.add(d, output, Row(index=d.index, text=text, token_ids=[d.index],
                                    finish_reason=FinishReason.LENGTH))  # fmt: skip
        assert sink.flush(conn).commit is not None


PEAK = """
import json, sys
import pyarrow as pa, redis
from batchgen.jobs.ops.finalize.finalization import FinalizeSettings, finalize
from batchgen.jobs.redis.keys import Keys
settings = FinalizeSettings(window_bytes=int(sys.argv[2]))
state = finalize(redis.Redis.from_url(sys.argv[1]), Keys("bg"), "big", settings)
print(json.dumps({"state": state, "peak": pa.default_memory_pool().max_memory()}))
"""


def test_finalize_holds_one_window_not_the_whole_result(redis_url, tmp_path):
    conn = rconn(redis_url)
    out = tmp_path / "out"
    big_job(conn, tmp_path, str(out), n_parts=32, rows=16, text_kb=256)  # 128 MiB of text
    done = subprocess.run([sys.executable, "-c", PEAK, redis_url, str(8 * MB)],
                          capture_output=True, text=True, check=True)  # fmt: skip
    report = json.loads(done.stdout)
    assert report["state"] == "completed"
    assert report["peak"] < 40 * MB, report  # windows of ~8 MiB, not 128 MiB at once
    table = pq.read_table(out / "result.parquet", columns=["index", "token_ids"])
    assert table.column("index").to_pylist() == list(range(512))
    assert table.column("token_ids").to_pylist() == [[i] for i in range(512)]


def test_an_object_store_output_end_to_end(redis_url, tmp_path, s3_endpoint):
    """Marker (the submit's probe), parts, a streamed result and manifest on S3; download
    (whole and --partial) fetches them; finalize's clean-up leaves only final objects."""
    import pyarrow.fs as pafs

    conn = rconn(redis_url)
    uri = f"s3://batchgen-test/jobs/big?endpoint_override={s3_endpoint}&scheme=http"
    big_job(conn, tmp_path, uri, n_parts=4, rows=8, text_kb=64)
    path, rows = download(conn, KEYS, "big", str(tmp_path / "partial.parquet"), partial=True)
    assert rows == 32
    assert finalize(conn, KEYS, "big") == "completed"
    path, rows = download(conn, KEYS, "big", str(tmp_path / "big.parquet"))
    table = pq.read_table(path)
    assert table.column("index").to_pylist() == list(range(32)) and rows == 32
    assert table.column("text").to_pylist()[5] == "00000005" * 64 * 128
    fs = pafs.S3FileSystem(endpoint_override=s3_endpoint, scheme="http")
    listed = fs.get_file_info(pafs.FileSelector("batchgen-test/jobs/big", recursive=True))
    assert sorted(info.base_name for info in listed) == [
        "batchgen-job.json", "manifest.json", "result.parquet"
    ]  # fmt: skip
