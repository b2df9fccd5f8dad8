"""The queue loop against a test double of the engine (unit tests; real Redis).

End-to-end tests with the real engine and subprocess workers are in
test_pipeline_e2e.py.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import redis

from batchgen.jobs.ops.cancellation import cancel
from batchgen.jobs.ops.fair_share import backlog
from batchgen.jobs.ops.finalize import finalize_tasks as tasks
from batchgen.jobs.ops.finalize.result import LOST
from batchgen.jobs.ops.job_record import load_job
from batchgen.jobs.ops.lifecycle import JobState
from batchgen.jobs.ops.submission import submit
from batchgen.jobs.redis.keys import GROUP, Keys
from batchgen.jobs.redis.stream import ensure_group
from batchgen.jobs.schema.rows import FinishReason, Row
from batchgen.jobs.schema.sampling import DEFAULTS
from batchgen.worker.consumer.queue import read_new, refresh
from batchgen.worker.consumer.sink import PartSink
from batchgen.worker.loop import EngineAPI, LoopConfig, QueueLoop
from batchgen.worker.loop.loop_config import ENGINE_FAILED_EXIT
from tests.engine_double import FakeEngine, RequestRejected, SamplingParams, expected_tokens

KEYS = Keys("bg")
QK = KEYS.queue_for_model("m")


def rconn(url: str, **kwargs: Any) -> Any:
    """A client typed loosely: redis-py's reply unions make tests unreadable."""
    return redis.Redis.from_url(url, **kwargs)


def make_job(conn, tmp_path: Path, prompts: list, job_id="j", **defaults) -> Path:
    src = tmp_path / f"{job_id}.jsonl"
    src.write_text(
        "".join(json.dumps(p if isinstance(p, dict) else {"prompt": p}) + "\n" for p in prompts)
    )
    out = tmp_path / f"out-{job_id}"
    submit(conn, KEYS, source_path=str(src), model="m", output=str(out),
           defaults={**DEFAULTS, **defaults}, job_id=job_id)  # fmt: skip
    return out


def make_loop(conn, engine=None, **config) -> QueueLoop:
    config = {"block_ms": 50, "flush_interval_s": 0.05, "heartbeat_s": 0.2, "sweep_interval_s": 0.2,
              "cancel_poll_s": 0.05, "name": "w1", **config}  # fmt: skip
    api = EngineAPI(engine or FakeEngine(), SamplingParams, (RequestRejected,))
    return QueueLoop(conn, api, LoopConfig(model="m", **config))


def finish(conn, loop: QueueLoop, job_id="j", timeout=10.0) -> None:
    deadline = time.monotonic() + timeout

    def done() -> bool:
        assert time.monotonic() < deadline, "loop did not finish the job in time"
        return load_job(conn, KEYS, job_id).state not in (JobState.QUEUED, JobState.RUNNING)

    loop.run(until=done)
    tasks.run_pending(conn, KEYS, QK.tag)


def rows(out: Path) -> dict:
    return pq.read_table(out / "result.parquet").to_pydict()


def tokens(prompt: str) -> list[int]:
    return [ord(c) % 256 for c in prompt]


@pytest.fixture(autouse=True)
def _restore_signals():
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def test_reads_only_what_the_engine_can_admit_and_keeps_it_full(redis_url, tmp_path):
    conn = rconn(redis_url)
    prompts = [f"prompt {i}" for i in range(10)]
    out = make_job(conn, tmp_path, prompts, max_tokens=3)
    engine = FakeEngine(max_num_seqs=4)
    loop = make_loop(conn, engine)
    loop.tick()
    assert engine.added == [e.decode() for e, _ in conn.xrange(QK.stream)][:4]
    assert conn.xpending(QK.stream, GROUP)["pending"] == 4
    loop.tick()  # one step finished nothing (3 tokens each); still 4 in flight, none read
    assert len(engine.added) == 4 and len(loop.requests.flights) == 4
    finish(conn, loop)
    result = rows(out)
    assert result["index"] == list(range(10))
    assert result["token_ids"] == [expected_tokens(tokens(p), 3) for p in prompts]
    assert result["finish_reason"] == ["length"] * 10
    assert set(result["worker"]) == {"w1"} and set(result["attempts"]) == {1}
    assert load_job(conn, KEYS, "j").state == JobState.COMPLETED
    assert conn.xlen(QK.stream) == 0 and conn.xpending(QK.stream, GROUP)["pending"] == 0


