"""moto's standalone S3 server (``moto_server``, PyPI ``moto[server]``) as a process of
the test's own: a real S3 API over HTTP that pyarrow's own S3 client reaches.

moto keeps objects in memory, so a restart would empty it: a test takes the store
away with ``Gate`` (its address refuses connections) or ``pause`` (it hangs)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from batchgen.jobs.redis.redis_server import free_port

MOTO = Path(sys.executable).parent / "moto_server"  # this environment's


class MotoServer:
    def __init__(self, log: Path, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.log, self.host, self.port = log, host, port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def command(self) -> list[str]:
        if not MOTO.exists():
            pytest.skip("an S3 endpoint needs moto's server: pip install 'moto[server]'")
        return [str(MOTO), "-H", self.host, "-p", str(self.port)]

    def start(self, prefix: tuple[str, ...] = ()) -> None:
        """Start it (``prefix``: e.g. ``ip netns exec NS``) and wait until it answers."""
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen([*prefix, *self.command()], stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://{self.endpoint}/moto-api/", timeout=1)
                return
            except OSError:
                alive = self.process.poll() is None
                assert alive and time.monotonic() < deadline, self.log.read_text()
                time.sleep(0.1)

    def pause(self) -> None:
        """SIGSTOP: connections are still accepted (by the kernel), nothing answers."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.kill()
        if self.process is not None:
            self.process.wait()


class Gate:
    """A TCP relay in front of a server, at an address of its own, that the test can
    close: ``close()`` drops every relayed connection and stops listening (clients get
    "connection refused", as from a store that went away); ``open()`` listens again on
    the same port. What the server holds is untouched."""

    def __init__(self, target: tuple[str, int], host: str = "127.0.0.1") -> None:
        self.target, self.host, self.port = target, host, free_port()
        self.listener: socket.socket | None = None
        self.links: list[socket.socket] = []
        self.lock = threading.Lock()
        self.closed_at = 0.0

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def open(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self.port))
        listener.listen(64)
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def close(self) -> None:
        self.closed_at = time.monotonic()
        with self.lock:
            listener, self.listener = self.listener, None
            links, self.links = self.links, []
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
            listener.close()
        for link in links:
            with contextlib.suppress(OSError):
                link.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                link.shutdown(socket.SHUT_RDWR)  # wakes its relay thread, ends the stream
            link.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed
            try:
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self.lock:
                if self.listener is not listener:
                    client.close()
                    server.close()
                    return
                self.links += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
    for sock in (src, dst):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
