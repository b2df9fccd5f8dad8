"""Commit is atomic and idempotent; finalize writes exactly one row per input via rq (JSON)."""

from __future__ import annotations

import io
import json
import os
import pickle
import signal
import zlib
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import redis
from rq import Queue

from batchgen.jobs.ops.finalize import finalize_tasks as tasks
from batchgen.jobs.ops.finalize.finalization import finalize
from batchgen.jobs.ops.finalize.result import LOST
from batchgen.jobs.ops.job_record import load_job
from batchgen.jobs.ops.lifecycle import JobState
from batchgen.jobs.ops.submission import submit
from batchgen.jobs.redis.keys import GROUP, Keys, QueueKeys
from batchgen.jobs.schema.rows import FinishReason, Row, to_table
from batchgen.jobs.schema.sampling import DEFAULTS
from batchgen.jobs.storage.output_store import OutputDir
from batchgen.worker.consumer.commit import PartCommit, commit
from batchgen.worker.consumer.queue import read_new
from batchgen.worker.consumer.sink import PartSink

KEYS = Keys("bg")
QK = KEYS.queue_for_model("m")


def rconn(url: str, **kwargs: Any) -> Any:
    """A client typed loosely: redis-py's reply unions make tests unreadable."""
    return redis.Redis.from_url(url, **kwargs)


def make_job(conn, tmp_path: Path, n: int, job_id: str = "j") -> tuple[Path, QueueKeys]:
    src = tmp_path / f"{job_id}.jsonl"
    src.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"p{i}"}) + "\n" for i in range(n)))
    out = tmp_path / f"out-{job_id}"
    submit(conn, KEYS, source_path=str(src), model="m", output=str(out),
           defaults=dict(DEFAULTS), job_id=job_id)  # fmt: skip
    return out, KEYS.queue_for_model("m")


def row(index: int, text: str = "", reason=FinishReason.LENGTH, worker: str = "w") -> Row:
    return Row(index=index, id=f"r{index}", text=text, token_ids=[1, 2], finish_reason=reason,
               prompt_tokens=3, completion_tokens=2, attempts=1, worker=worker)  # fmt: skip


def publish(out: Path, name: str, rows: list[Row]) -> str:
    sink = io.BytesIO()
    pq.write_table(to_table(rows), sink)
    OutputDir.open(str(out)).write_atomic(("parts", name), sink.getvalue())
    return f"parts/{name}"


def deliver(conn, qk, consumer="w", count=100):
    return read_new(conn, qk, consumer, count, None)


def test_commit_marks_counts_acks_and_deletes_in_one_step(redis_url, tmp_path):
    conn = rconn(redis_url)
    out, qk = make_job(conn, tmp_path, 3)
    ds = deliver(conn, qk)
    name = publish(out, "a.parquet", [row(d.index) for d in ds[:2]])
    part = PartCommit("j", name, [row(d.index) for d in ds[:2]], [d.entry_id for d in ds[:2]])
    result = commit(conn, qk, [part])
    assert (result.finished, result.lost, result.again) == ([], 0, [])
    record = load_job(conn, KEYS, "j")
    assert (record.state, record.done, record.failed, record.prompt_tokens, record.completion_tokens) == (
        JobState.RUNNING, 2, 0, 6, 4)  # fmt: skip
    assert [conn.getbit(qk.job("j").done, i) for i in range(3)] == [1, 1, 0]
    assert conn.xlen(qk.stream) == 1  # acked entries are deleted, not left to grow
    assert conn.xpending(qk.stream, GROUP)["pending"] == 1
    assert json.loads(conn.hget(qk.job("j").parts, name)) == {
        "rows": 2,
        "lo": 0,
        "hi": 1,
        "bytes": 0,  # PartCommit.nbytes: the sink records the table's size
        "lost": {},
    }


def test_the_same_part_committed_twice_counts_once(redis_url, tmp_path):
    conn = rconn(redis_url)
    out, qk = make_job(conn, tmp_path, 2)
    ds = deliver(conn, qk)
    rows = [row(d.index) for d in ds]
    part = PartCommit("j", publish(out, "a.parquet", rows), rows, [d.entry_id for d in ds])
    first = commit(conn, qk, [part])
    second = commit(conn, qk, [part])  # a retry after a lost reply
    assert first.finished == ["j"] and second.again == ["j"]
    record = load_job(conn, KEYS, "j")
    assert (record.state, record.done, record.failed) == (JobState.FINALIZING, 2, 0)