def test_requests_that_cannot_run_become_error_rows(redis_url, tmp_path):
    conn = rconn(redis_url)
    prompts = ["ok", "x" * 80, "bell \x07", {"prompt": "y" * 40, "max_tokens": 30}, "fine"]
    out = make_job(conn, tmp_path, prompts, max_tokens=2)
    conn.xadd(QK.stream, {"j": "j2", "i": 0, "r": "{}", "q": 1})  # an entry whose job is unknown
    finish(conn, make_loop(conn))
    result = rows(out)
    assert result["finish_reason"] == ["length", "error", "error", "error", "length"]
    assert result["error"] == [
        None,
        "prompt is 80 tokens; the model's context is 64 tokens",
        "cannot tokenize the prompt: bell characters are not in the vocabulary",
        "request rejected: prompt (40) + max_tokens (30) > 64",
        None,
    ]
    assert result["prompt_tokens"] == [2, 80, 0, 40, 4]
    record = load_job(conn, KEYS, "j")
    assert (record.state, record.done, record.failed) == (JobState.COMPLETED, 2, 3)
    assert conn.xlen(QK.stream) == 0  # the unknown job's entry was dropped, not stuck


def test_sigterm_hands_requests_back_with_their_tokens_and_the_next_worker_resumes(
    redis_url, tmp_path
):
    conn = rconn(redis_url)
    out = make_job(conn, tmp_path, ["alpha", "beta"], max_tokens=12)

    def sigterm_at_step_3(step: int) -> None:
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    first = make_loop(conn, FakeEngine(on_step=sigterm_at_step_3), name="w1")
    queued_ms = backlog.queued(conn, QK, "j")[0][1]
    first.run()  # the signal stops it after 3 tokens each: drain, hand back, exit
    assert first.counters["handed_back"] == 2
    entries = conn.xrange(QK.stream)
    assert all(b"x" in f for _, f in entries)  # the originals are acked and deleted
    assert conn.xpending(QK.stream, GROUP)["pending"] == 0
    for (_, fields), prompt in zip(entries, ["alpha", "beta"]):
        extra = json.loads(fields[b"x"])
        assert extra["resume"] == expected_tokens(tokens(prompt), 3)
        assert (extra["a"], extra["f"]) == (1, 0)  # a graceful hand-back is not a failure
    assert load_job(conn, KEYS, "j").last_id == entries[-1][0].decode()
    second = FakeEngine()
    finish(conn, make_loop(conn, second, name="w2"))
    result = rows(out)
    assert result["token_ids"] == [expected_tokens(tokens(p), 12) for p in ("alpha", "beta")]
    assert result["worker"] == ["w2", "w2"] and result["attempts"] == [2, 2]
    assert result["queued_at"][0].timestamp() == pytest.approx(queued_ms / 1000)


def test_entries_of_a_dead_worker_are_reclaimed(redis_url, tmp_path):
    conn = rconn(redis_url)
    out = make_job(conn, tmp_path, [f"p{i}" for i in range(5)], max_tokens=2)
    read_new(conn, QK, "ghost", 3)  # then it dies
    loop = make_loop(conn, claim_timeout_s=0.3)
    start = time.monotonic()
    finish(conn, loop)
    assert time.monotonic() - start >= 0.3
    assert loop.counters["reclaimed"] == 3
    assert rows(out)["attempts"] == [2, 2, 2, 1, 1]


