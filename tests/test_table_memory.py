"""A big table is submitted in bounded memory: the real ``batchgen submit`` on a
generated 2M-row Parquet folder, its peak RSS measured from outside."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import redis

from batchgen.jobs.intake.kept import KEPT
from batchgen.jobs.redis.keys import Keys, queue_tag
from batchgen.jobs.schema.entry import parse_backlog_item
from benchmarks.table_submit_bench import tree_rss_peak
from tests.test_submit_memory import WATCH

# what submit says on stderr when no worker serves the model (and nothing else)
NO_WORKER_NOTE = ("batchgen: note: no worker serves m yet, so the job waits; start one with "
                  "`batchgen worker --model m`\n")  # fmt: skip

MiB = 1 << 20
ROWS = 2_000_000


def write_folder(folder: Path) -> None:
    """4 files of 500k rows in row groups of 100k: an id, a title, a ~60-character body."""
    folder.mkdir()
    body = pa.scalar("lorem ipsum dolor sit amet " * 2)
    for f in range(4):
        with pq.ParquetWriter(folder / f"part-{f}.parquet", _schema()) as writer:
            for lo in range(f * 500_000, (f + 1) * 500_000, 100_000):
                n = pa.array(range(lo, lo + 100_000), pa.int64())
                text = pc.cast(n, pa.string())
                writer.write_table(pa.table({
                    "doc_id": pc.binary_join_element_wise("doc-", text, ""),
                    "title": pc.binary_join_element_wise("title ", text, ""),
                    "body": pc.binary_join_element_wise(text, body, " "),
                    "seq": n,
                }, schema=_schema()))  # fmt: skip


def _schema() -> pa.Schema:
    return pa.schema([("doc_id", pa.string()), ("title", pa.string()), ("body", pa.string()),
                      ("seq", pa.int64())])  # fmt: skip


def submit_command(redis_url: str, out: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "batchgen", "submit", str(out.parent / "in"), "--model", "m",
            "--output", str(out), "--redis", redis_url, "--json", *flags]  # fmt: skip


@pytest.mark.slow
def test_a_2m_row_parquet_folder_is_submitted_in_bounded_memory(redis_url, tmp_path):
    write_folder(tmp_path / "in")
    env = {**os.environ, "BATCHGEN_SUBMIT_PROCS": "2"}
    command = submit_command(redis_url, tmp_path / "out", "--template",
                             "Summarise: {title}\n{body}", "--id-column", "doc_id",
                             "--keep-columns", "seq,body")  # fmt: skip
    # the kernel's high-water mark of the biggest process (submit or a validator), and
    # the sampled peak of them all together
    proc = subprocess.Popen([sys.executable, "-c", WATCH, str(tmp_path / "w.json"), *command],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    total = tree_rss_peak(proc)
    stdout, stderr = proc.communicate(timeout=900)
    watched = json.loads((tmp_path / "w.json").read_text())
    assert (watched["rc"], stderr) == (0, NO_WORKER_NOTE)
    assert json.loads(stdout)["total"] == ROWS
    assert watched["peak"] < 512 * MiB, f"peak RSS {watched['peak'] / MiB:.0f} MiB"
    assert total < 1024 * MiB, f"peak RSS of the process tree {total / MiB:.0f} MiB"
    conn: Any = redis.Redis.from_url(redis_url)
    qk = Keys("bg").queue(queue_tag("m"))
    [job] = [j.decode() for j in conn.smembers(qk.active)]
    items = [item for key in qk.job(job).backlogs for item in conn.lrange(key, -1, -1)]
    last = max(parse_backlog_item(item) for item in items)  # the highest index queued
    assert (last[0], json.loads(last[2])["id"]) == (ROWS - 1, f"doc-{ROWS - 1}")
    assert pq.read_metadata(tmp_path / "out" / KEPT).num_rows == ROWS
    conn.flushall()  # two million entries: not for the next test's redis-server