def test_a_request_committed_by_two_workers_keeps_the_first_row(redis_url, tmp_path):
    conn = rconn(redis_url)
    out, qk = make_job(conn, tmp_path, 3)
    ds = deliver(conn, qk, "w1")
    ids = [d.entry_id for d in ds]
    # w1 stalls; w2 takes its entries over and commits first
    rows2 = [row(i, "from w2", worker="w2") for i in (0, 1, 2)]
    commit(conn, qk, [PartCommit("j", publish(out, "w2.parquet", rows2), rows2, ids)])
    # w1 wakes up and commits its late rows for 1 and 2
    rows1 = [row(i, "from w1", worker="w1") for i in (1, 2)]
    late = commit(conn, qk, [PartCommit("j", publish(out, "w1.parquet", rows1), rows1, ids[1:])])
    assert late.lost == 2
    assert json.loads(conn.hget(qk.job("j").parts, "parts/w1.parquet"))["lost"] == [1, 2]
    record = load_job(conn, KEYS, "j")
    assert (record.state, record.done) == (JobState.FINALIZING, 3)
    assert finalize(conn, KEYS, "j") == "completed"
    table = pq.read_table(out / "result.parquet")
    assert table.column("index").to_pylist() == [0, 1, 2]
    assert table.column("text").to_pylist() == ["from w2"] * 3
    assert sorted(p.name for p in out.iterdir()) == [
        "batchgen-job.json",
        "manifest.json",
        "result.parquet",
    ]


def test_commits_after_finalize_are_discarded_and_acked(redis_url, tmp_path):
    conn = rconn(redis_url)
    out, qk = make_job(conn, tmp_path, 1)
    (d,) = deliver(conn, qk)
    rows = [row(0, "kept")]
    commit(conn, qk, [PartCommit("j", publish(out, "a.parquet", rows), rows, [d.entry_id])])
    assert finalize(conn, KEYS, "j") == "completed"
    assert finalize(conn, KEYS, "j") == "completed"  # idempotent
    late = [row(0, "late")]
    result = commit(
        conn, qk, [PartCommit("j", publish(out, "b.parquet", late), late, [d.entry_id])]
    )
    assert result.closed == ["j"]
    assert pq.read_table(out / "result.parquet").column("text").to_pylist() == ["kept"]


def test_rows_for_a_vanished_job_are_acked_not_counted(redis_url, tmp_path):
    conn = rconn(redis_url)
    out, qk = make_job(conn, tmp_path, 1)
    (d,) = deliver(conn, qk)
    conn.delete(qk.job("j").job)  # Redis lost the job's state
    rows = [row(0)]
    result = commit(
        conn, qk, [PartCommit("j", publish(out, "a.parquet", rows), rows, [d.entry_id])]
    )
    assert result.missing == ["j"]
    assert conn.xlen(qk.stream) == 0
    assert conn.xpending(qk.stream, GROUP)["pending"] == 0


def test_sink_publishes_then_commits_and_retries_the_same_part(private_redis, tmp_path):
    conn = rconn(private_redis.url)
    out, qk = make_job(conn, tmp_path, 2)
    ds = deliver(conn, qk)
    sink = PartSink(qk, "w1")
    for d in ds:
        sink.add(d, str(out), row(d.index))
    private_redis.kill()
    dead = rconn(private_redis.url, socket_connect_timeout=0.5)
    flushed = sink.flush(dead)  # Redis down: the part stays written, uncommitted
    assert (flushed.commit, flushed.redis_failed) == (None, True)
    assert len(sink.written) == 1 and not sink.buffers
    private_redis.start()
    result = sink.flush(rconn(private_redis.url)).commit
    assert result is not None and result.finished == ["j"]
    conn = rconn(private_redis.url)
    (committed,) = conn.hkeys(qk.job("j").parts)
    files = [p.name for p in (out / "parts" / "j").iterdir()]
    assert files == [committed.decode().removeprefix("parts/j/")]  # no second file for the retry
    assert load_job(conn, KEYS, "j").done == 2


