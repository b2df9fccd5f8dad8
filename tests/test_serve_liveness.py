"""``batchgen serve`` never gets stuck: kill -9 mid-validation and mid-output (leases taken
over within seconds), an input file deleted mid-run, two servers with different files
dirs on one Redis, a busy port. Real processes: redis-server, a CPU worker, servers
frozen at crash points and kill -9'ed, the official ``openai`` client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
from openai import OpenAI

from batchgen.jobs.redis.keys import Keys
from benchmarks.soak_checks import dump_redis
from tests.serve_stack import KEY, Stack, private_stack, wait_for

DONE = ("completed", "failed", "cancelled", "expired")
LEASE = "2"  # seconds: how soon a dead server's batch is taken over


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, toy_model) -> Iterator[Stack]:
    """A private redis-server and one CPU worker, for every server these tests start."""
    with private_stack(tmp_path_factory.mktemp("serve-liveness"), toy_model("llama")) as fleet:
        fleet.worker(fleet.model, "--max-num-seqs", "4")  # type: ignore[attr-defined]
        yield fleet


def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=stack.base + "/v1", api_key=KEY, max_retries=0, timeout=60)


def rows(model: str, n: int, prefix: str, max_tokens: int = 4) -> bytes:
    lines = [{"custom_id": f"{prefix}-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": f"{prefix} number {i}",
                       "max_tokens": max_tokens}} for i in range(n)]  # fmt: skip
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def create(c: OpenAI, data: bytes, priority: int = 0) -> Any:
    file = c.files.create(file=("in.jsonl", data), purpose="batch")
    return c.batches.create(input_file_id=file.id, endpoint="/v1/completions",
                            completion_window="24h",
                            metadata={"priority": str(priority)})  # fmt: skip


def status_of(c: OpenAI, batch_id: str) -> str:
    return c.batches.retrieve(batch_id).status


def counts(c: OpenAI, batch_id: str) -> Any:
    """The batch's request_counts (always there on this server's batches)."""
    got = c.batches.retrieve(batch_id).request_counts
    assert got is not None
    return got


def finished(c: OpenAI, batch_id: str, timeout: float = 300) -> Any:
    wait_for(lambda: status_of(c, batch_id) in DONE, timeout, f"batch {batch_id} to end")
    return c.batches.retrieve(batch_id)


def lines(c: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in c.files.content(file_id).text.splitlines()]


def reached(stack: Stack, point: str) -> bool:
    return f"crash point {point} reached" in stack.log(stack.server_log)


def temp_files(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith(".tmp-"))


def test_serve_killed_mid_validation_and_mid_output_is_taken_over(fleet, tmp_path):
    """Each server dies at a crash point (frozen there, then kill -9); the next server on
    the same files dir takes its batches over once the dead one's lease expires."""
    model = str(fleet.model)
    stack = Stack(fleet.redis_url, tmp_path)
    crash = "BATCHGEN_TEST_CRASH_AT"
    try:
        # 1. frozen validating batch A, then killed: the next server gets a cancel of A
        # (its lease outlives the next server's start: A is cancelled while it is held)
        stack.env[crash] = "serve_validating:1:stop"
        stack.serve("--api-key", KEY, "--lease", "15", name="serve-1")
        a = create(client(stack), rows(model, 3, "a"))
        wait_for(lambda: reached(stack, "serve_validating"), 60, "validation to freeze")
        stack.kill_server()
        # 2. the next one freezes at its second validation: B's (A's is the first)
        stack.env[crash] = "serve_validating:2:stop"
        stack.serve("--api-key", KEY, "--lease", LEASE, name="serve-2")
        started = time.monotonic()
        assert client(stack).batches.cancel(a.id).status == "cancelling"
        assert finished(client(stack), a.id, 60).status == "cancelled"
        took_over = time.monotonic() - started
        b = create(client(stack), rows(model, 5, "b"))
        wait_for(lambda: reached(stack, "serve_validating"), 60, "validation to freeze")
        stack.kill_server()
        # 3. the next one takes B over and freezes half way through its output files
        stack.env[crash] = "serve_writing_outputs:1:stop"
        stack.serve("--api-key", KEY, "--lease", LEASE, name="serve-3", or_frozen=True)
        wait_for(lambda: reached(stack, "serve_writing_outputs"), 120, "output to freeze")
        conn: Any = redis.Redis.from_url(fleet.redis_url)  # (the frozen server cannot answer)
        assert conn.hget(Keys("bg").batch(b.id), "state") == b"submitted"  # outputs unwritten
        assert temp_files(tmp_path / "files")  # half-written output files
        stack.kill_server()
        # 4. a server without faults writes them: one line per request, nothing left over
        del stack.env[crash]
        stack.serve("--api-key", KEY, "--lease", LEASE, name="serve-4")
        started = time.monotonic()
        c = client(stack)
        batch = finished(c, b.id, 60)
        finished_in = time.monotonic() - started
        assert batch.status == "completed" and batch.request_counts.completed == 5
        assert sorted(x["custom_id"] for x in lines(c, batch.output_file_id)) == [
            f"b-{i}" for i in range(5)]  # fmt: skip
        assert batch.error_file_id is None
        assert counts(c, a.id).total == 0  # never submitted
        wait_for(lambda: temp_files(tmp_path / "files") == [], 30, "dead writes' temp files")
        print(
            f"cancel after a kill -9 mid-validation done in {took_over:.1f} s; output "
            f"after a kill -9 mid-write done in {finished_in:.1f} s (lease {LEASE} s)"
        )
        assert took_over < 30 and finished_in < 30  # not the old lock's 3,600 s
    finally:
        stack.stop()


