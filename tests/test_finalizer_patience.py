"""A job's finalize never waits for another finalizer of the same worker: one that hangs
(here frozen right after it marked its job finished, as rq's listener thread once held
each run for 60 s at its end) gets a second finalizer beside it once it has had
``PATIENCE_S``, and the next job is finalized."""

from __future__ import annotations

import functools
import time
from pathlib import Path

from tests.cli_session import Shell, wait_for, write_jsonl


def reads(shell: Shell, job: str, field: str, value: object) -> bool:
    return shell.status(job)[field] == value


def test_a_stuck_finalizer_does_not_hold_the_next_jobs_finalize(
    tmp_path: Path, toy_model, private_redis
):
    (tmp_path / "tiny").symlink_to(toy_model("llama"))
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q {i}", "max_tokens": 2} for i in range(3)])
    shell = Shell(tmp_path, tmp_path / "home", private_redis.url)
    frozen = tmp_path / "frozen"  # made by the one process the crash point freezes
    try:
        shell.start("worker", "--model", "tiny", "--device", "cpu", extra_env={
            "BATCHGEN_TEST_CRASH_AT": "after_finalize_commit:1:stop",
            "BATCHGEN_TEST_CRASH_ONCE": str(frozen)})  # fmt: skip
        for job in ("first", "next"):
            shell.ok("submit", "p.jsonl", "--model", "tiny", "--job-id", job,
                     "--output", str(tmp_path / job))  # fmt: skip
            wait_for(functools.partial(reads, shell, job, "done", 3), f"{job}'s rows", timeout=300)
            done = time.monotonic()
            wait_for(functools.partial(reads, shell, job, "state", "completed"), f"{job}'s finalize",
                     timeout=120)  # fmt: skip
            waited = time.monotonic() - done
            # the first job's finalizer froze after marking it completed, and stays frozen
            assert frozen.exists()
        # the next job's finalize waited only for the frozen finalizer's patience to end
        assert waited < 60, waited
    finally:
        shell.stop_all()


def test_the_docs_state_the_patience_and_the_limit():
    from batchgen.worker.supervisor.finalizer import MAX_FINALIZERS, PATIENCE_S
    from tests.doc_blocks import REPO

    said = " ".join((REPO / "docs" / "reliability.md").read_text().split())
    assert (f"another (up to {MAX_FINALIZERS}) when tasks still wait {PATIENCE_S:g} s after "
            "the newest started") in said  # fmt: skip