def test_entries_delivered_too_often_are_dead_lettered(redis_url, tmp_path):
    conn = rconn(redis_url)
    out = make_job(conn, tmp_path, ["poison", "fine"], max_tokens=2)
    (entry_id,) = [d.entry_id for d in read_new(conn, QK, "dead1", 1)]
    conn.xclaim(QK.stream, GROUP, "dead2", 0, [entry_id])  # delivered twice, died twice
    conn.xclaim(QK.stream, GROUP, "dead3", 0, [entry_id])  # and a third time
    loop = make_loop(conn, claim_timeout_s=0.1, max_attempts=3)
    finish(conn, loop)
    assert loop.counters["dead_lettered"] == 1
    ((_, dead),) = conn.xrange(QK.job("j").dead)
    reason = "delivered 4 times (max_attempts 3); the worker running it stopped every time"
    assert (dead[b"j"], dead[b"i"], dead[b"reason"], dead[b"deliveries"]) == (
        b"j", b"0", reason.encode(), b"4")  # fmt: skip
    result = rows(out)
    assert result["finish_reason"] == ["error", "length"]
    assert result["error"] == [f"dead-lettered: {reason}", None]
    assert result["attempts"] == [4, 1]


def test_a_step_that_keeps_failing_is_bisected_down_to_one_request_charged_alone(
    redis_url, tmp_path
):
    """A broken engine (every step from the third on raises): the batch runs
    again in halves; the first half, one request, fails alone and is the one
    charged; the other goes back as a graceful hand-back. Both keep the tokens
    of the step that worked."""
    conn = rconn(redis_url)
    out = make_job(conn, tmp_path, ["a", "b"], max_tokens=5)
    engine = FakeEngine()
    engine.on_step = lambda step: setattr(engine, "fail_step", step >= 2)
    loop = make_loop(conn, engine)
    assert loop.run() == ENGINE_FAILED_EXIT  # the supervisor restarts it with a fresh engine
    assert loop.counters["bisections"] == 1
    extras = [(f[b"i"], json.loads(f[b"x"])) for _, f in conn.xrange(QK.stream) if b"x" in f]
    # (index, runs, failures, tokens kept): two steps ran (2 tokens each) before the third raised
    assert [(i, x["a"], x["f"], x["resume"]) for i, x in extras] == [
        (b"0", 1, 1, expected_tokens(tokens("a"), 2)),
        (b"1", 1, 0, expected_tokens(tokens("b"), 2)),
    ]
    assert extras[0][1]["err"] == "RuntimeError: engine step failed"
    finish(conn, make_loop(conn, name="w2"))
    result = rows(out)
    assert result["token_ids"] == [expected_tokens(tokens(p), 5) for p in ("a", "b")]
    assert result["attempts"] == [2, 2]


def test_a_request_that_breaks_the_step_is_found_by_bisection_and_dead_lettered(
    redis_url, tmp_path
):
    """Its batch-mates finish in the worker that first ran them, uncharged, with
    exactly the tokens they would have had; only the culprit keeps coming back."""
    conn = rconn(redis_url)
    prompts = ["a", "b", "POISON", "c"]
    out = make_job(conn, tmp_path, prompts, max_tokens=3)
    lifetimes = 0
    while load_job(conn, KEYS, "j").state in (JobState.QUEUED, JobState.RUNNING):
        lifetimes += 1
        assert lifetimes <= 5, "the poison request was not isolated"
        loop = make_loop(conn, FakeEngine(raise_on="POISON"), name=f"w{lifetimes}", burst=True)
        loop.run()
        if lifetimes == 1:
            # 4 -> [a, b] (finish) and [POISON, c] -> [POISON] (fails alone), [c] (goes back)
            assert loop.counters["bisections"] == 2
            assert loop.counters["rows_ok"] == 2
    tasks.run_pending(conn, KEYS, QK.tag)
    result = rows(out)
    assert result["finish_reason"] == ["length", "length", "error", "length"]
    for i in (0, 1, 3):
        assert result["token_ids"][i] == expected_tokens(tokens(prompts[i]), 3)
    # a and b finished where they first ran; c, read again beside the culprit, went
    # back (uncharged) with each of the first two workers that the culprit stopped
    assert [result["attempts"][i] for i in (0, 1, 3)] == [1, 1, 3]
    assert result["error"][2] == (
        "dead-lettered: delivered 4 times (max_attempts 3); the worker running it stopped every "
        "time; last error: RuntimeError: CUDA error: an illegal memory access (the double)"
    )


