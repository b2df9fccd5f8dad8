"""A user's shell for the tests that run ``batchgen`` as a user would: real processes, a
real Redis (the embedded one under a private BATCHGEN_HOME, or a private server), and
the output they print, checked exactly."""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq


class Shell:
    """``batchgen`` commands in ``cwd`` with ``BATCHGEN_HOME`` at ``home``; against
    ``redis_url`` when given (BATCHGEN_REDIS_URL), else the embedded Redis."""

    def __init__(self, cwd: Path, home: Path, redis_url: str | None = None) -> None:
        self.cwd = cwd
        self.env = {**os.environ, "BATCHGEN_HOME": str(home), "OMP_NUM_THREADS": "1",
                    "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}  # fmt: skip
        self.env.pop("BATCHGEN_REDIS_URL", None)
        self.env.pop("BATCHGEN_TEST_CRASH_AT", None)
        if redis_url:
            self.env["BATCHGEN_REDIS_URL"] = redis_url
        self.started: list[subprocess.Popen[bytes]] = []

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "batchgen", *args], cwd=self.cwd,
                              env=self.env, capture_output=True, text=True, timeout=timeout)  # fmt: skip

    def at_terminal(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """``run`` with stderr on a pseudo-terminal, as a person at a shell sees it (notes
        meant for them are written only there); stdout captured as in ``run``."""
        leader, follower = pty.openpty()
        try:
            done = subprocess.run([sys.executable, "-m", "batchgen", *args], cwd=self.cwd,
                                  env=self.env, stdout=subprocess.PIPE, stderr=follower,
                                  text=True, timeout=timeout)  # fmt: skip
            os.close(follower)
            said = b""
            while True:
                try:
                    chunk = os.read(leader, 4096)
                except OSError:  # EIO: the terminal's other end is closed and drained
                    break
                if not chunk:
                    break
                said += chunk
        finally:
            os.close(leader)
        done.stderr = said.decode().replace("\r\n", "\n")
        return done

    def ok(self, *args: str) -> str:
        out = self.run(*args)
        assert out.returncode == 0, (args, out.stderr[-3000:])
        return out.stdout

    def status(self, job_id: str) -> dict[str, Any]:
        return json.loads(self.ok("status", job_id, "--json"))

    def start(
        self, *args: str, log: str = "worker.log", extra_env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """A long-running command (a worker), its output in ``cwd/log``."""
        with open(self.cwd / log, "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "batchgen", *args], cwd=self.cwd,
                                    env={**self.env, **(extra_env or {})}, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.started.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 180) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


def write_jsonl(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n"
                            for line in lines))  # fmt: skip
    return path


def rows(path: Path) -> dict[str, list]:
    return pq.read_table(path).to_pydict()


def shells(cwd: Path, home: Path, redis_url: str | None = None) -> Iterator[Shell]:
    """A fixture's body: a Shell, its processes killed afterwards."""
    shell = Shell(cwd, home, redis_url)
    try:
        yield shell
    finally:
        shell.stop_all()
