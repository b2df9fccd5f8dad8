"""Storage fails for real (a path that is not a directory, a full disk, an output that
cannot even be opened): nothing is charged to the requests, nothing is lost, other jobs
flow on, and the failure is said loudly until it is fixed."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.chaos.harness import (
    Chaos,
    assert_exactly_once,
    prompt_lines,
    wait_until,
)


def counters(chaos: Chaos, name: str) -> dict[str, int]:
    beat = chaos.heartbeat(name)
    return beat["counters"] if beat else {}


def status(chaos: Chaos, job_id: str) -> dict:
    result = chaos.cli("status", job_id, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def not_a_directory(out: Path) -> Callable[[], None]:
    (out / "parts").write_text("a file where the parts folder goes")
    return (out / "parts").unlink


@contextlib.contextmanager
def full_disk(out: Path) -> Iterator[None]:
    """``out`` on a 1 MiB tmpfs, filled up: writes fail with ENOSPC until the filler goes."""
    out.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(out)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode != 0:
        out.rmdir()
        pytest.skip(f"a full disk needs `mount -t tmpfs` (root): {mounted.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(out)], check=False)


def fill(out: Path) -> Callable[[], None]:
    filler = out / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        with contextlib.suppress(OSError):  # until ENOSPC
            while True:
                os.write(fd, b"\0" * 4096)
    finally:
        os.close(fd)
    return filler.unlink


@pytest.mark.parametrize("fault", ["not-a-directory", "disk-full"])
def test_unwritable_parts_charge_nothing_lose_nothing_and_are_reported(chaos, reference, fault):
    lines = prompt_lines(12, "disk", max_tokens=(4, 8))
    out = chaos.output("disk")
    with contextlib.ExitStack() as stack:
        if fault == "disk-full":
            stack.enter_context(full_disk(out))
        chaos.submit("disk", lines)
        repair = not_a_directory(out) if fault == "not-a-directory" else fill(out)
        # 2 attempts at most: on a charging worker every redelivery would count one
        chaos.loop_worker("w", max_attempts=2, storage_outage_s=2.0)
        wait_until(lambda: counters(chaos, "w").get("storage_hand_backs", 0) >= 2, 120,
                   "the worker to hand the job's rows back twice, uncharged")  # fmt: skip
        reported = status(chaos, "disk")["storage_error"]
        assert reported.startswith("worker w cannot write parts since ") and "rows kept" in reported
        conn, jk = chaos.conn, chaos.qk.job("disk")
        assert conn.hlen(jk.errors) == 0 and conn.xlen(jk.dead) == 0  # nothing charged
        assert chaos.record("disk").done == 0
        repair()
        wait_until(lambda: chaos.record("disk").state.value == "finalizing", 120, "the rows")
        assert status(chaos, "disk")["storage_error"] is None  # cleared once writes work
        assert chaos.finalized("disk") == "completed"
        rows = chaos.result("disk")
        assert_exactly_once(rows, lines, reference(lines))
        assert set(rows["worker"]) == {"w"}
        if fault == "disk-full":
            shutil.rmtree(out / "parts", ignore_errors=True)
    assert chaos.heartbeat("w") is not None  # the same worker process served throughout


def test_an_output_that_cannot_be_opened_fails_only_its_own_job(chaos, reference):
    """A hostile writer points a job at a scheme pyarrow cannot open: the worker must
    not crash (which would charge every other job's in-flight requests)."""
    broken, plain = prompt_lines(4, "broken"), prompt_lines(8, "plain")
    chaos.submit("broken", broken)
    out = chaos.submit("plain", plain)
    chaos.conn.hset(chaos.qk.job("broken").job, "output", "nosuch://bucket/x")
    worker = chaos.loop_worker("w", max_attempts=2, storage_outage_s=600.0)
    wait_until(lambda: chaos.record("plain").state.value == "finalizing", 120, "the plain job")
    assert chaos.finalized("plain") == "completed"
    rows = chaos.result("plain")
    assert_exactly_once(rows, plain, reference(plain))
    assert rows["attempts"] == [1] * len(plain)  # nothing charged to the plain job
    assert_nothing_left_but(chaos, "plain", out, pending_elsewhere=len(broken))
    wait_until(lambda: status(chaos, "broken")["storage_error"], 30, "the broken job's error")
    assert "cannot open output 'nosuch://bucket/x'" in status(chaos, "broken")["storage_error"]
    assert chaos.conn.hlen(chaos.qk.job("broken").errors) == 0
    assert worker.alive()


def assert_nothing_left_but(chaos: Chaos, job_id: str, out: Path, pending_elsewhere: int) -> None:
    assert chaos.record(job_id).state.value == "completed"
    assert sorted(p.name for p in out.iterdir()) == [
        "batchgen-job.json", "manifest.json", "result.parquet"
    ]  # fmt: skip
    assert chaos.pending() == pending_elsewhere  # the broken job's rows, held by the worker