def test_one_suspect_at_a_time_the_others_go_back_uncharged(redis_url, tmp_path):
    """Suspects on their last chance wait for their solo run outside the worker: had
    it held them all, its death (kill -9 while the first ran alone) would have
    charged every one a failure and dead-lettered them with the poison."""
    conn = rconn(redis_url)
    out = make_job(conn, tmp_path, ["a", "b", "c"], max_tokens=2)
    ids = [d.entry_id for d in read_new(conn, QK, "dead1", 3)]
    conn.xclaim(QK.stream, GROUP, "dead2", 0, ids)  # two workers died running all three
    loop = make_loop(conn, claim_timeout_s=0.1, max_attempts=3)
    time.sleep(0.15)  # idle past the claim timeout (a fixed wait on purpose)
    loop.upkeep.reclaim()  # third delivery: the last chance of each
    assert [[d.index for d in group] for group in loop.requests.isolation.waiting] == [[0]]
    back = [(f[b"i"], json.loads(f[b"x"])) for _, f in conn.xrange(QK.stream) if b"x" in f]
    assert [(i, x["a"], x["f"]) for i, x in back] == [(b"1", 2, 2), (b"2", 2, 2)]
    assert loop.counters["deferred"] == 2
    assert conn.xpending(QK.stream, GROUP)["pending"] == 1  # the worker now dies (kill -9)
    time.sleep(0.15)
    finish(conn, make_loop(conn, name="w2", claim_timeout_s=0.1, max_attempts=3))
    result = rows(out)
    assert result["finish_reason"] == ["error", "length", "length"]  # only the one it held
    assert result["attempts"] == [4, 3, 3]


def test_entries_deleted_while_pending_are_reported_lost(redis_url, tmp_path):
    conn = rconn(redis_url)
    out = make_job(conn, tmp_path, ["a", "b", "c", "d"], max_tokens=2)
    first, second = (d.entry_id for d in read_new(conn, QK, "ghost", 2))
    conn.xdel(QK.stream, first, second)  # deleted while pending at a dead worker
    loop = make_loop(conn, claim_timeout_s=0.1)
    finish(conn, loop)
    assert loop.counters["lost_entries"] == 2
    result = rows(out)
    assert result["finish_reason"] == ["error", "error", "length", "length"]
    assert result["error"][:2] == [LOST, LOST]
    record = load_job(conn, KEYS, "j")
    assert (record.done, record.failed, record.total) == (2, 2, 4)
    assert conn.xpending(QK.stream, GROUP)["pending"] == 0


class SlowEngine(FakeEngine):
    """A step that takes longer than the claim timeout (a Triton JIT, a huge batch)."""

    step_s = 0.0

    def step(self):
        time.sleep(self.step_s)
        return super().step()


