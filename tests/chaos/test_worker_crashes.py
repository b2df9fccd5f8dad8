"""Workers die for real (kill -9, crash points in the production commit path, SIGSTOP,
a poison request that kills or breaks the engine step): the final output still holds
exactly one row per input line, equal to a fault-free run.

The workers are ``python -m batchgen.worker.loop`` (the engine process a supervisor
starts; the test plays supervisor and picks each one's fate) with a 1 s claim timeout,
or ``batchgen worker`` itself where its restarts are part of the story (poison).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
from functools import partial

import pyarrow.parquet as pq

from batchgen.jobs.crashpoints import CRASH_EXIT_CODE
from batchgen.jobs.redis.keys import text
from tests.chaos.harness import (
    Chaos,
    assert_exactly_once,
    assert_nothing_left,
    iter_parts,
    process_state,
    prompt_lines,
    wait_until,
    write_jsonl,
)
from tests.hooks import hook_env

CRASH_POINTS = ["before_part_write", "mid_part_write", "after_publish", "after_commit"]


def decoding(chaos: Chaos, name: str) -> bool:
    """``name`` holds entries and its engine has generated tokens (it is mid-decode)."""
    beat = chaos.heartbeat(name)
    if not beat or not beat["in_flight"] or not beat["engine"].get("generation_tokens"):
        return False
    return chaos.pending(name) > 0


def is_stopped(pid: int) -> bool:
    return process_state(pid) == "T"


def committed_parts(chaos: Chaos, job_id: str) -> set[str]:
    return {text(k) for k in chaos.conn.hkeys(chaos.qk.job(job_id).parts)}


def test_kill_9_mid_decode_and_at_every_crash_point_leaves_one_row_per_line(chaos, reference):
    lines = prompt_lines(24, "crash", max_tokens=(24, 48))
    out = chaos.submit("crash", lines)
    settings = {"max_num_seqs": 4, "max_attempts": 20}  # dead-lettering is another test

    for k in range(2):  # kill -9 while it decodes, twice
        # paced (a step >= 30 ms, a row >= 0.7 s): still decoding at a heartbeat, however
        # fast the machine (unpaced, one finished every line between two heartbeats)
        worker = chaos.loop_worker(f"killed{k}", step_s=0.03, **settings)
        wait_until(partial(decoding, chaos, worker.name), 120, f"{worker.name} to decode")
        worker.kill(signal.SIGKILL)
        assert worker.wait(10) == -signal.SIGKILL

    for point in CRASH_POINTS:
        name = f"crash-{point}"
        done_before = chaos.record("crash").done
        worker = chaos.loop_worker(name, crash_at=point, **settings)
        assert worker.wait(120) == CRASH_EXIT_CODE, worker.tail()
        assert f"crash point {point} reached" in worker.tail()
        mine = [p.name for p in iter_parts(out, "crash") if name in p.name]
        parts = committed_parts(chaos, "crash")
        if point == "before_part_write":
            assert mine == []
        elif point == "mid_part_write":  # half a temp file, never renamed into place
            assert len(mine) == 1 and mine[0].startswith(".tmp-"), mine
        elif point == "after_publish":  # a whole part Redis was never told about
            assert len(mine) == 1 and mine[0].startswith(name), mine
            assert f"parts/crash/{mine[0]}" not in parts
        else:  # the commit (done-marks, counters, XACK + XDEL) happened in full
            assert len(mine) == 1 and f"parts/crash/{mine[0]}" in parts
            assert chaos.record("crash").done > done_before

    survivor = chaos.loop_worker("survivor", burst=True, **settings)
    assert survivor.wait(300) == 0, survivor.tail()
    assert chaos.finalize() == 1
    rows = chaos.result("crash")
    assert_exactly_once(rows, lines, reference(lines))
    assert_nothing_left(chaos, "crash", out)  # leftover temp and orphan parts removed too
    workers = set(rows["worker"])
    assert "crash-after_commit" in workers  # its committed rows are the ones kept
    assert not workers & {f"crash-{p}" for p in CRASH_POINTS[:3]}  # rows never committed
    assert max(rows["attempts"]) >= 2  # and requests did run more than once
    record = chaos.record("crash")
    assert (record.done, record.failed) == (24, 0)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["rows"] == 24 and manifest["counts"]["filled_by_finalize"] == 0


def test_workers_frozen_past_the_claim_timeout_commit_late_and_duplicate_nothing(chaos, reference):
    """Two workers SIGSTOP themselves right after publishing a part (before telling
    Redis); a third takes their entries over and finishes the job. SIGCONT of the
    first before finalize: its late commit is recorded as lost to the earlier rows
    and counts nothing. SIGCONT of the second after finalize: discarded."""
    lines = prompt_lines(12, "stall", max_tokens=(4, 12))
    out = chaos.submit("stall", lines)
    stop = {"crash_at": "after_publish:1:stop", "max_num_seqs": 2, "burst": True}
    frozen = [chaos.loop_worker(f"frozen{k}", **stop) for k in range(2)]
    for w in frozen:
        wait_until(partial(is_stopped, w.pid), 120, f"{w.name} to freeze")
    late = {}
    for w in frozen:
        (part,) = [p for p in iter_parts(out, "stall") if p.name.startswith(w.name)]
        late[w.name] = (part.name, sorted(pq.read_table(part).column("index").to_pylist()))
        assert late[w.name][1]
    # Neither could commit: each froze before telling Redis of its first part. (How many
    # entries each still holds depends on timing: a worker reclaims a frozen one's.)
    assert chaos.record("stall").done == 0

    taker = chaos.loop_worker("taker", burst=True)  # claims the frozen entries after 1 s
    assert taker.wait(300) == 0, taker.tail()
    record = chaos.record("stall")
    assert (record.state.value, record.done, record.failed) == ("finalizing", 12, 0)
    assert all(process_state(w.pid) == "T" for w in frozen)  # still frozen all along

    first, second = frozen
    os.kill(first.pid, signal.SIGCONT)  # before finalize: the job still takes commits
    assert first.wait(60) == 0, first.tail()
    name, indices = late[first.name]
    recorded = json.loads(chaos.conn.hget(chaos.qk.job("stall").parts, f"parts/stall/{name}"))
    assert sorted(recorded["lost"]) == indices  # every row lost to the taker's earlier ones
    record = chaos.record("stall")
    assert (record.done, record.failed) == (12, 0)  # nothing counted twice

    assert chaos.finalize() == 1
    digest = hashlib.sha256((out / "result.parquet").read_bytes()).hexdigest()
    os.kill(second.pid, signal.SIGCONT)  # after finalize: the job is closed
    assert second.wait(60) == 0, second.tail()
    name, _ = late[second.name]
    assert not chaos.conn.hexists(chaos.qk.job("stall").parts, f"parts/stall/{name}")
    assert hashlib.sha256((out / "result.parquet").read_bytes()).hexdigest() == digest

    rows = chaos.result("stall")
    assert_exactly_once(rows, lines, reference(lines))
    for _, indices in late.values():
        assert {rows["worker"][i] for i in indices} == {"taker"}
    assert_nothing_left(chaos, "stall", out)
    assert (chaos.record("stall").done, chaos.record("stall").failed) == (12, 0)


DEAD = "dead-lettered: delivered 4 times (max_attempts 3); the worker running it stopped every time"


def test_a_request_that_kills_its_worker_every_time_is_dead_lettered_alone(chaos, reference):
    """Through ``batchgen worker`` (the supervisor restarts the engine process each time)."""
    lines = prompt_lines(8, "poison", max_tokens=(4, 12))
    lines[2]["prompt"] = "POISONPILL " + lines[2]["prompt"]
    out = chaos.submit("poison", lines)
    env = chaos.env(**hook_env(poison={"POISONPILL": "kill"}))
    worker = chaos.worker_cli("sup", "--burst", "--claim-timeout", "1", "--max-attempts", "3",
                              env=env)  # fmt: skip
    assert worker.wait(300) == 0, worker.tail()
    rows = chaos.result("poison")
    assert_exactly_once(rows, lines, reference(lines), errors={2: DEAD})
    assert rows["attempts"][2] == 4
    dead = chaos.conn.xrange(chaos.qk.job("poison").dead)
    assert [(f[b"i"], f[b"deliveries"], f[b"reason"].decode()) for _, f in dead] == [
        (b"2", b"4", DEAD.removeprefix("dead-lettered: "))
    ]
    record = chaos.record("poison")
    assert (record.done, record.failed) == (7, 1)
    assert_nothing_left(chaos, "poison", out)
    assert worker.tail().count("SIGKILL") == 3  # it ran three times, killed its worker each time


def test_an_exception_or_oom_in_an_engine_step_hands_back_and_isolates_the_culprit(
    chaos, reference
):
    """Two requests break the real engine step from inside (RuntimeError, and
    torch.OutOfMemoryError as a CUDA allocation failure would): each step that
    computes one fails, the loop runs its batch again in halves until a step
    with one request fails, charges that one, hands the rest back uncharged and
    exits; the supervisor starts a fresh engine. The two culprits are
    dead-lettered with the error, their batch-mates finish with exactly the
    fault-free tokens."""
    lines = prompt_lines(8, "boom", max_tokens=(4, 12))
    lines[1]["prompt"] = "ENGINEBOOM " + lines[1]["prompt"]
    lines[5]["prompt"] = "OOMBOOM " + lines[5]["prompt"]
    out = chaos.submit("boom", lines)
    env = chaos.env(**hook_env(poison={"ENGINEBOOM": "raise", "OOMBOOM": "oom"}))
    worker = chaos.worker_cli("sup", "--burst", "--max-attempts", "2", env=env)
    assert worker.wait(300) == 0, worker.tail()  # no hang: the burst worker ends by itself
    dead = "dead-lettered: delivered 3 times (max_attempts 2); the worker running it stopped "
    errors = {
        1: dead + "every time; last error: RuntimeError: chaos: poison request ",
        5: dead + "every time; last error: OutOfMemoryError: CUDA out of memory (chaos: ",
    }
    rows = chaos.result("boom")
    assert_exactly_once(rows, lines, reference(lines), errors=errors)
    assert rows["attempts"][0] == 1  # first half of the first bisection: never went back
    assert rows["attempts"][1] == 3  # charged twice, then dead-lettered on its third delivery
    record = chaos.record("boom")
    assert (record.done, record.failed) == (6, 2)
    assert_nothing_left(chaos, "boom", out)
    log = worker.tail(200_000)
    # one exit per charged failure, only ever a culprit's: 2 culprits x max_attempts 2
    assert log.count("engine step failed; handing the in-flight requests back") == 4
    assert log.count("again in halves to find the culprit") >= 4


def test_batchgen_run_starts_a_fresh_engine_after_a_failure_and_finishes(chaos, reference):
    """``run`` has no supervisor: it restarts its in-process engine itself (it used to
    wait forever for a job nobody served once its engine had raised)."""
    lines = prompt_lines(6, "run", max_tokens=(4, 12))
    lines[3]["prompt"] = "ENGINEBOOM " + lines[3]["prompt"]
    src = write_jsonl(chaos.tmp / "run.jsonl", lines)
    dest = chaos.tmp / "run.parquet"
    env = chaos.env(**hook_env(poison={"ENGINEBOOM": "raise"}))
    out = chaos.cli("run", str(src), "--model", str(chaos.model), "-o", str(dest), "--device",
                    "cpu", "--job-id", "run", "--job-output", str(chaos.output("run")), env=env,
                    timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == f"run: completed, wrote 6 rows to {dest}\n"
    assert out.stderr.count("the engine failed; starting a fresh one") == 3
    rows = pq.read_table(dest).to_pydict()
    error = f"{DEAD}; last error: RuntimeError: chaos: poison request "
    assert_exactly_once(rows, lines, reference(lines), errors={3: error})
