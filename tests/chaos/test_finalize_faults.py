"""Finalize dies or hangs for real: it is taken over once its lease expires, and a
finalize that takes forever never stops the supervisor from doing its job."""

from __future__ import annotations

import os
import signal

from benchmarks.soak_chaos import children
from tests.chaos.harness import (
    Chaos,
    assert_exactly_once,
    assert_nothing_left,
    process_state,
    prompt_lines,
    wait_until,
)

FROZEN_FINALIZE = "before_finalize_commit:1:stop"  # result written, the job not yet marked


def state(chaos: Chaos, job_id: str) -> str:
    return chaos.record(job_id).state.value


def test_a_finalize_killed_mid_run_is_taken_over_once_its_lease_expires(chaos, reference):
    lines = prompt_lines(6, "fin")
    out = chaos.submit("fin", lines)
    chaos.loop_worker("w")  # makes the rows, queues the finalize, sweeps every 0.5 s
    wait_until(lambda: state(chaos, "fin") == "finalizing", 120, "every row to be committed")

    env = chaos.env(BATCHGEN_TEST_CRASH_AT=FROZEN_FINALIZE, BATCHGEN_FINALIZE_LEASE_S="1")
    first = chaos.finalizer("finalizer-1", env)
    wait_until(lambda: process_state(first.pid) == "T", 60, "the finalizer to stop mid-run")
    assert (out / "result.parquet").exists() and state(chaos, "fin") == "finalizing"
    first.kill(signal.SIGKILL)  # rq still calls its task "started"; its lease expires in 1 s
    first.wait(10)

    supervisor = chaos.worker_cli("sup", "--workers", "1",
                                  env=chaos.env(BATCHGEN_FINALIZE_LEASE_S="1"))  # fmt: skip
    wait_until(lambda: state(chaos, "fin") == "completed", 120, "a second finalize")
    assert supervisor.alive()
    assert_exactly_once(chaos.result("fin"), lines, reference(lines))
    assert_nothing_left(chaos, "fin", out)
    assert chaos.record("fin").finalize_attempts == 0  # a death is not a failure


def test_a_finalize_that_hangs_does_not_stop_the_supervisor(chaos):
    lines = prompt_lines(4, "hang")
    chaos.submit("hang", lines)
    env = chaos.env(BATCHGEN_TEST_CRASH_AT=FROZEN_FINALIZE)
    supervisor = chaos.worker_cli("sup", "--workers", "1", env=env)

    def finalizer_frozen() -> int | None:
        for pid, cmd in children(supervisor.pid).items():
            if "worker.supervisor.finalizer" in cmd and process_state(pid) == "T":
                return pid
        return None

    frozen = wait_until(finalizer_frozen, 180, "the finalize to hang")
    assert state(chaos, "hang") == "finalizing"

    def engine_children() -> set[int]:
        kids = children(supervisor.pid).items()
        return {pid for pid, cmd in kids if "worker.loop" in cmd and "finalizer" not in cmd}

    (engine,) = wait_until(engine_children, 30, "the engine process")
    os.kill(engine, signal.SIGKILL)
    restarted = wait_until(lambda: engine_children() - {engine}, 30, "a restarted engine process")
    assert len(restarted) == 1  # the supervisor restarts children while the finalize hangs

    supervisor.kill(signal.SIGTERM)
    assert supervisor.wait(60) == 0, supervisor.tail()
    assert process_state(frozen) == "" and state(chaos, "hang") == "finalizing"