def test_an_input_file_deleted_mid_run_never_sticks_a_batch(fleet, tmp_path):
    stack = Stack(fleet.redis_url, tmp_path)
    model = str(fleet.model)
    try:
        stack.serve("--api-key", KEY)
        c = client(stack)
        runs = create(c, rows(model, 24, "run", max_tokens=24))
        # a lower class with long answers: the worker takes its requests only once "run"'s
        # are all in flight, and cannot finish them before the cancel below
        stops = create(c, rows(model, 24, "stop", max_tokens=400), priority=-1)
        wait_for(lambda: counts(c, runs.id).completed > 0, 120,
                 "the first rows")  # fmt: skip
        for batch in (runs, stops):
            assert c.files.delete(batch.input_file_id).deleted  # mid-run
            with pytest.raises(openai.NotFoundError):
                c.files.retrieve(batch.input_file_id)
        assert (tmp_path / "files" / runs.input_file_id).exists()  # kept while read
        c.batches.cancel(stops.id)
        for batch, status in ((runs, "completed"), (stops, "cancelled")):
            done = finished(c, batch.id)
            assert done.status == status
            got = lines(c, done.output_file_id) + lines(c, done.error_file_id)
            prefix = "run" if batch.id == runs.id else "stop"
            assert sorted(x["custom_id"] for x in got) == sorted(f"{prefix}-{i}"
                                                                 for i in range(24))  # fmt: skip
            input_bytes = tmp_path / "files" / batch.input_file_id
            wait_for(lambda: not input_bytes.exists(), 30,  # noqa: B023 (called here only)
                     "the deleted input's bytes to go once its batch ended")  # fmt: skip
        # bytes removed behind the server's back: every request still gets its line
        gone = create(c, rows(model, 24, "gone", max_tokens=48))
        wait_for(lambda: status_of(c, gone.id) == "in_progress", 60, "the batch to run")
        os.unlink(tmp_path / "files" / gone.input_file_id)
        c.batches.cancel(gone.id)
        done = finished(c, gone.id, 60)
        got = lines(c, done.output_file_id) + lines(c, done.error_file_id)
        assert done.status == "cancelled" and len(got) == 24
        assert {x["custom_id"] for x in got} <= {f"gone-{i}" for i in range(24)} | {None}
        assert "Traceback" not in stack.log("serve")
    finally:
        stack.stop()