def test_claims_stay_fresh_through_a_step_longer_than_the_claim_timeout(redis_url, tmp_path):
    """Refreshed between steps, a worker in a 1.5 s step looked dead after 0.4 s and
    other workers took its live work; the keeper thread refreshes meanwhile."""
    conn = rconn(redis_url)
    make_job(conn, tmp_path, ["slow one", "slow two"], max_tokens=40)
    engine = SlowEngine()
    loop = make_loop(conn, engine, claim_timeout_s=0.4)
    loop.start_keeper()
    loop.tick()  # admits both (and takes a first, quick step)
    stolen: list = []
    stop = threading.Event()

    def thief() -> None:
        thief_conn = rconn(redis_url)
        while not stop.is_set():
            _, claimed, *_ = thief_conn.xautoclaim(QK.stream, GROUP, "thief", 400, count=10)
            stolen.extend(claimed)
            time.sleep(0.05)

    other = threading.Thread(target=thief)
    other.start()
    engine.step_s = 1.5
    try:
        loop.tick()  # 1.5 s in one step: nothing on the main thread refreshes
    finally:
        stop.set()
        other.join()
    assert stolen == [] and len(engine.running) == 2
    assert "reclaimed" not in loop.counters  # nor did it take its own entries for stale
    engine.step_s = 0.0
    taken = next(iter(loop.requests.flights))
    conn.xclaim(QK.stream, GROUP, "thief", 0, [taken])  # taken over (say we had looked dead)
    deadline = time.monotonic() + 5
    while "stolen" not in loop.counters:  # the keeper's next refresh reports it
        assert time.monotonic() < deadline
        loop.tick()
        time.sleep(0.02)
    assert taken not in loop.requests.flights and taken not in engine.running
    assert loop.counters["stolen"] == 1
    loop.shutdown()


def test_refresh_resets_the_idle_time_of_every_held_entry(redis_url, tmp_path):
    """Not only the first: a Lua unpack() in the middle of XCLAIM's arguments passed
    one id, so the rest of a worker's entries looked idle and were claimed away."""
    conn = rconn(redis_url)
    make_job(conn, tmp_path, [f"p{i}" for i in range(50)])
    held = [d.entry_id for d in read_new(conn, QK, "w1", 50, None)]
    time.sleep(0.3)  # idle 300 ms (a fixed wait on purpose)
    assert refresh(conn, QK, "w1", held) == []
    idle = [p["time_since_delivered"] for p in conn.xpending_range(QK.stream, GROUP, "-", "+", 99)]
    assert len(idle) == 50 and max(idle) < 250
    assert {
        int(p["times_delivered"]) for p in conn.xpending_range(QK.stream, GROUP, "-", "+", 99)
    } == {1}


def test_cancel_aborts_in_flight_requests_and_drops_queued_ones(redis_url, tmp_path):
    conn = rconn(redis_url)
    out = make_job(conn, tmp_path, [f"p{i}" for i in range(6)], max_tokens=50)
    engine = FakeEngine(max_num_seqs=2)
    loop = make_loop(conn, engine, cancel_poll_s=600.0)  # no polling: the message must do
    loop.start_keeper()
    loop.tick()
    assert len(engine.running) == 2
    cancel(conn, KEYS, "j")
    deadline = time.monotonic() + 5
    while not loop.keeper.cancelled:  # published; heard by the keeper within a few ms
        assert time.monotonic() < deadline
        time.sleep(0.01)
    steps = engine.stats().num_steps
    read = loop.tick()  # the next tick aborts them before stepping, and drops what it reads
    assert engine.running == {} and loop.counters["dropped"] == 2 + read
    assert engine.stats().num_steps == steps and list(loop.requests.cancel_seen) == ["j"]
    loop.config.burst = True
    loop.run()
    tasks.run_pending(conn, KEYS, QK.tag)
    # the two it ran are dropped here; the four queued went with the job's backlog
    assert loop.counters["dropped"] == 2 and "rows_ok" not in loop.counters
    assert conn.hget(QK.job("j").job, "backlog") == b"0" and not conn.sismember(QK.ready, "j")
    assert conn.xlen(QK.stream) == 0 and conn.xpending(QK.stream, GROUP)["pending"] == 0
    assert load_job(conn, KEYS, "j").state == JobState.CANCELLED
    assert rows(out)["finish_reason"] == ["cancelled"] * 6


def test_burst_waits_for_entries_held_elsewhere_and_exits_when_the_stream_is_empty(
    redis_url, tmp_path
):
    conn = rconn(redis_url)
    out = make_job(conn, tmp_path, ["a", "b"], max_tokens=2)
    read_new(conn, QK, "ghost", 1)
    loop = make_loop(conn, burst=True, claim_timeout_s=0.5)
    start = time.monotonic()
    assert loop.run() == 0
    assert time.monotonic() - start >= 0.5  # it waited and took the ghost's entry over
    assert conn.xlen(QK.stream) == 0
    tasks.run_pending(conn, KEYS, QK.tag)
    assert rows(out)["finish_reason"] == ["length", "length"]


