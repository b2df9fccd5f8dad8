"""Redis itself fails: SIGKILL and restart (with its AOF, and without any data),
unreachable, out of memory, an evicting server, entries trimmed from under the workers."""

from __future__ import annotations

import json
import signal
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.jobs.crashpoints import CRASH_EXIT_CODE
from batchgen.jobs.ops import chunk_append
from batchgen.jobs.ops.fair_share import backlog
from batchgen.jobs.ops.finalize.result import LOST
from batchgen.jobs.redis.keys import GROUP
from batchgen.jobs.redis.redis_server import RedisServer
from batchgen.worker.consumer.queue import HandBack, hand_back, read_new
from tests.chaos.harness import (
    Chaos,
    assert_exactly_once,
    assert_nothing_left,
    prompt_lines,
    rconn,
    wait_until,
    write_jsonl,
)


def finished(chaos: Chaos, job_id: str) -> bool:
    return chaos.record(job_id).state.terminal


def stream_indices(chaos: Chaos, job_id: str) -> list[int]:
    """The job's queued requests' input indices (in its backlog until a worker takes them)."""
    return [index for index, _, _ in backlog.queued(chaos.conn, chaos.qk, job_id)]


def test_redis_killed_mid_job_and_restarted_on_its_aof_loses_nothing(chaos_private, reference):
    """kill -9 of redis-server while a worker generates; ``status`` and ``submit``
    started while it is down wait for it; everything acknowledged before is there
    after the restart, and both jobs complete with exactly the fault-free rows."""
    chaos = chaos_private
    assert chaos.server is not None
    # paced (a step >= 20 ms, a row >= 1 s, the job >= 12 s on 2 slots): the first
    # commits (every 2 s) come well before the end however fast the machine
    lines = prompt_lines(24, "aof", max_tokens=(48, 64))
    out = chaos.submit("aof", lines)  # acknowledged (exit 0) before the crash
    worker = chaos.worker_cli("sup", "--claim-timeout", "2", "--max-num-seqs", "2", step_s=0.02)
    wait_until(lambda: chaos.record("aof").done >= 2, 120, "some committed rows")
    chaos.server.kill()
    down_since = time.monotonic()
    status = chaos.cli_start("status", "status", "aof", "--json")
    later = prompt_lines(6, "late")
    src = write_jsonl(chaos.tmp / "late.jsonl", later)
    late = chaos.cli_start("submit-late", "submit", str(src), "--model", str(chaos.model),
                           "--job-id", "late", "--output", str(chaos.output("late")))  # fmt: skip
    wait_until(lambda: "Redis unavailable" in worker.tail(), 30, "the worker to notice")
    # The outage lasts 2 s: the commands (up in ~0.5 s) find no server at first and
    # must wait for it (BATCHGEN_REDIS_WAIT, 10 s); without waiting they exit 1.
    time.sleep(max(0.0, 2.0 - (time.monotonic() - down_since)))
    assert status.alive() and late.alive()
    chaos.server.start()  # same dir: its AOF (fsynced before each reply) is replayed
    assert status.wait(60) == 0, status.tail()
    reported = json.loads(status.tail().strip().splitlines()[-1])
    assert (reported["job_id"], reported["total"]) == ("aof", 24)
    assert reported["state"] in ("running", "finalizing", "completed")
    assert late.wait(60) == 0, late.tail()
    for job_id in ("aof", "late"):
        wait_until(partial(finished, chaos, job_id), 300, f"{job_id} to finish")
    worker.kill(signal.SIGTERM)
    assert worker.wait(60) == 0, worker.tail()
    for job_id, job_lines in (("aof", lines), ("late", later)):
        rows = chaos.result(job_id)
        assert_exactly_once(rows, job_lines, reference(job_lines))
        assert_nothing_left(chaos, job_id, chaos.output(job_id))
    assert out == chaos.output("aof")


