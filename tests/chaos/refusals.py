"""Ways to make a real redis-server answer an error reply of OUTAGE_REPLIES
(connection.py) for a while: each ``Refusal`` starts it, and ``allow`` ends it.

OOM: ``maxmemory 1`` under noeviction refuses every write. READONLY: the server is made
a replica of a port nobody listens on (it keeps its data). MISCONF: a snapshot fails
(its dir is gone) with snapshots configured (stop-writes-on-bgsave-error). BUSY:
another client's script loops past ``lua-time-limit`` until SCRIPT KILL. LOADING: the
server restarts on an AOF whose RDB preamble holds 64 MB that it reads slowly
(``key-load-delay``, 48 s in all); while loading it answers LOADING each time it looks
up from the file (every 2 MB, 0.75 s: a client needs a few of those to connect and be
told). Every ``allow`` also flushes the script cache, so the next script call meets
NOSCRIPT (redis-py's Script loads the script again).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from batchgen.jobs.redis.redis_server import RedisServer, free_port
from tests.chaos.harness import rconn, wait_until

LOOP = "local i = 0 while true do i = i + 1 end"


@dataclass
class Refusal:
    code: str
    server: RedisServer
    tmp: Path
    _undo: list[Any] = field(default_factory=list)

    @property
    def conn(self) -> Any:
        return rconn(self.server.url)

    def refuse(self) -> None:
        getattr(self, f"_{self.code.lower()}")()

    def allow(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        self.conn.script_flush()  # the next EVALSHA meets NOSCRIPT

    def _oom(self) -> None:
        self.conn.config_set("maxmemory", 1)
        self._undo.append(lambda: self.conn.config_set("maxmemory", 0))

    def _readonly(self) -> None:
        self.conn.replicaof("127.0.0.1", free_port())
        self._undo.append(lambda: self.conn.replicaof("NO", "ONE"))

    def _misconf(self) -> None:
        conn = self.conn
        gone = self.tmp / "snapshots-gone"
        gone.mkdir()
        before = conn.config_get("dir")["dir"]
        conn.config_set("dir", str(gone))
        conn.config_set("save", "3600 1")
        gone.rmdir()
        conn.bgsave()
        wait_until(lambda: conn.info("persistence")["rdb_last_bgsave_status"] == "err", 10,
                   "the snapshot to fail")  # fmt: skip
        self._undo.append(lambda: (conn.config_set("dir", before), conn.config_set("save", "")))

    def _busy(self) -> None:
        self.conn.config_set("lua-time-limit", 20)
        killed: list[str] = []

        def loop() -> None:
            try:
                rconn(self.server.url).eval(LOOP, 0)
            except redis.ResponseError as exc:
                killed.append(str(exc))

        thread = threading.Thread(target=loop)
        thread.start()
        time.sleep(0.3)

        def stop() -> None:
            wait_until(lambda: _script_kill(self.conn), 10, "SCRIPT KILL to be accepted")
            thread.join(10)
            assert killed and "Script killed by user" in killed[0], killed

        self._undo.append(stop)

    def _loading(self) -> None:
        conn = self.conn
        conn.execute_command("DEBUG", "POPULATE", "16000", "ballast", "4096")  # not in the AOF
        conn.config_set("rdbcompression", "no")  # 64 MB on disk, read 2 MB at a time
        conn.bgrewriteaof()  # the AOF starts with an RDB preamble of everything
        wait_until(lambda: _rewritten(conn), 60, "the AOF rewrite")
        server = self.server
        server.kill()
        server.extra_args = (*server.extra_args, "--key-load-delay", "3000")  # µs a key
        starting = threading.Thread(target=server.start, kwargs={"timeout": 120})
        starting.start()
        wait_until(lambda: answers_loading(server.url), 30, "the server to answer LOADING")

        def loaded() -> None:
            starting.join(120)
            server.extra_args = server.extra_args[:-2]
            self.conn.delete(*(f"ballast:{i}" for i in range(16000)))

        self._undo.append(loaded)


def _rewritten(conn: Any) -> bool:
    info = conn.info("persistence")
    return not info["aof_rewrite_in_progress"] and not info["aof_rewrite_scheduled"]


def answers_loading(url: str) -> bool:
    try:
        redis.Redis.from_url(url, socket_timeout=5).get("probe")
    except redis.BusyLoadingError:
        return True
    except redis.ConnectionError:
        pass
    return False


def _script_kill(conn: Any) -> bool:
    try:
        conn.script_kill()
    except redis.ResponseError:
        return False
    return True