def test_an_idle_worker_blocks_on_redis_instead_of_polling(redis_url):
    conn = rconn(redis_url)
    loop = make_loop(conn, block_ms=200)
    ensure_group(conn, QK)
    calls = lambda: conn.info("commandstats").get("cmdstat_xreadgroup", {}).get("calls", 0)  # noqa: E731
    before = calls()
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        loop.tick()
    assert calls() - before <= 6  # ~5 blocking reads in 1 s, not thousands


def test_heartbeat_reports_in_flight_requests(redis_url, tmp_path):
    from batchgen.jobs.ops.status_report import job_status

    conn = rconn(redis_url)
    make_job(conn, tmp_path, ["a", "b", "c"], max_tokens=30)
    loop = make_loop(conn, FakeEngine(max_num_seqs=2), heartbeat_s=0.05)
    loop.tick()
    loop.start_keeper()
    deadline = time.monotonic() + 5
    while job_status(conn, KEYS, "j").to_dict()["in_flight"] != 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    status = job_status(conn, KEYS, "j").to_dict()
    assert (status["in_flight"], status["queued"], status["live_workers"]) == (2, 1, 1)
    loop.shutdown()
    assert job_status(conn, KEYS, "j").to_dict()["live_workers"] == 0


def test_the_loop_rides_out_a_redis_restart(private_redis, tmp_path):
    from batchgen.jobs.redis.connection import connect

    conn: Any = connect(private_redis.url, retries=1)
    out = make_job(conn, tmp_path, [f"p{i}" for i in range(20)], max_tokens=3)
    engine = FakeEngine(max_num_seqs=4)
    loop = make_loop(conn, engine, flush_interval_s=0.0)
    loop.tick()
    assert len(engine.running) == 4
    private_redis.kill()  # SIGKILL; its AOF (fsynced before each reply) is on the same dir
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        loop.tick()  # must not raise: rows wait in the sink, reads back off
    assert engine.running == {} and len(loop.sink.written) == 1  # published, not committed
    private_redis.start()
    finish(conn, loop)
    result = rows(out)
    assert result["index"] == list(range(20))
    assert result["token_ids"] == [expected_tokens(tokens(f"p{i}"), 3) for i in range(20)]


def test_a_worker_never_runs_an_entry_it_holds_twice(redis_url, tmp_path):
    """Its own entries looked idle (its keeper starved of CPU past the claim timeout) and
    its reclaim took them: they were admitted again, the same index twice in one part,
    and finalize dropped both rows of it as lost (the soak caught it under load)."""
    conn = rconn(redis_url)
    out = make_job(conn, tmp_path, ["a", "b", "c"], max_tokens=2)
    engine = FakeEngine()
    loop = make_loop(conn, engine, claim_timeout_s=0.2)
    (out / "parts").write_text("storage down: the rows stay in the sink")
    while loop.sink.buffered < 3:  # read, run, finish: three rows held, unwritable
        loop.tick()
    assert len(engine.added) == 3
    pending = conn.xpending_range(QK.stream, GROUP, "-", "+", 10)
    ids = [p["message_id"] for p in pending]
    conn.execute_command("XCLAIM", QK.stream, GROUP, "w1", 0, *ids, "IDLE", 60_000)
    loop.upkeep.reclaim()  # claims them back: they are its own
    assert loop.counters["reclaimed"] == 3 and len(engine.added) == 3  # none admitted again
    (out / "parts").unlink()
    finish(conn, loop)
    assert rows(out)["index"] == [0, 1, 2] and rows(out)["error"] == [None] * 3