def test_redis_that_lost_its_data_makes_the_job_an_error_never_completed(model, tmp_path):
    """No persistence: a restart comes back empty. status and download say the state
    is lost (exit 1); the worker drops the orphaned rows and carries on."""
    server = RedisServer(tmp_path / "volatile", appendonly=False)
    server.start()
    chaos = Chaos(server.url, model, tmp_path, server=server)
    try:
        chaos.submit("gone", prompt_lines(24, "gone", max_tokens=(48, 64)))  # as above
        worker = chaos.worker_cli("sup", "--burst", "--max-num-seqs", "2", step_s=0.02)
        wait_until(lambda: chaos.record("gone").done >= 2, 120, "some committed rows")
        assert chaos.record("gone").done < 20  # mid-job
        server.kill()
        server.start()  # nothing on disk: an empty server
        assert worker.wait(120) == 0, worker.tail()
        assert "Redis lost its state (restarted without persistence?)" in worker.tail()
        for args in (["status", "gone"], ["download", "gone", "-o", str(tmp_path / "x")]):
            out = chaos.cli(*args)
            assert out.returncode == 1 and out.stdout == ""
            assert out.stderr == (
                "batchgen: error: no job 'gone' in this Redis (see `batchgen jobs`; if it "
                "existed, Redis lost its state: was it restarted without persistence?)\n"
            )
        assert chaos.cli("jobs").stdout == "no jobs\n"
        assert not (chaos.output("gone") / "result.parquet").exists()
    finally:
        chaos.stop_all()
        server.kill()


class KillAfterChunks:
    """Wraps the submit's chunk sender: kills redis-server after ``n`` chunks, and
    (``restart_after_s``) brings it back on its data dir from another thread."""

    def __init__(self, server: RedisServer, n: int, restart_after_s: float | None) -> None:
        self.server, self.n, self.restart_after_s = server, n, restart_after_s
        self.sent = 0
        self.thread: threading.Thread | None = None
        self.original = chunk_append._ChunkSender.send

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def send(sender, start: int, chunk: list[bytes]) -> None:
            self.sent += 1
            if self.sent == self.n:
                self.server.kill()
                if self.restart_after_s is not None:
                    self.thread = threading.Timer(self.restart_after_s, self.server.start)
                    self.thread.start()
            self.original(sender, start, chunk)

        monkeypatch.setattr(chunk_append._ChunkSender, "send", send)


@pytest.mark.parametrize("comes_back", [True, False])
def test_submit_across_a_redis_crash_enqueues_every_line_once(
    private_redis, tmp_path, monkeypatch, comes_back
):
    """The server is killed mid-file. Back within BATCHGEN_REDIS_WAIT: the submit
    goes on where the job's counter says. Not back: one line that says how to
    resume, whole chunks only, and the re-run enqueues exactly the rest."""
    monkeypatch.setattr(chunk_append, "CHUNK_ENTRIES", 100)
    monkeypatch.setenv("BATCHGEN_REDIS_WAIT", "10" if comes_back else "0.5")
    kill = KillAfterChunks(private_redis, 5, 0.5 if comes_back else None)
    kill.install(monkeypatch)
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"line {i}"} for i in range(2000)])
    args = ["submit", str(src), "--model", "m", "--job-id", "big", "--output",
            str(tmp_path / "out"), "--redis", private_redis.url]  # fmt: skip
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    if kill.thread is not None:
        kill.thread.join()
    chaos = Chaos(private_redis.url, Path("m"), tmp_path)
    if not comes_back:
        assert result.exit_code == 1
        assert result.output.count("\n") == 1 and result.output.startswith(
            "batchgen: error: cannot reach Redis at the configured server"
        )
        assert result.output.endswith(
            "job 'big' is partly enqueued (whole chunks only): re-run the same submit with "
            "--job-id big to enqueue the rest\n"
        )
        private_redis.start()
        enqueued = chaos.record("big").enqueued
        assert enqueued % 100 == 0 and 0 < enqueued < 2000
        assert stream_indices(chaos, "big") == list(range(enqueued))  # nothing half-added
        monkeypatch.setattr(chunk_append._ChunkSender, "send", kill.original)
        result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert (result.exit_code, result.stdout) == (0, "big\n")  # stderr: no worker serves m
    assert stream_indices(chaos, "big") == list(range(2000))  # every line once
    record = chaos.record("big")
    assert (record.enqueued, record.total) == (2000, 2000)


