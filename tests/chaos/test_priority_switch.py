"""Workers killed while they switch between jobs of different priority classes.

A low-class job runs on two workers; a high-class job arrives and the workers take
its requests as their slots free up, with low-class requests still in flight (the
engine's admission decides what comes in next; nothing in flight is thrown away).
kill -9 lands on a worker holding requests of both jobs, and on another as it goes
back to the low class; reclaimed requests run elsewhere. Both outputs hold exactly
one row per line, equal to a fault-free run, and the high class was dispatched
while low-class requests still waited.
"""

from __future__ import annotations

import signal
from functools import partial

from batchgen.jobs.ops.fair_share.schedule import Schedule
from batchgen.jobs.ops.submission import submit
from batchgen.jobs.schema.sampling import DEFAULTS
from tests.chaos.harness import (
    KEYS,
    Chaos,
    assert_exactly_once,
    assert_nothing_left,
    prompt_lines,
    wait_until,
    write_jsonl,
)

SETTINGS = {"max_num_seqs": 3, "max_attempts": 20}


def holds(chaos: Chaos, name: str, *job_ids: str) -> bool:
    """``name``'s heartbeat says it runs requests of every one of ``job_ids``."""
    beat = chaos.heartbeat(name) or {}
    return all(beat.get("in_flight", {}).get(job_id) for job_id in job_ids)


def test_kill_9_while_workers_switch_between_classes_leaves_one_row_per_line(chaos, reference):
    low_lines = prompt_lines(160, "low", max_tokens=(24, 40))
    high_lines = prompt_lines(12, "high", max_tokens=(6, 12))
    low_out = chaos.submit("low", low_lines)
    first = chaos.loop_worker("first", **SETTINGS)
    second = chaos.loop_worker("second", **SETTINGS)
    wait_until(lambda: chaos.record("low").done >= 2, 120, "the low class to be under way")
    src = write_jsonl(chaos.tmp / "high.jsonl", high_lines)  # in this process: at once
    submit(chaos.conn, KEYS, source_path=str(src), model=str(chaos.model), job_id="high",
           output=str(chaos.output("high")), defaults=dict(DEFAULTS),
           schedule=Schedule(priority=5))  # fmt: skip
    high_out = chaos.output("high")
    assert chaos.record("low").state.value == "running"

    # the switch: a worker holding requests of both classes dies mid-decode
    victim = wait_until(
        lambda: next((w for w in (first, second) if holds(chaos, w.name, "low", "high")), None),
        120, "a worker to hold requests of both classes",
    )  # fmt: skip
    victim.kill(signal.SIGKILL)
    assert victim.wait(10) == -signal.SIGKILL
    survivor = second if victim is first else first
    chaos.loop_worker("third", **SETTINGS)

    # and the way back: once the high class is all dispatched, one goes back to low and dies
    wait_until(lambda: chaos.record("high").backlog == 0, 120, "the high class dispatched")
    low_waiting = chaos.record("low").backlog  # what the high class went ahead of
    wait_until(partial(holds, chaos, survivor.name, "low"), 120, f"{survivor.name} back on low")
    survivor.kill(signal.SIGKILL)
    assert survivor.wait(10) == -signal.SIGKILL
    chaos.loop_worker("fourth", **SETTINGS)

    assert chaos.finalized("high", timeout=240) == "completed"
    assert chaos.finalized("low", timeout=240) == "completed"
    # the high class went first: all of it was dispatched while low-class requests still
    # waited (which one finishes first depends on where the kills landed: a killed
    # worker's requests wait out the claim timeout)
    assert low_waiting > 0
    assert_exactly_once(chaos.result("high"), high_lines, reference(high_lines))
    assert_exactly_once(chaos.result("low"), low_lines, reference(low_lines))
    assert_nothing_left(chaos, "high", high_out)
    assert_nothing_left(chaos, "low", low_out)
