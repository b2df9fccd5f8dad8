"""The finalizer meets each error reply by which Redis says it cannot serve now (OOM,
READONLY, MISCONF, BUSY, LOADING; NOSCRIPT once it can again, refusals.py): it waits,
says so once, and finalizes the job exactly once when Redis takes writes again. One
engine process makes every job's rows (it meets each outage too, and outlives them)."""

from __future__ import annotations

import re
import signal

from batchgen.jobs.ops.finalize.finalize_tasks import finalize_queue
from tests.chaos.harness import (
    KEYS,
    Chaos,
    assert_exactly_once,
    assert_nothing_left,
    prompt_lines,
    wait_until,
)
from tests.chaos.refusals import Refusal

CODES = ("OOM", "READONLY", "MISCONF", "BUSY", "LOADING")


def test_the_finalizer_waits_out_each_refusal_and_finalizes_once(chaos_private, reference):
    chaos = chaos_private
    worker = chaos.loop_worker("w")  # makes the rows and queues each finalize (its sweep)
    for code in CODES:
        _finalize_through(chaos, reference, code)
    worker.kill(signal.SIGTERM)
    assert worker.wait(60) == 0, worker.tail()
    assert "Traceback" not in worker.tail(1_000_000), worker.tail(1_000_000)


def _finalize_through(chaos: Chaos, reference, code: str) -> None:
    assert chaos.server is not None
    job_id = code.lower()
    lines = prompt_lines(4, job_id)
    out = chaos.submit(job_id, lines)
    queue = finalize_queue(chaos.conn, KEYS, chaos.qk.tag)
    wait_until(lambda: queue.count == 1, 120, f"{job_id}'s finalize task")
    assert chaos.record(job_id).state.value == "finalizing"

    refusal = Refusal(code, chaos.server, chaos.tmp)
    refusal.refuse()
    try:
        finalizer = chaos.finalizer(f"finalizer-{job_id}")
        wait_until(
            lambda: "finalizer waits for Redis" in finalizer.tail(), 60, "the finalizer to wait"
        )
        assert finalizer.alive(), finalizer.tail()
    finally:
        refusal.allow()
    assert finalizer.wait(60) == 0, finalizer.tail()
    log = finalizer.tail(100_000)
    assert log.count("finalizer waits for Redis") == 1, log  # once an outage, not once a retry
    said = log.split("finalizer waits for Redis: ", 1)[1].split("\n", 1)[0]
    assert re.search(rf"\b{code}\b", said), said  # which reply, in the log's one line
    assert "finalizer resumes: Redis serves again" in log and "Traceback" not in log, log
    assert_exactly_once(chaos.result(job_id), lines, reference(lines))
    assert_nothing_left(chaos, job_id, out)
    assert chaos.record(job_id).finalize_attempts == 0  # an outage is not a failed finalize
