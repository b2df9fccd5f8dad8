"""Real processes for the ``batchgen serve`` tests: the server and CPU workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis

from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.redis.redis_server import RedisServer, free_port

KEY = "sk-test-batchgen"


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@contextmanager
def private_stack(tmp: Path, model: Path, env: dict[str, str] | None = None) -> Iterator[Stack]:
    """A Stack (``model``: what its workers serve) on a redis-server of its own, in ``tmp``;
    its processes and the redis-server are killed at the end."""
    server = RedisServer(tmp / "redis")
    server.start()
    stack = Stack(server.url, tmp, env=dict(env or {}))
    stack.model = model  # type: ignore[attr-defined]
    try:
        yield stack
    finally:
        stack.stop()
        server.kill()


@dataclass
class Stack:
    """A ``batchgen serve`` process (and the workers started with ``worker``)."""

    redis_url: str
    tmp: Path
    env: dict[str, str] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)
    port: int = 0
    server: subprocess.Popen | None = None
    server_log: str = "serve"

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def serve(self, *args: str, name: str = "serve", or_frozen: bool = False) -> subprocess.Popen:
        """A server (its log: ``name``.log), on the stack's files dir unless ``args`` say.
        ``or_frozen``: it may stop at its crash point (a batch it takes over) before it
        answers, and that is waited for too."""
        self.port = free_port()
        self.server = self._start(name, "serve", "--port", str(self.port), "--files-dir",
                                  str(self.tmp / "files"), "--output-root", str(self.tmp / "out"),
                                  *args)  # fmt: skip
        self.server_log = name
        wait_for(lambda: (or_frozen and self.frozen()) or self._up(), 60,
                 "batchgen serve to answer")  # fmt: skip
        return self.server

    def frozen(self) -> bool:
        """The server stopped at its crash point (BATCHGEN_TEST_CRASH_AT)."""
        return "crash point" in self.log(self.server_log)

    def kill_server(self) -> None:
        """kill -9 of the server (its whole process group)."""
        assert self.server is not None
        os.killpg(self.server.pid, signal.SIGKILL)
        self.server.wait()

    def worker(self, model: Path, *args: str) -> subprocess.Popen:
        proc = self._start(f"worker-{len(self.procs)}", "worker", "--model", str(model),
                           "--device", "cpu", *args)  # fmt: skip
        conn = redis.Redis.from_url(self.redis_url)
        wait_for(lambda: conn.zcard(Keys("bg").workers) > 0, 120, "a worker heartbeat")
        return proc

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()[-4000:]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def _start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115
        env = {**os.environ, "BATCHGEN_REDIS_URL": self.redis_url, "OMP_NUM_THREADS": "1",
               "BATCHGEN_HOME": str(self.tmp / "home"), "PYTHONUNBUFFERED": "1", **self.env}  # fmt: skip
        proc = subprocess.Popen([sys.executable, "-m", "batchgen", *args], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.procs.append(proc)
        return proc

    def _up(self) -> bool:
        assert self.server is not None and self.server.poll() is None, self.log(self.server_log)
        try:
            with urllib.request.urlopen(self.base + "/", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False
