"""The embedded Redis keeps its data private and trusts only a server of its own user.

Real ``batchgen`` commands start the embedded redis-server; the impostors are
real redis-servers run as another user (nobody), planted where batchgen looks:
the predictable /tmp name older versions fell back to, the private socket dir
batchgen recorded, and the data dir itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from batchgen.jobs.redis import embedded
from batchgen.jobs.redis.redis_server import find_redis_server

NOBODY = 65534
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root to run an impostor redis-server as another user"
)


def batchgen(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BATCHGEN_HOME": str(home)}
    env.pop("BATCHGEN_REDIS_URL", None)
    return subprocess.run([sys.executable, "-m", "batchgen", *args], env=env, umask=0o022,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def submit(home: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "the secret prompt"}\n')
    return batchgen(home, "submit", str(prompts), "--model", str(checkpoint(tmp_path)),
                    "--job-id", "j", "--json")  # fmt: skip


def checkpoint(tmp_path: Path) -> Path:
    """A directory that passes submit's model check (the files a checkpoint has); these
    tests never load it."""
    path = tmp_path / "model"
    path.mkdir(exist_ok=True)
    for name, data in (("config.json", b"{}"), ("tokenizer.json", b"{}"),
                       ("model.safetensors", b"")):  # fmt: skip
        (path / name).write_bytes(data)
    return path


def private_socket_dir(sock: Path) -> bool:
    """Whether ``sock`` lies in a dir batchgen made with mkdtemp (``batchgen-XXXXXXXX``), the
    only kind of dir these tests may delete: never a shared one such as /tmp itself."""
    parent = sock.parent
    return (
        parent.name.startswith("batchgen-")
        and len(parent.name) > len("batchgen-")
        and parent.is_dir()
        and not parent.is_symlink()
    )


def remove_socket_dir(sock: Path) -> None:
    assert private_socket_dir(sock), f"{sock.parent} is not a private socket dir"
    shutil.rmtree(sock.parent)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "home"
    embedded.stop(tmp_path / "home")


@pytest.fixture
def deep_home(tmp_path: Path) -> Iterator[Path]:
    """A data dir so deep that a socket in it would overflow sun_path."""
    path = tmp_path / ("d" * 120)
    yield path
    embedded.stop(path)
    sock = embedded.socket_path(path)
    if sock is not None and private_socket_dir(sock):
        shutil.rmtree(sock.parent)


class Impostor:
    """A real redis-server run as user nobody, listening on ``sock`` (else in its own dir)."""

    def __init__(self, sock: Path | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="impostor-"))
        os.chown(self.dir, NOBODY, NOBODY)
        self.sock = sock or self.dir / "redis.sock"
        # its own copy of the binary: the venv's may sit in a folder nobody cannot enter
        binary = self.dir / "redis-server"
        shutil.copy(find_redis_server(), binary)
        binary.chmod(0o755)
        self.process = subprocess.Popen(
            [str(binary), "--port", "0", "--unixsocket", str(self.sock), "--unixsocketperm",
             "777", "--dir", str(self.dir), "--save", "", "--appendonly", "no"],
            user=NOBODY, group=NOBODY, extra_groups=[], stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.client: Any = redis.Redis(unix_socket_path=str(self.sock), socket_timeout=5)
        deadline = time.monotonic() + 15
        while True:
            try:
                if self.client.ping():
                    break
            except (redis.ConnectionError, redis.BusyLoadingError):
                assert time.monotonic() < deadline, "the impostor did not come up"
                time.sleep(0.02)

    def move_to(self, path: Path) -> None:
        """Move its listening socket (the same inode) to ``path``."""
        os.rename(self.sock, path)
        self.sock = path
        self.client = redis.Redis(unix_socket_path=str(path), socket_timeout=5)

    def keys(self) -> int:
        return int(self.client.dbsize())

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def test_the_data_dir_and_every_file_in_it_are_private(home, tmp_path):
    out = submit(home, tmp_path)  # under umask 022, as most shells
    assert out.returncode == 0, out.stderr
    directory = home / "redis"
    assert (mode(home), mode(directory)) == (0o700, 0o700)
    found = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = Path(root, name)
            found[str(path.relative_to(directory))] = mode(path)
    aof = [name for name in found if name.startswith("appendonly")]
    assert b"the secret prompt" in b"".join(
        (directory / n).read_bytes() for n in aof if (directory / n).is_file()
    )
    expected = {name: 0o700 if (directory / name).is_dir() else 0o600 for name in found}
    assert found == expected
    assert {"redis.log", "redis.pid", "redis.lock", "redis.sock"} <= set(found)
    assert stat.S_ISSOCK((directory / "redis.sock").lstat().st_mode)


def test_a_data_dir_left_world_readable_is_tightened_before_the_server_starts(home, tmp_path):
    directory = home / "redis"
    directory.mkdir(parents=True, mode=0o755)
    (directory / "redis.log").write_text("an older version's log\n")
    os.chmod(directory, 0o755)
    os.chmod(directory / "redis.log", 0o644)
    assert batchgen(home, "jobs").returncode == 0
    assert (mode(directory), mode(directory / "redis.log")) == (0o700, 0o600)


def test_a_deep_data_dir_gets_its_socket_in_a_fresh_private_dir(deep_home, tmp_path):
    out = submit(deep_home, tmp_path)
    assert out.returncode == 0, out.stderr
    sock = embedded.socket_path(deep_home)
    assert sock is not None and len(str(sock)) <= 100
    assert sock.parent.name.startswith("batchgen-") and mode(sock.parent) == 0o700
    assert sock.parent.stat().st_uid == os.geteuid()
    record = deep_home / "redis" / "socket-dir"
    assert (record.read_text(), mode(record)) == (f"{sock.parent}\n", 0o600)
    assert embedded.ensure_running(deep_home) == f"unix://{sock}"  # found again, not remade


@needs_root
def test_an_impostor_at_the_old_predictable_tmp_name_gets_nothing(deep_home, tmp_path):
    """Older versions fell back to /tmp/batchgen-UID-HASH.sock, a name anyone could take."""
    digest = hashlib.sha256(str(deep_home / "redis" / "redis.sock").encode()).hexdigest()[:12]
    impostor = Impostor(Path(tempfile.gettempdir()) / f"batchgen-{os.getuid()}-{digest}.sock")
    try:
        out = submit(deep_home, tmp_path)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["total"] == 1
        assert impostor.keys() == 0  # not a byte of the job went to it
        sock = embedded.socket_path(deep_home)
        assert sock is not None and sock != impostor.sock
    finally:
        impostor.kill()
        impostor.sock.unlink(missing_ok=True)


@needs_root
def test_an_impostor_in_place_of_the_recorded_socket_dir_is_refused(deep_home, tmp_path):
    embedded.ensure_running(deep_home)
    embedded.stop(deep_home)
    sock = embedded.socket_path(deep_home)
    assert sock is not None
    remove_socket_dir(sock)  # say a tmp cleaner removed it; another user takes the name
    sock.parent.mkdir(mode=0o755)
    os.chown(sock.parent, NOBODY, NOBODY)
    impostor = Impostor(sock)
    try:
        out = submit(deep_home, tmp_path)
        assert (out.returncode, out.stdout) == (1, "")
        assert out.stderr == (
            f"batchgen: error: the embedded Redis socket dir {sock.parent} is not a private "
            f"directory of yours (a directory of uid {NOBODY}, mode 755): someone may be posing "
            "as batchgen's embedded Redis, so it is refused; stop that process and remove it, or "
            "set BATCHGEN_HOME\n"
        )
        assert impostor.keys() == 0
    finally:
        impostor.kill()
        remove_socket_dir(sock)


@needs_root
@pytest.mark.parametrize("socket_owner", [NOBODY, 0])
def test_an_impostor_planted_in_the_data_dir_is_refused(home, tmp_path, socket_owner):
    """Its socket moved into our own data dir: refused by the socket's owner, or (chowned
    to us) by the uid of the process that listens on it."""
    assert batchgen(home, "jobs").returncode == 0  # our data dir, as a first command leaves it
    embedded.stop(home)
    sock = home / "redis" / "redis.sock"
    impostor = Impostor()
    try:
        impostor.move_to(sock)
        os.chown(sock, socket_owner, socket_owner)
        out = submit(home, tmp_path)
        assert (out.returncode, out.stdout) == (1, "")
        what = (
            f"the embedded Redis socket {sock} belongs to uid {NOBODY}, not you"
            if socket_owner == NOBODY
            else f"the process serving the embedded Redis socket {sock} runs as uid {NOBODY}, not you"
        )
        assert out.stderr == (
            f"batchgen: error: {what}: someone may be posing as batchgen's embedded Redis, so it "
            "is refused; stop that process and remove it, or set BATCHGEN_HOME\n"
        )
        assert impostor.keys() == 0
    finally:
        impostor.kill()
        sock.unlink(missing_ok=True)