def test_finalize_runs_through_rq_with_the_json_serializer(redis_url, tmp_path):
    conn = rconn(redis_url)
    out, qk = make_job(conn, tmp_path, 2)
    ds = deliver(conn, qk)
    rows = [row(d.index, f"t{d.index}") for d in ds]
    result = commit(conn, qk, [PartCommit("j", publish(out, "a.parquet", rows), rows,
                                          [d.entry_id for d in ds])])  # fmt: skip
    assert tasks.enqueue_finalize(conn, KEYS, qk, result.finished[0]) is True
    assert tasks.enqueue_finalize(conn, KEYS, qk, "j") is False  # already queued
    data = conn.hget("rq:job:bg-finalize-j", "data")
    assert data is not None  # rq stores zlib(JSON): no pickle on the enqueue side
    assert json.loads(zlib.decompress(data)) == [tasks.FINALIZE_FUNC, None, ["j", "bg"], {}]
    assert tasks.run_pending(conn, KEYS, QK.tag) == 1
    assert load_job(conn, KEYS, "j").state == JobState.COMPLETED
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["files"] == ["result.parquet"]
    assert manifest["counts"]["by_finish_reason"] == {"length": 2}
    assert pq.read_table(out / "result.parquet").column("text").to_pylist() == ["t0", "t1"]


def test_a_finalize_run_opens_no_command_channel(redis_url, tmp_path):
    """rq's command listener made a run wait up to 60 s as it ended (rq 3 with
    redis-py 8.2): the runner never subscribes, so it never waits for one."""
    conn = rconn(redis_url)
    out, qk = make_job(conn, tmp_path, 1)
    ds = deliver(conn, qk)
    rows = [row(0, "t0")]
    commit(conn, qk, [PartCommit("j", publish(out, "a.parquet", rows), rows, [ds[0].entry_id])])
    assert tasks.enqueue_finalize(conn, KEYS, qk, "j") is True
    conn.config_resetstat()
    assert tasks.run_pending(conn, KEYS, QK.tag) == 1
    assert load_job(conn, KEYS, "j").state == JobState.COMPLETED
    called = conn.info("commandstats")
    assert "cmdstat_hset" in called  # the stats do count this run's commands
    assert [c for c in called if "subscribe" in c] == []