def test_two_servers_with_their_own_files_dirs_leave_each_other_alone(fleet, tmp_path):
    first, second = Stack(fleet.redis_url, tmp_path / "a"), Stack(fleet.redis_url, tmp_path / "b")
    for s in (first, second):
        s.tmp.mkdir()
    try:
        first.serve("--api-key", KEY)
        second.serve("--api-key", KEY)
        c1, c2 = client(first), client(second)
        batch = finished(c1, create(c1, rows(str(fleet.model), 3, "two")).id)
        assert batch.status == "completed"
        assert (first.tmp / "files" / batch.output_file_id).exists()
        assert not (second.tmp / "files").exists() or os.listdir(second.tmp / "files") == []
        assert c2.batches.retrieve(batch.id).status == "completed"  # the record is shared
        with pytest.raises(openai.NotFoundError) as elsewhere:
            c2.files.content(batch.output_file_id)
        assert elsewhere.value.body["code"] == "file_elsewhere"  # type: ignore[index]
        time.sleep(2)  # two sweeps of the second server over the first one's batch
        assert "Traceback" not in second.log("serve")
        assert "sweeping batch" not in second.log("serve")
        # a third server on the first one's port fails at once, before it sweeps anything
        conn: Any = redis.Redis.from_url(fleet.redis_url)
        servers = conn.keys("bg:serve:instance:*")
        busy = subprocess.run(
            [sys.executable, "-m", "batchgen", "serve", "--port", str(first.port), "--api-key",
             KEY, "--files-dir", str(tmp_path / "c")],
            env={**os.environ, "BATCHGEN_REDIS_URL": fleet.redis_url}, capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
        assert busy.returncode == 2 and busy.stdout == ""
        assert busy.stderr == (f"batchgen: error: cannot listen on 127.0.0.1:{first.port}: "
                               "Address already in use\n")  # fmt: skip
        assert set(conn.keys("bg:serve:instance:*")) <= set(servers)  # it never started
        assert not (tmp_path / "c").exists()
    finally:
        first.stop()
        second.stop()


def mentions(conn: Any, text: str) -> list[str]:
    """Every Redis key whose name or value holds ``text``."""
    return [key for key, value in dump_redis(conn).items() if text in key or text in value]


def test_files_and_batches_expire_and_delete_removes_a_batch_whole(fleet, tmp_path):
    from click.testing import CliRunner

    from batchgen.cli import main

    stack = Stack(fleet.redis_url, tmp_path)
    conn: Any = redis.Redis.from_url(fleet.redis_url)
    keys, files = Keys("bg"), tmp_path / "files"
    try:
        stack.serve("--api-key", KEY)
        c = client(stack)
        data = rows(str(fleet.model), 3, "exp")
        kept = c.files.create(file=("kept.jsonl", data), purpose="batch")
        assert kept.expires_at == kept.created_at + 30 * 86400  # --file-expiry's default
        short = c.files.create(file=("short.jsonl", data), purpose="batch",
                               expires_after={"anchor": "created_at", "seconds": 3600})  # fmt: skip
        assert short.expires_at == short.created_at + 3600
        with pytest.raises(openai.BadRequestError) as refused:
            c.files.create(file=("x.jsonl", data), purpose="batch",
                           expires_after={"anchor": "created_at", "seconds": 60})  # fmt: skip
        assert refused.value.body["param"] == "expires_after"  # type: ignore[index]
        batch = finished(c, c.batches.create(
            input_file_id=kept.id, endpoint="/v1/completions", completion_window="24h",
            output_expires_after={"anchor": "created_at", "seconds": 7200}).id)  # fmt: skip
        out = c.files.retrieve(batch.output_file_id)
        assert out.expires_at == out.created_at + 7200
        # an hour passes for `short` (its expiry moved to now; the real sweep does the rest)
        conn.zadd(keys.expiring_files(str(files)), {short.id: time.time()})
        wait_for(lambda: not (files / short.id).exists(), 30, "the expired file to go")
        with pytest.raises(openai.NotFoundError):
            c.files.retrieve(short.id)
        # two hours pass for the batch's output: the batch goes with it
        conn.zadd(keys.expiring_batches(str(files)), {batch.id: time.time()})
        wait_for(lambda: not conn.exists(keys.batch(batch.id)), 30, "the expired batch to go")
        with pytest.raises(openai.NotFoundError):
            c.batches.retrieve(batch.id)
        assert not (files / batch.output_file_id).exists()
        assert c.files.retrieve(kept.id).id == kept.id  # the input is the user's own
        # `batchgen delete` of a serve batch: its job, record, output files; nothing mentions it
        other = finished(c, c.batches.create(input_file_id=kept.id, endpoint="/v1/completions",
                                             completion_window="24h").id)  # fmt: skip
        assert mentions(conn, other.id)
        kept_out = c.files.retrieve(other.output_file_id)  # --output-expiry's default: 30 days
        assert kept_out.expires_at == kept_out.created_at + 30 * 86400
        result = CliRunner().invoke(main, ["delete", other.id, "--redis", fleet.redis_url])
        assert result.exit_code == 0, result.output
        assert result.output.endswith(f"; deleted batch {other.id} and its 1 output files\n")
        assert mentions(conn, other.id) == [Keys("bg").deleted(other.id)]  # its tombstone alone
        assert not (files / other.output_file_id).exists()
        with pytest.raises(openai.NotFoundError):
            c.files.retrieve(other.output_file_id)
    finally:
        stack.stop()


def test_a_batch_waits_for_a_worker_that_is_still_starting(fleet, toy_model, tmp_path):
    """A worker supervisor announces its model before its engine loads and hashes the
    weights (frozen here with SIGSTOP): a batch for that model waits instead of failing
    with model_not_found, and fails with that reason once --model-wait passes."""
    import psutil

    from batchgen.jobs.redis.heartbeat import live_workers, starting_queues

    model = toy_model("llama", seed=7)  # a model only the worker started here serves
    stack = Stack(fleet.redis_url, tmp_path)
    conn: Any = redis.Redis.from_url(fleet.redis_url)
    keys = Keys("bg")
    try:
        stack.serve("--api-key", KEY, "--model-wait", "2", name="serve-short")
        supervisor = stack._start("late-worker", "worker", "--model", str(model), "--device",
                                  "cpu")  # fmt: skip
        wait_for(lambda: psutil.Process(supervisor.pid).children(), 60, "its engine process")
        (engine,) = psutil.Process(supervisor.pid).children()
        engine.suspend()  # loading its model: no heartbeat yet
        wait_for(lambda: str(model) in starting_queues(conn, keys), 30, "the announcement")
        assert [w for w in live_workers(conn, keys) if w["queue"] == str(model)] == []
        c = client(stack)
        failed = finished(c, create(c, rows(str(model), 1, "never")).id, 60)
        (error,) = failed.errors.data
        assert (error.code, error.message) == ("model_not_found", (
            f"a worker was starting for the model {str(model)!r} but none served it "
            "within 2 s"))  # fmt: skip
        stack.kill_server()
        stack.serve("--api-key", KEY, "--model-wait", "120", name="serve-long")
        c = client(stack)
        batch = create(c, rows(str(model), 2, "late"))
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:  # it waits (the old server failed it at once)
            assert status_of(c, batch.id) == "validating"
            time.sleep(0.2)
        engine.resume()
        done = finished(c, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 2
    finally:
        stack.stop()
