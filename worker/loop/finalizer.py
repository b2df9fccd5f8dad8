"""The finalizer process: runs one model's queued finalize tasks, then exits.

``python -m batchgen.worker.loop.finalizer`` reads ``{"redis_url", "prefix",
"tag"}`` as JSON on stdin (the Redis URL may hold a password: never on the
command line). The supervisor starts one whenever its model's finalize queue
holds tasks, so a long finalize (a 10M-row job) never blocks it: children are
restarted and SIGTERM handled meanwhile. A finalizer that is killed leaves its
lease to expire; the sweep queues the job again.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import dataclass

from batchgen.parts import child_environ, module_command


@dataclass(slots=True)
class FinalizerProcess:
    """The supervisor's handle on at most one running finalizer."""

    redis_url: str
    prefix: str
    tag: str
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            module_command("batchgen.worker.loop.finalizer"), env=child_environ(),
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


def main() -> int:
    from batchgen.jobs.ops.finalize_tasks import run_pending
    from batchgen.jobs.redis.connection import connect
    from batchgen.jobs.redis.keys import Keys
    from batchgen.jobs.schema.errors import BatchgenError

    config = json.loads(sys.stdin.read())
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s finalizer %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )  # fmt: skip
    try:
        conn = connect(config["redis_url"], retries=5, wait_s=30)
    except BatchgenError as exc:
        logging.error("%s", exc)
        return 3
    ran = run_pending(conn, Keys(config["prefix"]), config["tag"])
    if ran:
        logging.info("ran %d finalize task(s)", ran)
    return 0


if __name__ == "__main__":
    sys.exit(main())