class Boom:
    """Unpickling this writes a file: proof of code execution."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (Path(self.path), "pwned"))


def test_a_planted_pickle_payload_is_never_unpickled(redis_url, tmp_path):
    conn = rconn(redis_url)
    marker = tmp_path / "pwned"
    # Someone with Redis access enqueues a pickle-serialized task on our queue.
    pickled = Queue(KEYS.finalize_queue(QK.tag), connection=conn)  # rq's default: pickle
    pickled.enqueue(print, Boom(str(marker)), job_id="evil")
    tasks.run_pending(conn, KEYS, QK.tag)  # our worker reads it with the JSON serializer
    assert not marker.exists()
    assert not conn.exists("rq:job:evil")  # refused and removed, never run
    # and a planted "finalize task" record in our id space is replaced, not trusted
    conn.hset("rq:job:bg-finalize-x", "data", pickle.dumps(Boom(str(marker))))
    conn.hset("rq:job:bg-finalize-x", "status", "queued")
    make_job(conn, tmp_path, 1, job_id="x")
    tasks.enqueue_finalize(conn, KEYS, QK, "x")
    assert not marker.exists()


def test_lost_entries_become_error_rows(redis_url, tmp_path):
    from batchgen.jobs.ops.maintenance import sweep

    conn = rconn(redis_url)
    out, qk = make_job(conn, tmp_path, 4)
    ds = deliver(conn, qk, count=1)
    rows = [row(0, "ok")]
    commit(conn, qk, [PartCommit("j", publish(out, "a.parquet", rows), rows, [ds[0].entry_id])])
    deliver(conn, qk, count=3)  # 1, 2, 3 pending at a worker ...
    conn.xtrim(qk.stream, maxlen=0)  # ... then someone trims the stream: 1, 2, 3 are gone
    assert sweep(conn, KEYS, qk) == ["j"]
    record = load_job(conn, KEYS, "j")
    assert record.state == JobState.FINALIZING
    assert tasks.run_pending(conn, KEYS, QK.tag) == 1
    table = pq.read_table(out / "result.parquet").to_pydict()
    assert table["index"] == [0, 1, 2, 3]
    assert table["finish_reason"] == ["length", "error", "error", "error"]
    assert table["error"] == [None, LOST, LOST, LOST]
    record = load_job(conn, KEYS, "j")
    assert (record.state, record.done, record.failed) == (JobState.COMPLETED, 1, 3)


def test_sweep_leaves_jobs_with_live_entries_alone(redis_url, tmp_path):
    from batchgen.jobs.ops.maintenance import sweep

    conn = rconn(redis_url)
    make_job(conn, tmp_path, 2)
    qk = KEYS.queue_for_model("m")
    deliver(conn, qk, count=1)
    assert sweep(conn, KEYS, qk) == []
    # running since a worker took its first request; not finalized while one is live
    assert load_job(conn, KEYS, "j").state == JobState.RUNNING


@pytest.mark.parametrize("state", ["queued", "running"])
def test_cancel_fills_cancelled_rows_and_keeps_finished_ones(redis_url, tmp_path, state):
    from batchgen.jobs.ops.cancellation import cancel

    conn = rconn(redis_url)
    out, qk = make_job(conn, tmp_path, 3)
    if state == "running":
        (d,) = deliver(conn, qk, count=1)
        rows = [row(0, "done before cancel")]
        commit(conn, qk, [PartCommit("j", publish(out, "a.parquet", rows), rows, [d.entry_id])])
    assert cancel(conn, KEYS, "j") == JobState.CANCELLING
    assert conn.smembers(qk.cancelled) == {b"j"}
    assert tasks.run_pending(conn, KEYS, QK.tag) == 1
    record = load_job(conn, KEYS, "j")
    assert record.state == JobState.CANCELLED
    table = pq.read_table(out / "result.parquet").to_pydict()
    first = ["length"] if state == "running" else ["cancelled"]
    assert table["finish_reason"] == [*first, "cancelled", "cancelled"]
    assert cancel(conn, KEYS, "j") == JobState.CANCELLED


def test_dead_consumers_with_nothing_pending_are_pruned(redis_url, tmp_path):
    from batchgen.jobs.ops.maintenance import prune_consumers
    from batchgen.jobs.redis import heartbeat

    conn = rconn(redis_url)
    _, qk = make_job(conn, tmp_path, 3)
    deliver(conn, qk, "holder", count=1)  # dead, but holds an entry: kept
    deliver(conn, qk, "gone", count=1)
    conn.xack(qk.stream, GROUP, *[p["message_id"] for p in conn.xpending_range(
        qk.stream, GROUP, "-", "+", 10, consumername="gone")])  # fmt: skip
    deliver(conn, qk, "alive", count=1)
    conn.xack(qk.stream, GROUP, *[p["message_id"] for p in conn.xpending_range(
        qk.stream, GROUP, "-", "+", 10, consumername="alive")])  # fmt: skip
    heartbeat.beat(conn, KEYS, "alive", {"name": "alive"}, 30)
    assert prune_consumers(conn, KEYS, qk, idle_ms=0) == ["gone"]
    names = sorted(c["name"] for c in conn.xinfo_consumers(qk.stream, GROUP))
    assert names == [b"alive", b"holder"]


def test_a_sigterm_while_a_task_runs_reaches_the_process_handler(redis_url, tmp_path):
    """Finalize tasks run in processes with SIGTERM handlers of their own (the
    supervisor's finalizer, ``batchgen run``); a SIGTERM that arrives while one
    runs must reach that handler, not rq's. The finalize here sends it to its
    own process from inside the task (through the crash-point hook)."""
    conn = rconn(redis_url)
    out, qk = make_job(conn, tmp_path, 1)
    (d,) = deliver(conn, qk)
    rows = [row(0)]
    commit(conn, qk, [PartCommit("j", publish(out, "a.parquet", rows), rows, [d.entry_id])])
    assert tasks.enqueue_finalize(conn, KEYS, qk, "j")
    got: list[int] = []
    saved = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    hook = tasks.finalize_task
    try:

        def finalize_and_sigterm(job_id: str, prefix: str):
            os.kill(os.getpid(), signal.SIGTERM)
            return hook(job_id, prefix)

        tasks.finalize_task = finalize_and_sigterm
        assert tasks.run_pending(conn, KEYS, QK.tag) == 1
    finally:
        tasks.finalize_task = hook
        signal.signal(signal.SIGTERM, saved)
    assert got == [signal.SIGTERM]
    assert load_job(conn, KEYS, "j").state == JobState.COMPLETED
