"""How long a finalizer takes to stop on SIGTERM while a task runs, with rq's own signal
handlers and with FinalizeRunner's (none: SIGTERM ends the process), and how long an
idle burst run lasts with rq's command channel and without it (FinalizeRunner.subscribe),
and when a task that fails once runs again under rq's ``Retry`` (interval 2 s) in a burst
run, without and with rq's scheduler in it.

``python -m benchmarks.rq_stop_bench``: a private redis-server, one rq task that sleeps
``--task-s`` seconds, SIGTERM one second after the task starts. docs/reliability.md
("Finalize and rq") gives the numbers.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from batchgen.jobs.redis.redis_server import find_redis_server

WORKER = textwrap.dedent("""
    import sys, time
    import redis
    from rq import Queue, SimpleWorker
    from rq.serializers import JSONSerializer

    class Quiet(SimpleWorker):
        def subscribe(self):
            pass

    class NoHandlers(Quiet):
        def _install_signal_handlers(self):
            pass

    kind, url = sys.argv[1], sys.argv[2]
    conn = redis.Redis.from_url(url)
    queue = Queue("bench", connection=conn, serializer=JSONSerializer)
    worker_class = {"rq": Quiet, "none": NoHandlers, "rq-channel": SimpleWorker,
                    "rq-scheduler": Quiet}[kind]  # fmt: skip
    worker = worker_class([queue], connection=conn, serializer=JSONSerializer)
    start = time.monotonic()
    worker.work(burst=True, logging_level="ERROR", with_scheduler=kind == "rq-scheduler")
    print(f"{time.monotonic() - start:.2f}", flush=True)
""")


def run(url: str, kind: str, task_s: float | None, cwd: Path) -> tuple[float, int]:
    """Seconds from SIGTERM to exit (or of the whole burst run when ``task_s`` is None)."""
    import redis
    from rq import Queue
    from rq.job import JobStatus
    from rq.serializers import JSONSerializer

    conn = redis.Redis.from_url(url)
    queue = Queue("bench", connection=conn, serializer=JSONSerializer)
    queue.empty()
    task = None
    if task_s is not None:
        task = queue.enqueue("time.sleep", task_s, job_timeout=-1)
    proc = subprocess.Popen([sys.executable, "-c", WORKER, kind, url], cwd=cwd,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    start = time.monotonic()
    if task is not None:
        while task.get_status() != JobStatus.STARTED:  # rq's handlers are in place by then
            time.sleep(0.05)
        time.sleep(1.0)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
    proc.wait()
    return time.monotonic() - start, proc.returncode


FLAKY = textwrap.dedent("""
    import redis

    def task(url, key):
        if redis.Redis.from_url(url).incr(key) == 1:
            raise RuntimeError("the first attempt fails")
""")


def retry(url: str, kind: str, cwd: Path, wait_s: float = 10.0) -> str:
    """What became of a task that fails once, queued with rq's Retry(max=1, interval=2),
    ``wait_s`` after a burst run of it began (the run ends when the queue is empty)."""
    import redis
    from rq import Queue, Retry
    from rq.serializers import JSONSerializer

    conn = redis.Redis.from_url(url)
    key = f"flaky-attempts-{kind}"
    (cwd / "flaky.py").write_text(FLAKY)
    queue = Queue("bench", connection=conn, serializer=JSONSerializer)
    queue.empty()
    for stale in queue.scheduled_job_registry.get_job_ids():
        queue.scheduled_job_registry.remove(stale, delete_job=True)
    task = queue.enqueue("flaky.task", url, key, retry=Retry(max=1, interval=2), job_timeout=-1)
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", WORKER, kind, url], cwd=cwd,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    proc.wait()
    ran_s = time.monotonic() - start
    time.sleep(max(0.0, wait_s - ran_s))
    attempts = int(conn.get(key) or 0)
    return (
        f"burst run ended after {ran_s:.1f} s; {wait_s:.0f} s after it began the task "
        f"is {task.get_status().value} after {attempts} attempt(s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--task-s", type=float, default=20.0)
    parser.add_argument("--idle-runs", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sock = Path(tmp) / "redis.sock"
        server = subprocess.Popen([find_redis_server(), "--port", "0", "--unixsocket", str(sock),
                                   "--save", "", "--appendonly", "no"],
                                  stdout=subprocess.DEVNULL)  # fmt: skip
        try:
            while not sock.exists():
                time.sleep(0.05)
            url = f"unix://{sock}"
            for kind in ("none", "rq"):
                took, rc = run(url, kind, args.task_s, Path(tmp))
                print(f"SIGTERM mid-task, handlers {kind!r}: exits after {took:.1f} s (rc {rc})")
            for kind in ("rq-channel", "rq"):
                runs = [run(url, kind, None, Path(tmp))[0] for _ in range(args.idle_runs)]
                print(f"idle burst run, {kind!r}: " + " ".join(f"{s:.1f}" for s in runs) + " s")
            for kind in ("rq", "rq-scheduler"):
                print(
                    f"Retry(max=1, interval=2), burst run {kind!r}: {retry(url, kind, Path(tmp))}"
                )
        finally:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
