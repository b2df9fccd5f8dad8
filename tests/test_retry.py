"""``batchgen retry``: a finished job's failed rows run again; every other row stays as it was.

One module-wide story on a Redis of its own, with real ``batchgen`` processes
and a real worker on a toy checkpoint. Job ``main`` gets two injected errors: a
prompt longer than the context the first worker runs with (``--max-model-len
64``) and a poisoned request that breaks the real engine step (the chaos hook
on the worker's ``PYTHONPATH``). Job ``cx`` is cancelled before any row ran.
Then the causes are fixed (a second worker with the full context and no hook),
``main`` is retried through two kill points (``after_retry_parts``,
``after_retry_reopen``) and ``cx`` with ``--all-failed``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis

from batchgen.jobs.crashpoints import CRASH_EXIT_CODE
from batchgen.jobs.ops.carryover import carry_over, retried_mask
from batchgen.jobs.ops.chunk_append import CHUNK_ENTRIES
from batchgen.jobs.ops.fair_share import backlog
from batchgen.jobs.ops.job_record import JobRecord, load_job, queue_of_job
from batchgen.jobs.ops.lifecycle import REOPEN, JobState, script
from batchgen.jobs.redis.keys import Keys, QueueKeys
from batchgen.jobs.redis.redis_server import RedisServer
from batchgen.jobs.schema.errors import OutputError
from batchgen.jobs.schema.rows import ADDED_LATER, SCHEMA, FinishReason, Row, to_table
from batchgen.jobs.storage.output_store import OutputDir
from tests.chaos.harness import wait_until
from tests.cli_session import Shell, wait_for, write_jsonl
from tests.cli_session import rows as cli_rows
from tests.hooks import hook_env
from tests.hooks.sitecustomize import POISON_ENV, STEP_ENV

KEYS = Keys("bg")
SMALL_CONTEXT = 64
LONG = " ".join(f"word{i} the long river" for i in range(12))  # ~115 tokens


def lines_of(tag: str, n: int) -> list[dict[str, Any]]:
    return [
        {"id": f"{tag}{i}", "prompt": f"Request {i} of {tag}: the sea, item {i * 7 % 13}.",
         "max_tokens": 4 + i % 5}
        for i in range(n)
    ]  # fmt: skip


MAIN = lines_of("main", 6)
MAIN[1]["prompt"] = LONG  # too long for the first worker's context
MAIN[3]["prompt"] = "ENGINEBOOM " + MAIN[3]["prompt"]  # breaks the engine step (hook)
CX = lines_of("cx", 3)


@dataclass
class World:
    url: str
    model: Path
    tmp: Path
    env: dict[str, str]
    procs: list[subprocess.Popen] = field(default_factory=list)
    seen: dict[str, Any] = field(default_factory=dict)  # what the story saw on the way

    @property
    def conn(self) -> Any:
        return redis.Redis.from_url(self.url)

    def record(self, job_id: str) -> JobRecord:
        return load_job(self.conn, KEYS, job_id)

    def cli(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "batchgen", *args], env={**self.env, **env},
                              capture_output=True, text=True, timeout=300)  # fmt: skip

    @property
    def qk(self) -> QueueKeys:
        return KEYS.queue_for_model(str(self.model))

    def retry(self, job_id: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        """``batchgen retry``; one killed at a crash point lets go of the job's lease (1 s)
        before the next starts."""
        out = self.cli("retry", job_id, *args, BATCHGEN_FINALIZE_LEASE_S="1", **env)
        if out.returncode == CRASH_EXIT_CODE:
            lease = queue_of_job(self.conn, KEYS, job_id).job(job_id).finalizer
            wait_until(lambda: not self.conn.exists(lease), 10,
                       "the killed retry's lease to lapse")  # fmt: skip
        return out

    def submit(self, job_id: str, lines: list[dict], model: str | None = None) -> Path:
        src = self.tmp / f"{job_id}.jsonl"
        src.write_text("".join(json.dumps(line) + "\n" for line in lines))
        out = self.cli("submit", str(src), "--model", model or str(self.model), "--job-id",
                       job_id, "--output", str(self.output(job_id)))  # fmt: skip
        assert out.returncode == 0, out.stderr
        return src

    def output(self, job_id: str) -> Path:
        return self.tmp / f"out-{job_id}"

    def result(self, job_id: str) -> pa.Table:
        return pq.read_table(self.output(job_id) / "result.parquet")

    def burst_worker(self, *args: str, **env: str) -> None:
        """``batchgen worker --burst``: runs until the queue is empty and its jobs finalized."""
        log = self.tmp / f"worker-{len(self.procs)}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "batchgen", "worker", "--model", str(self.model),
                 "--device", "cpu", "--burst", "--claim-timeout", "5", *args],
                env={**self.env, **env}, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.procs.append(proc)
        assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]


@pytest.fixture(scope="module")
def world(toy_model, tmp_path_factory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("retry")
    server = RedisServer(tmp / "redis")
    server.start()
    env = {**os.environ, "BATCHGEN_REDIS_URL": server.url, "BATCHGEN_HOME": str(tmp / "home"),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip
    for name in ("BATCHGEN_TEST_CRASH_AT", POISON_ENV, STEP_ENV, "BATCHGEN_PREFIX"):
        env.pop(name, None)
    w = World(server.url, toy_model("llama"), tmp, env)
    try:
        yield w
    finally:
        for proc in w.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        server.kill()


@pytest.fixture(scope="module")
def reference(world: World) -> dict[str, list[list[int]]]:
    """Greedy token ids of ``Engine.generate`` for every line, with no fault at all."""
    import torch

    from batchgen import Engine, SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers run
    try:
        engine = Engine.from_pretrained(world.model, device="cpu")
        out = {}
        for name, lines in (("main", MAIN), ("cx", CX)):
            params = [SamplingParams(max_tokens=line["max_tokens"]) for line in lines]
            outs = engine.generate([line["prompt"] for line in lines], params)
            out[name] = [list(o.token_ids) for o in outs]
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def first(world: World) -> World:
    """The first run: ``main`` with its two faults, ``cx`` cancelled, ``waiting`` never served."""
    world.seen["main_src"] = world.submit("main", MAIN)
    world.submit("cx", CX)
    assert world.cli("cancel", "cx").returncode == 0
    world.submit("waiting", CX, model="a-model-no-worker-serves")
    poison = hook_env(poison={"ENGINEBOOM": "raise"})
    world.burst_worker("--max-model-len", str(SMALL_CONTEXT), "--max-attempts", "1", **poison)
    assert world.record("main").state == JobState.COMPLETED
    assert world.record("cx").state == JobState.CANCELLED
    world.seen["main_1"], world.seen["cx_1"] = world.result("main"), world.result("cx")
    return world


@pytest.fixture(scope="module")
def retried(first: World) -> World:
    """``main`` retried through two kill points (its input moved meanwhile), ``cx`` with
    --all-failed; then a fixed worker runs them and finalizes both again."""
    w = first
    moved = w.seen["main_src"].with_name("main-moved.jsonl")
    w.seen["main_src"].rename(moved)
    w.seen["missing_input"] = w.retry("main")
    w.seen["kill_parts"] = w.retry("main", "--input", str(moved),
                                   BATCHGEN_TEST_CRASH_AT="after_retry_parts")  # fmt: skip
    w.seen["after_parts"] = (
        w.record("main"),
        sorted(os.listdir(w.output("main") / "parts" / "main")),
    )
    w.seen["kill_reopen"] = w.retry("main", "--input", str(moved),
                                    BATCHGEN_TEST_CRASH_AT="after_retry_reopen")  # fmt: skip
    w.seen["after_reopen"] = (w.record("main"),
                              w.conn.xlen(w.qk.stream) + w.record("main").backlog)  # fmt: skip
    w.seen["status_reopened"] = w.cli("status", "main").stdout
    w.seen["resume"] = w.retry("main", "--input", str(moved))
    w.seen["again_while_running"] = w.retry("main", "--input", str(moved))
    w.seen["result_while_running"] = w.result("main")
    w.seen["status_running"] = json.loads(w.cli("status", "main", "--json").stdout)
    w.seen["cx_errors_only"] = w.retry("cx", "--errors-only")
    w.seen["cx_all_failed"] = w.retry("cx", "--all-failed")
    w.burst_worker()
    w.seen["main_2"], w.seen["cx_2"] = w.result("main"), w.result("cx")
    w.seen["status_done"] = (w.cli("status", "main").stdout,
                             json.loads(w.cli("status", "main", "--json").stdout))  # fmt: skip
    return w


def rows(table: pa.Table) -> list[dict[str, Any]]:
    return table.select(SCHEMA.names).to_pylist()


@pytest.mark.slow  # the story's two worker runs: ~60 s together
def test_the_first_run_has_the_injected_errors(first: World, reference) -> None:
    got = rows(first.seen["main_1"])
    assert [r["index"] for r in got] == list(range(6))
    too_long, poisoned = got[1], got[3]
    assert too_long["finish_reason"] == "error"
    assert too_long["error"].startswith("prompt is ") and too_long["error"].endswith(
        f"the model's context is {SMALL_CONTEXT} tokens"
    )
    assert poisoned["finish_reason"] == "error"
    assert poisoned["error"].startswith(
        "dead-lettered: delivered 2 times (max_attempts 1); the worker running it stopped "
        "every time; last error: RuntimeError: chaos: poison request "
    )
    for i in (0, 2, 4, 5):
        assert got[i]["finish_reason"] in ("stop", "length") and got[i]["error"] is None
        assert got[i]["token_ids"] == reference["main"][i]
    assert [r["finish_reason"] for r in rows(first.seen["cx_1"])] == ["cancelled"] * 3


@pytest.mark.slow  # the story's two worker runs: ~60 s together
def test_refusals(first: World) -> None:
    w = first
    out = w.cli("retry", "waiting")
    assert (out.returncode, out.stdout) == (1, "")
    assert out.stderr == (
        "batchgen: error: job 'waiting' is queued (0/3 rows); only a finished job "
        "(completed or cancelled) can be retried\n"
    )
    assert w.cli("delete", "waiting", "--force").returncode == 0
    out = w.cli("retry", "waiting")
    assert out.returncode == 1
    assert out.stderr == (
        "batchgen: error: no job 'waiting' in this Redis: it was deleted, or its state expired "
        "after its retention (submit --retention), and a retry needs it; submit the input again "
        "as a new job\n"
    )
    # a file that no longer holds the job's requests is refused; the job stays as it was
    changed = w.tmp / "changed.jsonl"
    changed.write_text("".join(json.dumps(line) + "\n" for line in MAIN[:5]))
    out = w.cli("retry", "main", "--input", str(changed))
    assert out.returncode == 1
    assert f"{changed} does not hold job 'main''s requests any more (5 lines" in out.stderr
    assert "Traceback" not in out.stderr
    record = w.record("main")
    assert (record.state, record.retry_rounds) == (JobState.COMPLETED, 0)


@pytest.mark.slow  # the story's two worker runs: ~60 s together
def test_retry_replaces_only_the_failed_rows(retried: World, reference) -> None:
    w = retried
    before, after = w.seen["main_1"], w.seen["main_2"]
    assert after.num_rows == len(MAIN)
    assert after.column("index").to_pylist() == list(range(len(MAIN)))
    assert after.column("id").to_pylist() == [line["id"] for line in MAIN]
    new = rows(after)
    old = rows(before)
    for i in (1, 3):  # the retried rows are good now, token for token
        assert new[i]["finish_reason"] in ("stop", "length") and new[i]["error"] is None, new[i]
        assert new[i]["token_ids"] == reference["main"][i]
        assert new[i]["attempts"] == old[i]["attempts"] + 1  # the fixed worker ran it once
    assert (old[1]["attempts"], old[3]["attempts"]) == (1, 2)  # refused; ran, crashed twice
    kept = pa.array([0, 2, 4, 5])
    old_kept, new_kept = (
        before.select(SCHEMA.names).take(kept),
        after.select(SCHEMA.names).take(kept),
    )
    assert rows(new_kept) == rows(old_kept)  # every column of every kept row
    assert new_kept.equals(old_kept)
    record = w.record("main")
    assert (record.state, record.done, record.failed, record.total) == (JobState.COMPLETED, 6, 0, 6)
    assert (record.retried, record.retry_rounds) == (2, 1)
    assert record.completion_tokens == sum(len(t) for t in reference["main"])
    manifest = json.loads((w.output("main") / "manifest.json").read_text())
    assert (
        manifest["counts"]["rows"] == 6
        and manifest["counts"]["by_finish_reason"].get("error") is None
    )
    # finalize cleaned up: the kept parts and the workers' parts are gone, the stream is empty
    assert sorted(os.listdir(w.output("main"))) == [
        "batchgen-job.json",
        "manifest.json",
        "result.parquet",
    ]
    assert w.conn.xlen(w.qk.stream) == 0


@pytest.mark.slow  # the story's two worker runs: ~60 s together
def test_status_shows_the_retried_rows_and_rounds(retried: World) -> None:
    running = retried.seen["status_running"]
    assert (running["state"], running["retried"], running["retry_rounds"]) == ("running", 2, 1)
    assert (running["done"], running["failed"], running["queued"]) == (4, 0, 2)
    assert running["retry_incomplete"] is False
    text, done = retried.seen["status_done"]
    assert (done["state"], done["retried"], done["retry_rounds"]) == ("completed", 2, 1)
    assert "retried    2 rows in 1 retry round(s)\n" in text


@pytest.mark.slow  # the story's two worker runs: ~60 s together
def test_a_retry_killed_halfway_goes_on_when_run_again(retried: World) -> None:
    w = retried.seen
    missing = w["missing_input"]
    assert missing.returncode == 2
    assert missing.stderr.startswith(
        "batchgen: error: the job's input cannot be read: cannot read "
    )
    assert missing.stderr.rstrip().endswith("if it moved, pass a copy with --input PATH")
    # killed after writing the kept rows' parts: the job itself is untouched
    assert w["kill_parts"].returncode == CRASH_EXIT_CODE, w["kill_parts"].stderr
    record, parts = w["after_parts"]
    assert (record.state, record.retry_rounds, record.retried) == (JobState.COMPLETED, 0, 0)
    assert parts == ["retry-1-000000.parquet"]
    # killed after re-opening the job: running, nothing queued yet, status says what to do
    assert w["kill_reopen"].returncode == CRASH_EXIT_CODE, w["kill_reopen"].stderr
    record, queued = w["after_reopen"]
    assert (record.state, record.retry_rounds, record.retried) == (JobState.RUNNING, 1, 2)
    assert (record.done, record.failed, record.enqueued, record.retry_cursor) == (4, 0, 4, 0)
    assert record.retry_incomplete and not record.closed and queued == 0
    assert "[retry incomplete: `batchgen retry main` queues the rest]" in w["status_reopened"]
    # run again: it goes on from where it stopped, queuing exactly the two retried rows
    assert w["resume"].returncode == 0, w["resume"].stderr
    assert (
        w["resume"].stdout
        == "main: went on with retry 1: queued 2 more row(s); the job is running\n"
    )
    assert w["result_while_running"].equals(w["main_1"])  # the previous result stays till then
    again = w["again_while_running"]
    assert again.returncode == 1
    assert "job 'main' is running (4/6 rows); only a finished job" in again.stderr


@pytest.mark.slow  # the story's two worker runs: ~60 s together
def test_all_failed_reruns_the_cancelled_rows(retried: World, reference) -> None:
    w = retried.seen
    assert w["cx_errors_only"].returncode == 0
    assert w["cx_errors_only"].stdout == (
        "cx: nothing to retry (no row has finish_reason error); `batchgen retry cx --all-failed` "
        "runs its 3 cancelled row(s) again\n"
    )
    assert w["cx_all_failed"].stdout == "cx: retry 1: queued 3 row(s) again; the job is running\n"
    got = rows(w["cx_2"])
    assert [r["id"] for r in got] == [line["id"] for line in CX]
    assert [r["token_ids"] for r in got] == reference["cx"]
    assert all(r["finish_reason"] in ("stop", "length") for r in got)
    assert retried.record("cx").state == JobState.COMPLETED


def test_a_retry_killed_between_chunks_queues_each_row_once(world: World) -> None:
    """A cancelled job that no worker ever served: the cancel dropped its backlog.
    ``--all-failed`` queues the first chunk, is killed; run again, it queues the rest:
    every input exactly once, at its own index, with its own request."""
    n = CHUNK_ENTRIES + 300
    lines = [{"id": f"b{i}", "prompt": f"p{i}"} for i in range(n)]
    world.submit("bulk", lines, model="bulk-model")
    assert world.cli("cancel", "bulk").returncode == 0
    assert world.cli("finalize", "bulk").returncode == 0
    qk = KEYS.queue_for_model("bulk-model")
    assert world.conn.xlen(qk.stream) == 0 and backlog.queued(world.conn, qk, "bulk") == []
    out = world.retry("bulk", "--all-failed", BATCHGEN_TEST_CRASH_AT="after_retry_chunk:1")
    assert out.returncode == CRASH_EXIT_CODE, out.stderr
    record = world.record("bulk")
    assert (record.state, record.retry_cursor, record.enqueued) == (
        JobState.RUNNING,
        CHUNK_ENTRIES,
        CHUNK_ENTRIES,
    )
    assert len(backlog.queued(world.conn, qk, "bulk")) == CHUNK_ENTRIES
    out = world.retry("bulk")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "bulk: went on with retry 1: queued 300 more row(s); the job is running\n"
    entries = backlog.queued(world.conn, qk, "bulk")
    assert [index for index, _, _ in entries] == list(range(n))
    assert [json.loads(request)["id"] for _, _, request in entries] == [
        line["id"] for line in lines
    ]
    record = world.record("bulk")
    assert (record.enqueued, record.retry_cursor, record.retried) == (n, n, n)
    assert record.backlog == n and not record.retry_incomplete


def test_a_clean_up_a_killed_finalizer_left_is_finished_first(world: World) -> None:
    """Finalize killed after marking the job cancelled, before its clean-up: the job is
    finished but still active. The retry finishes the clean-up, then re-opens it."""
    world.submit("tidy", CX[:2], model="tidy-model")
    assert world.cli("cancel", "tidy").returncode == 0
    out = world.cli("finalize", "tidy", BATCHGEN_TEST_CRASH_AT="after_finalize_commit",
                    BATCHGEN_FINALIZE_LEASE_S="1")  # fmt: skip
    assert out.returncode == CRASH_EXIT_CODE, out.stderr
    qk = KEYS.queue_for_model("tidy-model")
    assert world.record("tidy").state == JobState.CANCELLED
    assert world.conn.sismember(qk.active, "tidy") and not world.conn.zscore(qk.expiring, "tidy")
    wait_until(lambda: not world.conn.exists(qk.job("tidy").finalizer), 10, "the lease to lapse")
    out = world.retry("tidy", "--all-failed")
    assert out.stdout == "tidy: retry 1: queued 2 row(s) again; the job is running\n", out.stderr
    record = world.record("tidy")
    assert (record.state, record.enqueued, record.retry_cursor) == (JobState.RUNNING, 2, 2)
    assert world.conn.sismember(qk.active, "tidy") and not world.conn.zscore(qk.expiring, "tidy")
    assert [index for index, _, _ in backlog.queued(world.conn, qk, "tidy")] == [0, 1]


def test_kept_rows_are_written_back_in_bounded_parts(tmp_path: Path) -> None:
    """Parts of at most ``part_rows`` rows, the retried rows left out, commit records right."""
    out = OutputDir.open(str(tmp_path))
    reasons = ["stop", "error", "length", "cancelled", "stop", "error", "length"]
    table = to_table([
        Row(index=i, finish_reason=FinishReason(r), token_ids=[i] * i, prompt_tokens=10 + i,
            completion_tokens=i, reasoning_tokens=i // 2) for i, r in enumerate(reasons)
    ])  # fmt: skip
    pq.write_table(table, tmp_path / "result.parquet")
    errors = retried_mask(out, len(reasons), frozenset({"error"}))
    assert np.flatnonzero(errors).tolist() == [1, 5]
    kept = carry_over(out, "j", 2, errors, part_rows=2)
    metas = [(name, json.loads(meta)) for name, meta in kept.parts]
    assert [name for name, _ in metas] == [f"parts/j/retry-2-{k:06d}.parquet" for k in range(3)]
    assert [(m["rows"], m["lo"], m["hi"], m["lost"]) for _, m in metas] == [
        (2, 0, 2, []), (2, 3, 4, []), (1, 6, 6, []),
    ]  # fmt: skip
    read = pa.concat_tables(pq.read_table(tmp_path / n, schema=SCHEMA) for n, _ in kept.parts)
    assert read.equals(table.take(pa.array([0, 2, 3, 4, 6])))
    assert (kept.rows, kept.done, kept.failed) == (5, 4, 1)
    # the finished rows' tokens; the cancelled row (3) is not billed: its input apart
    assert kept.tokens == {
        "prompt_tokens": 10 + 12 + 14 + 16,
        "completion_tokens": 2 + 4 + 6,
        "cached_tokens": 0,
        "failed_prompt_tokens": 13,
        "reasoning_tokens": 0 + 1 + 2 + 3,  # of the finished kept rows 0, 2, 4, 6
    }
    with pytest.raises(OutputError, match="does not hold one row per input"):
        retried_mask(out, 8, frozenset({"error"}))
    pq.write_table(table.drop_columns(["worker"]), tmp_path / "result.parquet")
    with pytest.raises(OutputError, match=r"result\.parquet has no column worker"):
        carry_over(out, "j", 2, errors)
    # a result written before the later columns existed: they read as their defaults
    older = table.drop_columns(sorted(ADDED_LATER))
    pq.write_table(older, tmp_path / "result.parquet")
    again = carry_over(out, "j", 3, errors, part_rows=8)
    ((name, _),) = again.parts
    read = pq.read_table(tmp_path / name, schema=SCHEMA)
    position = SCHEMA.get_field_index("reasoning_tokens")  # null: no reasoning parser then
    before = table.set_column(position, SCHEMA.field(position), pa.nulls(7, pa.int32()))
    assert read.equals(before.take(pa.array([0, 2, 3, 4, 6])))
    assert read.column("cached").to_pylist() == [False] * 5


REOPEN_TEST = script(
    "test reopen", keys=["job"], body="reopen(job, redis.call('HGET', job, 'state')) return 1"
)


@pytest.mark.parametrize("src", list(JobState), ids=lambda s: s.value)
def test_only_a_finished_job_can_be_reopened(src: JobState, world: World) -> None:
    conn = world.conn
    conn.delete("t:job")
    conn.hset("t:job", "state", src.value)
    if src in REOPEN:
        assert src.terminal
        REOPEN_TEST(conn, job="t:job")
        assert conn.hget("t:job", "state").decode() == REOPEN[src].value
    else:
        with pytest.raises(redis.ResponseError, match=f"cannot be reopened from {src.value}"):
            REOPEN_TEST(conn, job="t:job")


def test_a_table_job_is_read_again_with_its_own_flags(world: World) -> None:
    """A Parquet job (template, id column, kept column) cancelled before it ran: the retry
    reads the table again with the flags the job recorded and queues the very requests."""
    path = world.tmp / "docs.parquet"
    pq.write_table(pa.table({"doc": ["d0", "d1", "d2"], "title": ["a", "b", "c"],
                             "max_tokens": [3, None, 5]}), path)  # fmt: skip
    flags = [
        "--template",
        "Title: {title}\\nEnd",
        "--id-column",
        "doc",
        "--keep-columns",
        "doc",
        "--sampling-columns",
        "max_tokens",
    ]
    out = world.cli("submit", str(path), "--model", "table-model", "--job-id", "tbl",
                    "--output", str(world.output("tbl")), *flags)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert world.record("tbl").table  # the flags, kept for the retry
    qk = KEYS.queue_for_model("table-model")
    submitted = [(i, r) for i, _, r in backlog.queued(world.conn, qk, "tbl")]
    assert [json.loads(r)["s"].get("max_tokens") for _, r in submitted] == [3, 16, 5]
    assert json.loads(submitted[0][1])["p"] == "Title: a\nEnd"
    assert world.cli("cancel", "tbl").returncode == 0
    assert world.cli("finalize", "tbl").returncode == 0
    out = world.retry("tbl", "--all-failed")
    assert out.stdout == "tbl: retry 1: queued 3 row(s) again; the job is running\n", out.stderr
    assert [(i, r) for i, _, r in backlog.queued(world.conn, qk, "tbl")] == submitted


def test_a_relative_input_path_is_recorded_absolute(world: World) -> None:
    """So a retry run from another directory reads the very file the job was submitted from."""
    (world.tmp / "rel.jsonl").write_text('{"prompt": "a"}\n')
    out = subprocess.run(
        [sys.executable, "-m", "batchgen", "submit", "rel.jsonl", "--model", "rel-model",
         "--job-id", "rel", "--output", str(world.output("rel"))],
        env=world.env, cwd=world.tmp, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert world.record("rel").source == str(world.tmp / "rel.jsonl")


ATTEMPT_LINES = [
    '{"id": "ok0", "prompt": "the sea", "max_tokens": 2}',
    json.dumps({"id": "long1", "prompt": LONG, "max_tokens": 2}),  # past --max-model-len 64
    '{"id": "bad2", "prompt": "", "max_tokens": 2}',  # invalid: an error row from submit on
    '{"id": "ok3", "prompt": "the river", "max_tokens": 2}',
    json.dumps({"id": "long4", "prompt": LONG + " again", "max_tokens": 2}),
]


def test_each_retry_counts_its_attempt_on_the_rows_it_ran(
    tmp_path: Path, toy_model, private_redis: RedisServer
) -> None:
    """A job whose two over-long prompts fail at admission, retried twice by a worker that
    still runs a context too small for them: each retry's delivery counts in the rows it
    ran again (2, then 3); the good rows and the invalid line's row stay at 1, and status
    and the manifest count what the rows say."""
    (tmp_path / "tiny").symlink_to(toy_model("llama"))
    shell = Shell(tmp_path, tmp_path / "home", private_redis.url)
    conn = redis.Redis.from_url(private_redis.url)
    try:
        write_jsonl(tmp_path / "a.jsonl", ATTEMPT_LINES)
        shell.ok("submit", "a.jsonl", "--model", "tiny", "--skip-invalid", "--job-id", "a",
                 "--output", str(tmp_path / "out-a"))  # fmt: skip
        shell.start("worker", "--model", "tiny", "--device", "cpu",
                    "--max-model-len", str(SMALL_CONTEXT))  # fmt: skip

        def finished(want: list[int], retried: int, rounds: int) -> None:
            wait_for(lambda: load_job(conn, KEYS, "a").state == JobState.COMPLETED,
                     "job a to complete")  # fmt: skip
            status = shell.status("a")
            assert (status["retried"], status["retry_rounds"]) == (retried, rounds)
            assert (status["done"], status["failed"]) == (2, 3)
            shell.ok("download", "a", "-o", "a.parquet", "--force")
            got = cli_rows(tmp_path / "a.parquet")
            assert got["id"] == ["ok0", "long1", "bad2", "ok3", "long4"]  # skip-invalid keeps ids
            assert got["finish_reason"] == ["length", "error", "error", "length", "error"]
            assert got["error"][1].endswith(f"the model's context is {SMALL_CONTEXT} tokens")
            assert got["attempts"] == want
            # every delivery past the first of each row was a retry's
            assert sum(got["attempts"]) - len(ATTEMPT_LINES) == retried
            manifest = json.loads((tmp_path / "out-a" / "manifest.json").read_text())
            assert manifest["counts"] == {
                "rows": 5, "total": 5, "skipped_invalid_lines": 1,
                "by_finish_reason": {"error": 3, "length": 2}, "filled_by_finalize": 0,
                "retried": retried, "retry_rounds": rounds,
            }  # fmt: skip

        finished([1, 1, 1, 1, 1], retried=0, rounds=0)
        again = "a: retry {}: queued 2 row(s) again; the job is running\n"
        assert shell.ok("retry", "a") == again.format(1)
        finished([1, 2, 1, 1, 2], retried=2, rounds=1)
        assert shell.ok("retry", "a") == again.format(2)
        finished([1, 3, 1, 1, 3], retried=4, rounds=2)
    finally:
        shell.stop_all()


def test_a_cancelled_job_retried_without_all_failed_names_the_option(world: World) -> None:
    """Only cancelled rows and the default ``--errors-only``: nothing runs, and the
    message names the option that would run them."""
    world.submit("hint", CX[:2], model="hint-model")
    assert world.cli("cancel", "hint").returncode == 0
    assert world.cli("finalize", "hint").returncode == 0
    out = world.retry("hint")
    assert out.returncode == 0, out.stderr
    assert out.stdout == (
        "hint: nothing to retry (no row has finish_reason error); `batchgen retry hint "
        "--all-failed` runs its 2 cancelled row(s) again\n"
    )
    assert world.record("hint").state == JobState.CANCELLED
