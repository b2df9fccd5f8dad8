"""The finalizer process: runs one model's queued finalize tasks, then exits.

``python -m batchgen.worker.supervisor.finalizer`` reads ``{"redis_url", "prefix",
"tag"}`` as JSON on stdin (the Redis URL may hold a password: never on the
command line). The supervisor starts one whenever its model's finalize queue
holds tasks, so a long finalize (a 10M-row job) never blocks it: children are
restarted and SIGTERM handled meanwhile. Tasks still queued once the newest
finalizer has run ``PATIENCE_S`` get another (``Finalizers``): a job's finalize
never waits for another job's, or for a finalizer that hangs as it ends. A
finalizer that is killed leaves its lease to expire; the sweep queues the job again.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from dataclasses import dataclass, field

import redis

from batchgen.jobs.backoff import backoff_delay
from batchgen.jobs.ops.finalize.finalize_tasks import run_pending
from batchgen.jobs.redis.connection import connect
from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.redis.outage_probe import OutageLog, refused_writes
from batchgen.jobs.schema.errors import BatchgenError, RedisUnavailable
from batchgen.parts import child_environ, module_command


@dataclass(slots=True)
class FinalizerProcess:
    """The supervisor's handle on at most one running finalizer."""

    redis_url: str
    prefix: str
    tag: str
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0  # time.monotonic() at start

    def start(self) -> None:
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            module_command("batchgen.worker.supervisor.finalizer"), env=child_environ(),
            stdin=subprocess.PIPE,
        )  # fmt: skip
        config = {"redis_url": self.redis_url, "prefix": self.prefix, "tag": self.tag}
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(config).encode())
        self.process.stdin.close()

    def running(self) -> bool:
        """Whether one runs (a finished one is reaped)."""
        if self.process is None:
            return False
        rc = self.process.poll()
        if rc is None:
            return True
        if rc != 0:
            logging.getLogger(__name__).warning("finalizer exited with %s", rc)
        self.process = None
        return False

    def stop(self, timeout: float) -> None:
        """SIGTERM (a finalize in progress stops; its lease expires), then SIGKILL."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None


PATIENCE_S = 10.0  # long enough for a new finalizer to start and take the queued tasks
MAX_FINALIZERS = 4


@dataclass(slots=True)
class Finalizers:
    """The supervisor's finalizer processes: one while the tasks queued get taken,
    another when tasks still wait after the newest has run ``PATIENCE_S`` (it is busy
    with a long finalize, or stuck), up to ``MAX_FINALIZERS``. Two finalizers never
    finalize one job: each holds the job's lease (jobs/ops/finalize/finalization.py)."""

    redis_url: str
    prefix: str
    tag: str
    processes: list[FinalizerProcess] = field(default_factory=list)

    def running(self) -> bool:
        """Whether any runs (finished ones are reaped)."""
        self.processes = [p for p in self.processes if p.running()]
        return bool(self.processes)

    def serve(self, queued: bool) -> None:
        """Start one if ``queued`` tasks wait and none runs, or every one that runs has
        had its ``PATIENCE_S``."""
        if not queued or (self.running() and (
            len(self.processes) >= MAX_FINALIZERS
            or time.monotonic() - self.processes[-1].started < PATIENCE_S
        )):  # fmt: skip
            return
        process = FinalizerProcess(self.redis_url, self.prefix, self.tag)
        process.start()
        self.processes.append(process)

    def stop(self, timeout: float) -> None:
        for process in self.processes:
            process.stop(timeout)
        self.processes = []


def main() -> int:
    config = json.loads(sys.stdin.read())
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s finalizer %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )  # fmt: skip
    keys = Keys(config["prefix"])
    conn = _connect_when_writable(config["redis_url"], keys)
    if conn is None:
        return 3
    ran = run_pending(conn, keys, config["tag"])
    if ran:
        logging.info("ran %d finalize task(s)", ran)
    return 0


def _connect_when_writable(url: str, keys: Keys) -> redis.Redis | None:
    """A client once Redis takes writes: an outage (unreachable, or an error reply of
    OUTAGE_REPLIES: outage_probe) is waited out with backoff and logged when it starts
    and when it ends. None when Redis refuses us for good (credentials, policy)."""
    outage = OutageLog(logging.getLogger(), "finalizer")
    attempt = 0
    while True:
        try:
            conn = connect(url, retries=2)
            reason = refused_writes(conn, keys)
        except RedisUnavailable as exc:
            if not exc.transient:
                logging.error("%s", exc)
                return None
            reason = str(exc)
        except BatchgenError as exc:
            logging.error("%s", exc)
            return None
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            reason = f"Redis unavailable ({exc})"
        if reason is None:
            outage.up()
            return conn
        outage.down(reason)
        time.sleep(backoff_delay(attempt, 0.2, 5.0))
        attempt += 1


if __name__ == "__main__":
    sys.exit(main())