def test_entries_trimmed_while_held_become_lost_rows_and_the_counts_add_up(chaos, reference):
    """XTRIM deletes the entries a worker held when it died (pending at its consumer)
    and two never delivered (handed back unstarted): a live worker reports them lost, the
    job finalizes with "lost" error rows for exactly those, done + failed = total,
    nothing left pending."""
    lines = prompt_lines(16, "trim", max_tokens=(4, 12))
    out = chaos.submit("trim", lines)
    dies = chaos.loop_worker(  # reads 4, dies when the first row is due to be written
        "dies", crash_at="before_part_write", max_num_seqs=2, flush_interval_s=0.0
    )
    assert dies.wait(120) == CRASH_EXIT_CODE, dies.tail()
    conn = chaos.conn
    ids = [e for e, _ in conn.xrange(chaos.qk.stream)]
    held = [p["message_id"] for p in conn.xpending_range(chaos.qk.stream, GROUP, "-", "+", 100)]
    assert held == ids and len(held) == 4  # the stream holds what workers took
    ghost = read_new(conn, chaos.qk, "ghost", 2)  # the next two, back in the stream unread
    assert hand_back(conn, chaos.qk, "ghost", [HandBack(d, [], ran=False) for d in ghost]) == 2
    cut = len(held) + 2
    assert conn.xtrim(chaos.qk.stream, maxlen=0, approximate=False) == cut
    survivor = chaos.loop_worker("survivor", burst=True)
    assert survivor.wait(120) == 0, survivor.tail()
    assert f"{len(held)} pending entries were deleted from the stream" in survivor.tail()
    assert chaos.finalize() == 1
    rows = chaos.result("trim")
    assert_exactly_once(rows, lines, reference(lines), errors=dict.fromkeys(range(cut), LOST))
    record = chaos.record("trim")
    assert (record.done, record.failed, record.total) == (16 - cut, cut, 16)
    assert_nothing_left(chaos, "trim", out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["filled_by_finalize"] == cut


def test_an_evicting_server_is_refused_by_worker_and_submit(private_redis, tmp_path):
    conn = private_redis_conn(private_redis)
    conn.config_set("maxmemory-policy", "allkeys-lru")
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}])
    model = tmp_path / "m"  # what the model check before connecting looks for (never loaded)
    model.mkdir()
    for name, data in (("config.json", "{}"), ("tokenizer.json", "{}"), ("model.safetensors", "")):
        (model / name).write_text(data)
    for args in (["worker", "--model", str(model), "--device", "cpu"],
                 ["submit", str(src), "--model", str(model), "--output", str(tmp_path / "out")]):  # fmt: skip
        result = CliRunner().invoke(main, [*args, "--redis", private_redis.url])
        assert result.exit_code == 1
        assert result.output == (
            f"batchgen: error: Redis at {private_redis.url} has maxmemory-policy allkeys-lru, "
            "which can silently evict queued requests; set `maxmemory-policy noeviction` "
            "(CONFIG SET or redis.conf) or use another server\n"
        )
    assert conn.dbsize() == 0  # nothing enqueued, no job created


def test_redis_out_of_memory_on_submit_is_queue_full_with_whole_chunks(
    private_redis, tmp_path, monkeypatch
):
    conn = private_redis_conn(private_redis)
    monkeypatch.setattr(chunk_append, "CHUNK_ENTRIES", 100)
    lines = [{"prompt": f"line {i} " + "x" * 300} for i in range(3000)]  # ~1 MB of entries
    src = write_jsonl(tmp_path / "p.jsonl", lines)
    args = ["submit", str(src), "--model", "m", "--job-id", "full", "--output",
            str(tmp_path / "out"), "--redis", private_redis.url]  # fmt: skip
    conn.config_set("maxmemory", int(conn.info("memory")["used_memory"]) + 400_000)
    result = CliRunner().invoke(main, args)
    chaos = Chaos(private_redis.url, Path("m"), tmp_path)
    enqueued = chaos.record("full").enqueued
    assert result.exit_code == 1 and 0 < enqueued < 3000 and enqueued % 100 == 0
    assert result.output == (
        f"batchgen: error: queue full: Redis is out of memory (maxmemory, noeviction) after "
        f"{enqueued} of 3000 requests were enqueued. Start workers to drain the queue or raise "
        "maxmemory, then re-run the same submit with --job-id full to enqueue the rest\n"
    )
    assert stream_indices(chaos, "full") == list(range(enqueued))  # nothing half-enqueued
    conn.config_set("maxmemory", 0)
    result = CliRunner().invoke(main, args)
    assert (result.exit_code, result.stdout) == (0, "full\n")  # stderr: no worker serves m
    assert stream_indices(chaos, "full") == list(range(3000))