def test_a_part_holds_one_row_per_index(redis_url, tmp_path):
    """A second row for an index already in the buffer is dropped, its entry acked with
    the part: a commit records the indices a part lost, so two rows of one index in one
    part would both be excluded at finalize."""
    conn = rconn(redis_url)
    out = make_job(conn, tmp_path, ["a", "b"], max_tokens=2)
    first, second = read_new(conn, QK, "w", 2, None)
    sink = PartSink(QK, "w")
    sink.add(first, str(out), Row(index=0, text="first", finish_reason=FinishReason.STOP))
    handed = replace(first, entry_id=second.entry_id)  # another entry of input 0
    sink.add(handed, str(out), Row(index=0, text="again", finish_reason=FinishReason.STOP))
    flushed = sink.flush(conn)
    assert flushed.commit is not None and flushed.commit.lost == 0
    assert conn.xlen(QK.stream) == 0 and conn.xpending(QK.stream, GROUP)["pending"] == 0
    (part,) = (out / "parts" / "j").iterdir()
    assert pq.read_table(part).column("text").to_pylist() == ["first"]
    assert load_job(conn, KEYS, "j").done == 1


def test_an_unreadable_entry_becomes_its_error_row_and_the_worker_goes_on(redis_url, tmp_path):
    """Planted or corrupt entries (a request that is not JSON, a format this release does
    not know, JSON nested past Python's recursion limit, no job at all), read new and
    taken over from a dead worker: each becomes its job's error row with the reason, or is
    dropped, and the worker finishes the job instead of dying on it after every restart."""
    conn = rconn(redis_url)
    out = make_job(conn, tmp_path, [f"p{i}" for i in range(5)], max_tokens=2)
    read_new(conn, QK, "ghost", 5)  # dispatched from the backlog: all five in the stream
    entries = conn.xrange(QK.stream)
    good = dict(entries[0][1])
    planted = {1: {b"r": b"not json"}, 2: {b"v": b"2"}, 3: {b"r": b"[" * 100_000}}
    for index, change in planted.items():
        conn.xack(QK.stream, GROUP, entries[index][0])
        conn.xdel(QK.stream, entries[index][0])
        conn.xadd(QK.stream, {**good, b"i": str(index).encode(), **change})
    conn.xadd(QK.stream, {"nothing": "here"})  # no job, no index: dropped
    conn.xadd(QK.stream, {"j": "no-such-job", "i": 0, "r": "{"})  # a job this Redis lacks
    # the ghost holds 0 and 4, then takes planted 1, and dies
    conn.xreadgroup(GROUP, "ghost", {QK.stream: ">"}, count=1)
    loop = make_loop(conn, claim_timeout_s=0.2)
    finish(conn, loop)
    result = rows(out)
    assert result["index"] == [0, 1, 2, 3, 4]
    assert result["finish_reason"] == ["length", "error", "error", "error", "length"]
    eids = [e.decode() for e, _ in conn.xrange(QK.job("j").dead)]
    reasons = {int(f[b"i"]): f[b"reason"].decode() for _, f in conn.xrange(QK.job("j").dead)}
    assert len(eids) == 3 and sorted(reasons) == [1, 2, 3]
    assert "cannot be read: Expecting value" in reasons[1]
    assert "it has format 2; this release reads format 1 (upgrade it)" in reasons[2]
    assert "cannot be read: maximum recursion depth exceeded" in reasons[3]
    assert result["error"][1:4] == [f"dead-lettered: {reasons[i]}" for i in (1, 2, 3)]
    # every delivery counts: 0, 4 and planted 1 were the ghost's first, then taken over
    assert result["attempts"] == [2, 2, 1, 1, 2]
    deliveries = {int(f[b"i"]): int(f[b"deliveries"]) for _, f in conn.xrange(QK.job("j").dead)}
    assert deliveries == {1: 2, 2: 1, 3: 1}
    record = load_job(conn, KEYS, "j")
    assert (record.state, record.done, record.failed) == (JobState.COMPLETED, 2, 3)
    assert conn.xlen(QK.stream) == 0 and conn.xpending(QK.stream, GROUP)["pending"] == 0
    assert loop.counters["reclaimed"] == 2  # 0 and 4; 1 was set aside as it was taken over
