"""What every fault test needs once: worker processes, waiting, the final Parquet, checks.

Everything here is real: a redis-server process, ``python -m batchgen`` and
``python -m batchgen.worker.loop`` subprocesses (the engine processes a
``batchgen worker`` supervisor starts), kill -9 with ``os.kill``. Waits poll an
observable condition against a deadline; nothing sleeps a fixed time to "let
things happen".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import redis

from batchgen.jobs.ops.finalize import finalize_tasks as tasks
from batchgen.jobs.ops.job_record import JobRecord, load_job
from batchgen.jobs.redis.keys import GROUP, Keys, QueueKeys
from batchgen.jobs.redis.redis_server import RedisServer
from batchgen.worker.engine_config import EngineConfig
from batchgen.worker.loop.loop_config import LoopConfig
from tests.chaos.reference import Reference
from tests.hooks import hook_env
from tests.hooks.sitecustomize import POISON_ENV, STEP_ENV

KEYS = Keys("bg")
OK_REASONS = ("stop", "length")

# Short timings so faults play out in seconds: an entry idle 1 s belongs to a
# dead worker; heartbeats, sweeps and flushes run several times a second.
FAST = {
    "claim_timeout_s": 1.0,
    "heartbeat_s": 0.3,
    "block_ms": 200,
    "flush_interval_s": 0.2,
    "sweep_interval_s": 0.5,
    "cancel_poll_s": 0.5,
    "drain_timeout_s": 10.0,
}


def rconn(url: str) -> Any:
    """A client typed loosely: redis-py's reply unions make tests unreadable."""
    return redis.Redis.from_url(url, socket_timeout=10)


def prompt_lines(n: int, tag: str = "p", max_tokens: tuple[int, int] = (4, 16)) -> list[dict]:
    """``n`` native lines with ids, varied prompts and max_tokens in the given range."""
    lo, hi = max_tokens
    return [
        {
            "id": f"{tag}{i}",
            "prompt": f"Request {i} of {tag}: the sea, item {i * 7 % 13}, colour {i % 5}.",
            "max_tokens": lo + (i * 5) % (hi - lo + 1),
        }
        for i in range(n)
    ]


