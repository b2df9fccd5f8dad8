"""The fleet scenario, for its test and for benchmarks/fleet_hosts.py: redis-server,
moto's S3 server, each worker and the CLI each on a host of its own (tests/netns.py);
mid-job one worker host drops off the network for longer than the claim timeout,
then comes back.

The test process reaches every host through the bridge (its ``.1``) to watch Redis
and to run finalize, as a supervisor on any host would.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import redis

from batchgen.jobs.redis.keys import GROUP
from batchgen.jobs.redis.redis_server import RedisServer
from tests.chaos.harness import Chaos, Proc, wait_until, write_jsonl
from tests.netns import Hosts
from tests.s3_server import MotoServer

BUCKET = "fleet"
S3_PORT = 5000
REDIS_PORT = 6379


@dataclass
class FleetChaos(Chaos):
    """Chaos whose processes run on hosts: workers where ``placement`` says, every
    other process (and ``cli``) on the ``client`` host."""

    hosts: Hosts = field(default_factory=Hosts)
    placement: dict[str, str] = field(default_factory=dict)  # process name -> host
    store: str = ""  # the S3 endpoint, host:port

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str], stdin: bytes = b"") -> Proc:
        host = self.placement.get(name, "client")
        return super()._spawn(name, [*self.hosts.exec(host), *cmd], env, stdin)

    def cli(self, *args: str, env: dict[str, str] | None = None, timeout: float = 120) -> Any:
        cmd = [*self.hosts.exec("client"), sys.executable, "-m", "batchgen", *args]
        return subprocess.run(cmd, env=env or self.env(), capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip

    def submit_s3(self, job_id: str, lines: list[dict]) -> str:
        """Put the prompts on the store and ``batchgen submit s3://...`` them from the
        client host, output on the store too; the output URI."""
        src = write_jsonl(self.tmp / f"{job_id}.jsonl", lines)
        fs = pafs.S3FileSystem(endpoint_override=self.store, scheme="http")
        with fs.open_output_stream(f"{BUCKET}/in/{job_id}.jsonl") as out:
            out.write(src.read_bytes())
        output = f"s3://{BUCKET}/out/{job_id}"
        done = self.cli("submit", f"s3://{BUCKET}/in/{job_id}.jsonl", "--model", str(self.model),
                        "--job-id", job_id, "--output", output)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return output

    def listing(self, job_id: str) -> list[str]:
        fs = pafs.S3FileSystem(endpoint_override=self.store, scheme="http")
        where = pafs.FileSelector(f"{BUCKET}/out/{job_id}", recursive=True, allow_not_found=True)
        found = fs.get_file_info(where)
        return sorted(i.base_name for i in found if i.type == pafs.FileType.File)


@contextlib.contextmanager
def fleet(tmp: Path, model: Path, workers: list[str]) -> Iterator[FleetChaos]:
    """Hosts redis, store, client and one per worker; redis-server and moto running on
    theirs; AWS_* variables (the endpoint by AWS_ENDPOINT_URL) in this process's
    environment, which every process inherits. Everything is removed at the end."""
    hosts = Hosts()
    procs: list[subprocess.Popen[bytes]] = []
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                             "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")}  # fmt: skip
    chaos: FleetChaos | None = None
    try:
        hosts.start()
        for host in ("redis", "store", "client", *workers):
            hosts.add(host)
        redis_ip, store_ip = hosts.addresses["redis"], hosts.addresses["store"]
        server = RedisServer(tmp / "redis", port=REDIS_PORT,
                             extra_args=("--bind", redis_ip))  # fmt: skip
        server.data_dir.mkdir(parents=True)
        procs.append(subprocess.Popen([*hosts.exec("redis"), *server.command()],
                                      start_new_session=True))  # fmt: skip
        url = f"redis://{redis_ip}:{REDIS_PORT}/0"
        wait_until(lambda: _pings(url), 30, f"redis-server on {redis_ip}")
        moto = MotoServer(tmp / "moto.log", host=store_ip, port=S3_PORT)
        moto.start(prefix=tuple(hosts.exec("store")))
        assert moto.process is not None
        procs.append(moto.process)
        os.environ.update(AWS_ACCESS_KEY_ID="fleet", AWS_SECRET_ACCESS_KEY="fleet",
                          AWS_DEFAULT_REGION="us-east-1",
                          AWS_ENDPOINT_URL=f"http://{moto.endpoint}")  # fmt: skip
        pafs.S3FileSystem(endpoint_override=moto.endpoint, scheme="http",
                          allow_bucket_creation=True).create_dir(BUCKET)  # fmt: skip
        placement = {name: name for name in workers}
        chaos = FleetChaos(url, model, tmp, hosts=hosts, placement=placement, store=moto.endpoint)
        yield chaos
    finally:
        if chaos is not None:
            chaos.stop_all()
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        left = hosts.close()
        assert not left, f"left on the machine: {left}"


def _pings(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1).ping())
    except (redis.ConnectionError, redis.TimeoutError):
        return False


@dataclass
class CutReport:
    held: list[int]  # the lines the cut worker held when its link went down
    cut_s: float  # how long it was off the network
    total_s: float  # submit to completed


def cut_one_worker(
    chaos: FleetChaos, job_id: str, lines: list[dict], workers: list[str], claim_timeout_s: float
) -> CutReport:
    """Submit from the client host, run the workers, cut the first worker's link once
    it holds requests; keep it cut past the claim timeout, until the others have
    committed every line it held; mend it; wait for the job to complete."""
    started = time.monotonic()
    chaos.submit_s3(job_id, lines)
    for name in workers:
        chaos.loop_worker(name, max_num_seqs=2, claim_timeout_s=claim_timeout_s)
    victim = workers[0]
    conn, qk = chaos.conn, chaos.qk
    held_ids = wait_until(
        lambda: [e["message_id"] for e in conn.xpending_range(qk.stream, GROUP, "-", "+", 100, victim)],
        180, f"{victim} to hold requests")  # fmt: skip
    chaos.hosts.cut(victim)
    cut_at = time.monotonic()
    try:
        held = sorted(int(conn.xrange(qk.stream, i, i)[0][1][b"i"]) for i in held_ids)
        done = qk.job(job_id).done
        wait_until(lambda: all(conn.getbit(done, i) for i in held), 300,
                   f"the others to take over {victim}'s lines {held}")  # fmt: skip
        time.sleep(max(0.0, claim_timeout_s * 2 - (time.monotonic() - cut_at)))
    finally:
        chaos.hosts.mend(victim)
    cut_s = time.monotonic() - cut_at
    wait_until(lambda: chaos.record(job_id).state.value != "running", 300, "the rest")
    assert chaos.finalized(job_id, timeout=120) == "completed"
    return CutReport(held, cut_s, time.monotonic() - started)