def private_redis_conn(server: RedisServer) -> Any:
    return rconn(server.url)


def _job_outlives_refusals(chaos: Chaos, reference, job_id: str, refuse, allow, said: str) -> None:
    """A supervised worker generates ``job_id``; ``refuse()`` makes Redis answer every
    write (or every command) with an error reply for 3 s, then ``allow()`` ends it: the
    supervisor and its engine survive, log the outage, and the job completes exactly once."""
    lines = prompt_lines(16, job_id, max_tokens=(32, 48))
    out = chaos.submit(job_id, lines)
    worker = chaos.worker_cli("sup", "--claim-timeout", "2", "--max-num-seqs", "2", step_s=0.02)
    wait_until(lambda: chaos.record(job_id).done >= 2, 120, "some committed rows")
    refuse()
    try:
        wait_until(lambda: said in worker.tail(20_000), 30, f"the worker to log {said!r}")
        time.sleep(3)  # upkeep, keeper, heartbeat and supervisor all meet the reply
        assert worker.alive(), worker.tail()
    finally:
        allow()
    wait_until(partial(finished, chaos, job_id), 300, f"{job_id} to finish")
    worker.kill(signal.SIGTERM)
    assert worker.wait(60) == 0, worker.tail()
    assert "Traceback" not in worker.tail(200_000), worker.tail(200_000)
    rows = chaos.result(job_id)
    assert rows["index"] == list(range(16))
    assert_exactly_once(rows, lines, reference(lines))
    assert (chaos.record(job_id).done, chaos.record(job_id).failed) == (16, 0)
    assert_nothing_left(chaos, job_id, out)


def test_redis_out_of_memory_under_a_running_worker_is_an_outage(chaos_private, reference):
    """maxmemory below what Redis holds (noeviction): every write answers OOM. The
    worker waits it out like a lost connection; once maxmemory is raised it finishes."""
    conn = chaos_private.conn
    _job_outlives_refusals(
        chaos_private, reference, "oom",
        lambda: conn.config_set("maxmemory", 1), lambda: conn.config_set("maxmemory", 0),
        "Redis unavailable (OOM command not allowed when used memory > 'maxmemory'.)",
    )  # fmt: skip


def test_redis_busy_with_a_long_script_under_a_running_worker_is_an_outage(
    chaos_private, reference
):
    """Another client's script loops past lua-time-limit: Redis answers BUSY to every
    command until SCRIPT KILL. The worker waits it out and finishes."""
    conn = chaos_private.conn
    conn.config_set("lua-time-limit", 50)
    busy = rconn(chaos_private.redis_url)
    killed: list[str] = []

    def loop() -> None:
        try:
            busy.eval("local i = 0 while true do i = i + 1 end", 0)
        except Exception as exc:
            killed.append(str(exc))

    thread = threading.Thread(target=loop)

    def allow() -> None:
        wait_until(lambda: _script_kill(conn), 10, "SCRIPT KILL to be accepted")
        thread.join(10)

    _job_outlives_refusals(
        chaos_private, reference, "busy", thread.start, allow,
        "Redis unavailable (BUSY Redis is busy running a script.",
    )  # fmt: skip
    assert killed and "Script killed by user" in killed[0], killed


def _script_kill(conn: Any) -> bool:
    try:
        conn.script_kill()
    except Exception:
        return False
    return True