def write_jsonl(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def wait_until(
    predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05
) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(interval)


def process_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` (R, S, T = stopped, Z, ...); "" if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[0]


@dataclass
class Proc:
    """A subprocess started by a test, with its output in a log file."""

    name: str
    popen: subprocess.Popen
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} still running after {timeout}s; log:\n{self.tail()}"
            ) from None

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


@dataclass
class Chaos:
    """One fault test's world: a Redis URL, a toy model, a temp dir, its processes."""

    redis_url: str
    model: Path
    tmp: Path
    server: RedisServer | None = None  # when the test owns the server (to kill it)
    procs: list[Proc] = field(default_factory=list)

    # -- Redis -------------------------------------------------------------------

    @property
    def conn(self) -> Any:
        return rconn(self.redis_url)

    @property
    def qk(self) -> QueueKeys:
        return KEYS.queue_for_model(str(self.model))

    def record(self, job_id: str) -> JobRecord:
        return load_job(self.conn, KEYS, job_id)

    def pending(self, consumer: str | None = None) -> int:
        """Entries delivered and not acked (of one consumer, or all)."""
        conn = self.conn
        try:
            if consumer is None:
                return int(conn.xpending(self.qk.stream, GROUP)["pending"])
            return len(conn.xpending_range(self.qk.stream, GROUP, "-", "+", 10_000, consumer))
        except redis.ResponseError:  # no stream or group yet
            return 0

    def heartbeat(self, name: str) -> dict[str, Any] | None:
        raw = self.conn.get(KEYS.worker(name))
        return json.loads(raw) if raw else None

    # -- processes ---------------------------------------------------------------

    def env(self, **extra: str) -> dict[str, str]:
        env = {**os.environ, "BATCHGEN_REDIS_URL": self.redis_url,
               "BATCHGEN_HOME": str(self.tmp / "home"), "OMP_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1"}  # fmt: skip
        for name in ("BATCHGEN_TEST_CRASH_AT", POISON_ENV, STEP_ENV, "BATCHGEN_PREFIX"):
            env.pop(name, None)
        env.update(extra)
        return env

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str], stdin: bytes = b"") -> Proc:
        log = self.tmp / f"{name}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.PIPE, start_new_session=True)  # fmt: skip
        assert popen.stdin is not None
        with contextlib.suppress(BrokenPipeError), popen.stdin as pipe:
            pipe.write(stdin)
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def loop_worker(
        self, name: str, *, crash_at: str | None = None, poison: dict[str, str] | None = None,
        step_s: float | None = None, **config: Any,
    ) -> Proc:  # fmt: skip
        """One engine process, ``python -m batchgen.worker.loop`` (what a supervisor starts)."""
        settings = {**FAST, "device": "cpu", **config}
        engine_names = {f.name for f in dataclasses.fields(EngineConfig)}
        engine = EngineConfig(**{k: v for k, v in settings.items() if k in engine_names})
        loop = {k: v for k, v in settings.items() if k not in engine_names}
        cfg = LoopConfig(
            model=str(self.model), name=name, redis_url=self.redis_url, engine=engine, **loop
        )
        extra = {"BATCHGEN_TEST_CRASH_AT": crash_at} if crash_at else {}
        extra |= hook_env(poison=poison, step_s=step_s)
        cmd = [sys.executable, "-m", "batchgen.worker.loop"]  # its config on stdin
        return self._spawn(name, cmd, self.env(**extra), stdin=json.dumps(cfg.to_dict()).encode())

    def worker_cli(
        self, name: str, *args: str, env: dict[str, str] | None = None, step_s: float | None = None
    ) -> Proc:
        """``batchgen worker --model M --device cpu ARGS`` (the supervisor and its children),
        its engine steps paced to ``step_s`` at least if given."""
        cmd = [sys.executable, "-m", "batchgen", "worker", "--model", str(self.model),
               "--device", "cpu", *args]  # fmt: skip
        return self._spawn(name, cmd, {**(env or self.env()), **hook_env(step_s=step_s)})

    def cli(self, *args: str, env: dict[str, str] | None = None, timeout: float = 120):
        """Run ``batchgen ARGS`` to completion; the CompletedProcess (text)."""
        return subprocess.run([sys.executable, "-m", "batchgen", *args], env=env or self.env(),
                              capture_output=True, text=True, timeout=timeout)  # fmt: skip

    def finalizer(self, name: str, env: dict[str, str] | None = None) -> Proc:
        """The finalizer process a supervisor starts when its model's finalize tasks wait."""
        config = {"redis_url": self.redis_url, "prefix": KEYS.prefix, "tag": self.qk.tag}
        cmd = [sys.executable, "-m", "batchgen.worker.supervisor.finalizer"]
        return self._spawn(name, cmd, env or self.env(), stdin=json.dumps(config).encode())

    def cli_start(self, name: str, *args: str, env: dict[str, str] | None = None) -> Proc:
        return self._spawn(name, [sys.executable, "-m", "batchgen", *args], env or self.env())

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.popen.wait()
            else:
                proc.popen.wait()

    # -- jobs --------------------------------------------------------------------

    def output(self, job_id: str) -> Path:
        return self.tmp / f"out-{job_id}"

    def submit(self, job_id: str, lines: list[dict], *flags: str) -> Path:
        """``batchgen submit`` the lines as job ``job_id``; its output dir."""
        src = write_jsonl(self.tmp / f"{job_id}.jsonl", lines)
        out = self.cli("submit", str(src), "--model", str(self.model), "--job-id", job_id,
                       "--output", str(self.output(job_id)), *flags)  # fmt: skip
        assert out.returncode == 0, out.stderr
        return self.output(job_id)

    def finalized(self, job_id: str, timeout: float = 60) -> str:
        """Run its finalize here once the worker that completed it has queued it (the
        state moves a moment before); the job's final state."""
        wait_until(lambda: self.finalize() or self.record(job_id).state.terminal, timeout,
                   f"{job_id}'s finalize task")  # fmt: skip
        return self.record(job_id).state.value

    def finalize(self) -> int:
        """Run the queued finalize tasks here (rq, JSON serializer), as a supervisor would."""
        return tasks.run_pending(self.conn, KEYS, self.qk.tag)

    def result(self, job_id: str) -> dict[str, list]:
        """The final Parquet as ``batchgen download`` serves it, as columns."""
        dest = self.tmp / f"{job_id}.parquet"
        out = self.cli("download", job_id, "-o", str(dest))
        assert out.returncode == 0, out.stderr
        return pq.read_table(dest).to_pydict()


def assert_exactly_once(
    rows: dict[str, list], lines: list[dict], reference: Reference,
    errors: dict[int, str] | None = None,
) -> None:  # fmt: skip
    """One row per line, in input order, with the submitted ids; every row not in
    ``errors`` (index -> start of its error message) equals the fault-free run.

    A lost row (its entry was deleted before anyone read it) has no id: the request
    went with the entry; its index still says which line it was."""
    errors = errors or {}
    ties = []
    n = len(lines)
    assert rows["index"] == list(range(n))
    lost = {i for i, message in errors.items() if message.startswith("lost:")}
    assert rows["id"] == [None if i in lost else line.get("id") for i, line in enumerate(lines)]
    for i in range(n):
        if i in errors:
            assert rows["finish_reason"][i] == "error", (i, rows["finish_reason"][i])
            assert (rows["error"][i] or "").startswith(errors[i]), (i, rows["error"][i])
            continue
        got = (rows["finish_reason"][i], rows["error"][i], rows["token_ids"][i], rows["text"][i])
        assert got[0] in OK_REASONS and got[1] is None, (i, got)
        if got[2] != reference.token_ids[i]:
            forced = reference.through_tie(i, got[2])
            assert forced is not None, f"row {i}: tokens differ from the fault-free run"
            assert (got[2], got[3]) == forced, f"row {i}: not the fault-free run past its near tie"
            ties.append(i)
            continue
        assert got[3] == reference.texts[i], f"row {i}: text differs from the fault-free run"
    assert len(ties) <= 2, f"near ties decided the other way in rows {ties}"


def assert_nothing_left(chaos: Chaos, job_id: str, output: Path | None = None) -> None:
    """Counters add up, the stream, its PEL and the job's backlog are empty, the output
    holds only final files."""
    record = chaos.record(job_id)
    assert record.state.value == "completed", record.state
    assert record.done + record.failed == record.total
    conn = chaos.conn
    assert conn.xlen(chaos.qk.stream) == 0
    assert chaos.pending() == 0
    assert record.backlog == 0 and not conn.sismember(chaos.qk.ready, job_id)
    if output is not None:
        assert sorted(os.listdir(output)) == [
            "batchgen-job.json",
            "manifest.json",
            "result.parquet",
        ]


def iter_parts(output: Path, job_id: str) -> Iterator[Path]:
    """The files in the job's parts folder (temp files of unfinished writes included)."""
    parts = output / "parts" / job_id
    return iter(sorted(parts.iterdir())) if parts.is_dir() else iter(())
