"""An interrupted test run leaves no redis-server behind: a small pytest session in a
child process holds the session's and a private server, is stopped by Ctrl-C (SIGINT),
SIGTERM or SIGKILL, and every server it started is gone with it (tests/conftest.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.chaos.harness import wait_until
from tests.doc_blocks import REPO

HOLDER = """
import os, time
from pathlib import Path

def test_holds_two_servers(redis_server, private_redis):
    pids = f"{redis_server.process.pid} {private_redis.process.pid}"
    Path(os.environ["SERVER_PIDS"]).write_text(pids)
    time.sleep(600)
"""


def running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
# SIGINT (Ctrl-C): pytest tears its fixtures down, which stop the servers. SIGTERM and
# SIGKILL: pytest runs no teardown, so only the servers' parent-death signal stops them.
@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda sig: sig.name
)
def test_a_stopped_test_session_takes_its_redis_servers_with_it(tmp_path: Path, sig) -> None:
    (tmp_path / "test_holder.py").write_text(HOLDER)
    pids_file = tmp_path / "pids"
    # not an xdist worker of this run: its session fixtures are its own, not the run's shared ones
    outer = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env = {**outer, "SERVER_PIDS": str(pids_file),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    # Its own temp root: under the run's shared one, its exit would clean up old runs' dirs.
    # Without hypothesis: after a Ctrl-C its summary imports all of hypothesis.
    child = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
         "no:hypothesispytest", "-p", "tests.conftest", "--rootdir", str(tmp_path),
         "--basetemp", str(tmp_path / "base"), str(tmp_path / "test_holder.py")],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    pids: list[int] = []
    try:
        wait_until(lambda: pids_file.exists() and pids_file.read_text(), 120,
                   "the child session to start its servers")  # fmt: skip
        pids = [int(p) for p in pids_file.read_text().split()]
        assert all(running(pid) for pid in pids)
        child.send_signal(sig)
        # The servers go first (teardown, or the child's death): 2-4 s. The child's own
        # exit after a Ctrl-C takes longer, all CPU: pytest's report of the interrupt
        # parses the source of every frame, the terminal summary's plugins import, torch
        # unloads (11-24 s on a busy 2-core machine; inside the full suite it outlasted
        # the 60 s this test once gave it), so it has a bound of its own.
        wait_until(lambda: not any(running(pid) for pid in pids), 60,
                   f"the servers to stop after signal {sig.name}")  # fmt: skip
        assert child.wait(timeout=240) == (2 if sig == signal.SIGINT else -sig)
        assert [pid for pid in pids if running(pid)] == []
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for pid in pids:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
