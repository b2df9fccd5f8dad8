"""``batchgen worker --device cpu --tensor-parallel-size 2`` through the whole pipeline, and
a rank killed with kill -9 mid-job: its group goes down, the supervisor starts a fresh
one, and the output still holds exactly one row per line, equal to a one-rank fault-free
run."""

from __future__ import annotations

import signal

import psutil

from tests.chaos.harness import (
    assert_exactly_once,
    assert_nothing_left,
    prompt_lines,
    wait_until,
)


def _ranks(supervisor_pid: int) -> list[psutil.Process]:
    """The tensor-parallel ranks (the engine processes' own children) under a supervisor."""
    ranks = []
    try:
        for engine in psutil.Process(supervisor_pid).children():
            ranks += [p for p in engine.children() if "tensor_rank" in " ".join(p.cmdline())]
    except psutil.NoSuchProcess:  # one exited while we looked
        return []
    return ranks


def test_two_cpu_ranks_serve_a_job_from_submit_to_parquet(chaos, reference):
    lines = prompt_lines(12, "tp", max_tokens=(4, 12))
    out = chaos.submit("tp", lines)
    worker = chaos.worker_cli("sup", "--burst", "--tensor-parallel-size", "2")
    wait_until(lambda: bool(_ranks(worker.pid)), 120, "the engine's second rank")
    assert worker.wait(300) == 0, worker.tail()
    assert chaos.finalized("tp") == "completed"
    assert_exactly_once(chaos.result("tp"), lines, reference(lines))
    assert_nothing_left(chaos, "tp", out)


def test_a_rank_killed_mid_job_takes_its_group_down_and_loses_nothing(chaos, reference):
    lines = prompt_lines(16, "tpkill", max_tokens=(24, 48))
    out = chaos.submit("tpkill", lines)
    # paced steps (>= 30 ms): still decoding when the rank is killed
    worker = chaos.worker_cli("sup", "--burst", "--tensor-parallel-size", "2",
                              "--claim-timeout", "1", "--max-attempts", "20",
                              step_s=0.03)  # fmt: skip
    wait_until(lambda: bool(_ranks(worker.pid)) and chaos.pending() > 0, 120, "a decoding group")
    (rank,) = _ranks(worker.pid)
    rank.send_signal(signal.SIGKILL)
    assert worker.wait(300) == 0, worker.tail()
    assert chaos.finalized("tpkill") == "completed"
    assert_exactly_once(chaos.result("tpkill"), lines, reference(lines))
    assert_nothing_left(chaos, "tpkill", out)
    log = worker.tail(200_000)
    assert "tensor-parallel group lost: rank 1 exited with -9" in log
    assert "exited with 70" in log  # the engine handed back and asked for a fresh group
