"""Redis behind Sentinel loses its primary (SIGKILL) mid-job: a primary, one replica
and three sentinels, all real redis-server processes (the sentinels in sentinel
mode). Workers, ``status`` and a ``submit`` started during the failover reach the
promoted replica through ``redis+sentinel://``, and both jobs complete exactly once."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.jobs.ops import chunk_append
from batchgen.jobs.ops.fair_share import backlog
from batchgen.jobs.redis import sentinel
from batchgen.jobs.redis.connection import connect
from batchgen.jobs.redis.redis_server import RedisServer, find_redis_server, free_port
from batchgen.jobs.schema.errors import RedisUnavailable
from tests.chaos.harness import (
    Chaos,
    assert_exactly_once,
    assert_nothing_left,
    prompt_lines,
    wait_until,
    write_jsonl,
)

SERVICE = "fleetmaster"
pytestmark = pytest.mark.slow


@dataclass
class SentinelSet:
    """A primary, a replica and three sentinels on loopback ports of their own."""

    tmp: Path
    primary: RedisServer = field(init=False)
    replica: RedisServer = field(init=False)
    sentinels: list[tuple[int, subprocess.Popen[bytes]]] = field(default_factory=list)

    def start(self) -> None:
        self.primary = RedisServer(self.tmp / "primary")
        self.primary.start()
        self.replica = RedisServer(
            self.tmp / "replica", extra_args=("--replicaof", "127.0.0.1", str(self.primary.port))
        )
        self.replica.start()
        for k in range(3):
            port, folder = free_port(), self.tmp / f"sentinel{k}"
            folder.mkdir()
            conf = folder / "sentinel.conf"  # sentinel rewrites its config: one each
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {folder}\nlogfile {folder / 'log'}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary.port} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                f"sentinel failover-timeout {SERVICE} 10000\n"
            )
            proc = subprocess.Popen([find_redis_server(), str(conf), "--sentinel"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True)  # fmt: skip
            self.sentinels.append((port, proc))
        wait_until(self.ready, 30, "the sentinels to see the primary, its replica and each other")

    def ready(self) -> bool:
        for port, _ in self.sentinels:
            try:
                state: Any = redis.Redis(port=port, socket_timeout=1).sentinel_master(SERVICE)
            except (redis.ConnectionError, redis.ResponseError):
                return False
            if state["num-slaves"] != 1 or state["num-other-sentinels"] != 2:
                return False
        return True

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port, _ in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def master_port(self) -> int:
        port = self.sentinels[0][0]
        address: Any = redis.Redis(port=port).sentinel_get_master_addr_by_name(SERVICE)
        return int(address[1])

    def stop(self) -> None:
        for _, proc in self.sentinels:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        self.replica.kill()
        self.primary.kill()


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[SentinelSet]:
    world = SentinelSet(tmp_path / "sentinel")
    try:
        world.start()
        yield world
    finally:
        world.stop()


class SentinelChaos(Chaos):
    """Chaos whose own client goes through Sentinel too."""

    @property
    def conn(self) -> Any:
        return connect(self.redis_url, retries=5, wait_s=30)


def test_a_write_through_sentinel_waits_for_a_replica(sentinels):
    """A commit or submit's last chunk waits for the replica (WAIT 1): with the replica
    stopped, the wait runs its full REPLICA_WAIT_MS and says no replica has the write;
    running, one has it. A plain client does not wait."""
    conn = connect(sentinels.url)
    conn.set("k", "v")
    assert sentinel.replicated(conn) == 1
    assert sentinel.replicated(connect(f"redis://127.0.0.1:{sentinels.primary.port}/0")) == -1
    assert sentinels.replica.process is not None
    sentinels.replica.process.send_signal(signal.SIGSTOP)
    try:
        conn.set("k", "w")
        started = time.monotonic()
        assert sentinel.replicated(conn) == 0
        assert time.monotonic() - started >= sentinel.REPLICA_WAIT_MS / 1000 - 0.1
    finally:
        sentinels.replica.process.send_signal(signal.SIGCONT)
    assert sentinel.replicated(conn) == 1


def test_user_and_password_reach_the_primary_through_sentinel(sentinels):
    for server in (sentinels.primary, sentinels.replica):  # ACLs are not replicated
        redis.Redis(port=server.port).acl_setuser(
            "bg", enabled=True, passwords=["+s3cret"], keys=["*"], commands=["+@all"]
        )
    hosts = sentinels.url.removeprefix("redis+sentinel://")
    assert connect(f"redis+sentinel://bg:s3cret@{hosts}").acl_whoami() in ("bg", b"bg")
    with pytest.raises(RedisUnavailable, match=r"redis\+sentinel://bg:\*\*\*@.* refused the cred"):
        connect(f"redis+sentinel://bg:wrong@{hosts}")


def test_sigkill_of_the_primary_mid_job_fails_over_and_loses_nothing(
    sentinels, model, reference, tmp_path
):
    chaos = SentinelChaos(sentinels.url, model, tmp_path)
    try:
        # paced (a step >= 20 ms, a row >= 1 s, the job >= 8 s on 2 slots): the first
        # commit (every 2 s) cannot hold the whole job however fast the machine (sized
        # in tokens alone, a fast machine finished all 16 rows before the first flush)
        lines = prompt_lines(16, "sent", max_tokens=(48, 64))
        out = chaos.submit("sent", lines)
        assert sentinels.master_port() == sentinels.primary.port
        worker = chaos.worker_cli("sup", "--claim-timeout", "2", "--max-num-seqs", "2", step_s=0.02)
        wait_until(lambda: chaos.record("sent").done >= 2, 120, "some committed rows")
        assert chaos.record("sent").done < 16  # mid-job
        sentinels.primary.kill()
        status = chaos.cli_start("status", "status", "sent", "--json")
        later = prompt_lines(6, "late")
        src = write_jsonl(chaos.tmp / "late.jsonl", later)
        late = chaos.cli_start("submit-late", "submit", str(src), "--model", str(chaos.model),
                               "--job-id", "late", "--output", str(chaos.output("late")),
                               env=chaos.env(BATCHGEN_REDIS_WAIT="30"))  # fmt: skip
        wait_until(lambda: sentinels.master_port() == sentinels.replica.port, 30,
                   "the sentinels to promote the replica")  # fmt: skip
        assert status.wait(60) == 0, status.tail()
        reported = json.loads(status.tail().strip().splitlines()[-1])
        assert (reported["job_id"], reported["total"]) == ("sent", 16)
        assert late.wait(60) == 0, late.tail()
        for job_id in ("sent", "late"):
            wait_until(partial(lambda j: chaos.record(j).state.terminal, job_id), 300,
                       f"{job_id} to finish")  # fmt: skip
        worker.kill(signal.SIGTERM)
        assert worker.wait(60) == 0, worker.tail()
        for job_id, job_lines in (("sent", lines), ("late", later)):
            rows = chaos.result(job_id)
            assert_exactly_once(rows, job_lines, reference(job_lines))
            assert_nothing_left(chaos, job_id, chaos.output(job_id))
        assert out == chaos.output("sent")
        assert chaos.conn.info("replication")["role"] == "master"
        assert chaos.conn.connection_pool.get_master_address()[1] == sentinels.replica.port
    finally:
        chaos.stop_all()


def test_a_submit_in_flight_when_the_primary_dies_enqueues_every_line_once(
    sentinels, tmp_path, monkeypatch
):
    """SIGKILL of the primary between two of a submit's chunks: the submit waits for
    the promoted replica, re-reads the job's counter there (chunks the replica never
    got are appended again, none twice) and finishes: every line once, in order."""
    monkeypatch.setattr(chunk_append, "CHUNK_ENTRIES", 100)
    monkeypatch.setenv("BATCHGEN_REDIS_WAIT", "30")
    original, sent = chunk_append._ChunkSender.send, []

    def send(sender, start: int, chunk: list[bytes]) -> None:
        sent.append(start)
        if len(sent) == 5:
            sentinels.primary.kill()
        original(sender, start, chunk)

    monkeypatch.setattr(chunk_append._ChunkSender, "send", send)
    src = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"line {i}"} for i in range(2000)])
    args = ["submit", str(src), "--model", "m", "--job-id", "big", "--output",
            str(tmp_path / "out"), "--redis", sentinels.url]  # fmt: skip
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert (result.exit_code, result.stdout) == (0, "big\n")
    assert sentinels.master_port() == sentinels.replica.port
    chaos = SentinelChaos(sentinels.url, Path("m"), tmp_path)
    indices = [index for index, _, _ in backlog.queued(chaos.conn, chaos.qk, "big")]
    assert indices == list(range(2000)) and chaos.record("big").backlog == 2000  # every line once
    record = chaos.record("big")
    assert (record.enqueued, record.total) == (2000, 2000)
