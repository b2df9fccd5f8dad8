"""Soak: thousands of requests through CPU workers that are kill -9'ed every few
seconds, with Redis itself killed and restarted once; nothing lost, nothing twice.

    .venv/bin/python benchmarks/soak.py                          # 2,000 requests, 3 workers
    .venv/bin/python benchmarks/soak.py --requests 500 --kill-every 2

Runs ``batchgen submit`` and one ``batchgen worker --workers N --burst``
supervisor (it restarts the engine processes it loses) against a private
redis-server with AOF everysec, on a toy model (written to a temp dir unless
``--model``). A chaos thread SIGKILLs a random serving engine process every
``--kill-every`` seconds until 90% of the rows are in, and SIGKILLs redis-server
once (at 40%), restarting it on the same data dir a second later. (A kill also
comes whenever 8% more rows are in, so a fast machine sees as many kills.) Prints a
table and, last, one JSON object of figures: requests, kills, restarts, lost,
duplicated, wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import redis

from batchgen.jobs.heartbeat import live_workers
from batchgen.jobs.keys import GROUP, Keys, text
from batchgen.jobs.records import load_job
from batchgen.jobs.redis_server import RedisServer
from batchgen.jobs.result import LOST

KEYS = Keys("bg")


@dataclass(slots=True)
class SoakConfig:
    requests: int = 2000
    workers: int = 3
    kill_every_s: float = 3.0  # one engine process SIGKILLed this often,
    kill_every_share: float = 0.08  # ... and whenever this share of the rows came in,
    kill_until: float = 0.9  # ... until this share of the rows is committed
    redis_kill_at: float = 0.4  # redis-server SIGKILLed once, at this share
    redis_down_s: float = 1.0
    max_tokens: tuple[int, int] = (4, 16)
    max_num_seqs: int = 32
    claim_timeout_s: float = 2.0
    max_attempts: int = 5
    timeout_s: float = 900.0
    seed: int = 0


@dataclass(slots=True)
class SoakResult:
    requests: int
    workers: int
    kills: int = 0  # engine processes SIGKILLed
    restarts: int = 0  # engine processes the supervisor started again
    redis_restarts: int = 0
    rows: int = 0
    done: int = 0
    failed: int = 0
    lost: int = 0  # rows finalize had to fill: a request that never got a row
    duplicated: int = 0  # input lines with more than one row, ids seen twice
    dead_lettered: int = 0
    discarded_duplicates: int = 0  # rows committed a second time and dropped by the commit step
    pending_at_end: int = 0
    stream_entries_at_end: int = 0
    max_attempts_seen: int = 0
    wall_s: float = 0.0
    rows_per_s: float = 0.0
    ok: bool = False
    problems: list[str] = field(default_factory=list)


def prompt_lines(config: SoakConfig) -> list[dict[str, Any]]:
    rng = random.Random(config.seed)
    lo, hi = config.max_tokens
    return [
        {"id": f"soak-{i}", "prompt": f"Soak request {i}: {rng.choice(WORDS)} {rng.choice(WORDS)}.",
         "max_tokens": rng.randint(lo, hi)}
        for i in range(config.requests)
    ]  # fmt: skip


WORDS = ["sea", "storm", "harbour", "lighthouse", "gull", "tide", "reef", "anchor", "sail"]


def _rows_in(conn: Any, job_id: str) -> int:
    try:
        record = load_job(conn, KEYS, job_id)
    except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
        return -1
    except Exception:  # the record not there yet
        return 0
    return record.done + record.failed


def _parent_pid(pid: int) -> int:
    """The parent of a live (not zombie) process ``pid``; -1 if there is none."""
    try:
        state, ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:2]
    except (OSError, ValueError):
        return -1
    return -1 if state in ("Z", "X") else int(ppid)


class Chaos(threading.Thread):
    """Kills serving engine processes of one supervisor, and redis-server once."""

    def __init__(self, config: SoakConfig, server: RedisServer, supervisor_pid: int) -> None:
        super().__init__(daemon=True)
        self.config, self.server, self.supervisor_pid = config, server, supervisor_pid
        self.conn: Any = redis.Redis.from_url(server.url, socket_timeout=5)
        self.rng = random.Random(config.seed + 1)
        self.kills = 0
        self.redis_restarts = 0
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by the driver
            self.error = exc

    def _run(self) -> None:
        config, total = self.config, self.config.requests
        last_kill, rows_at_kill = time.monotonic(), 0
        while not self.stop.wait(0.25):
            rows = _rows_in(self.conn, "soak")
            if rows < 0:
                continue  # Redis is down (our own doing) or busy loading
            if not self.redis_restarts and rows >= config.redis_kill_at * total:
                self.server.kill()
                time.sleep(config.redis_down_s)  # the outage
                self.server.start()
                self.redis_restarts += 1
                continue
            due = time.monotonic() - last_kill >= config.kill_every_s
            due = due or rows - rows_at_kill >= config.kill_every_share * total  # fast machines
            if due and rows < config.kill_until * total and self._kill_one():
                last_kill, rows_at_kill = time.monotonic(), rows

    def _kill_one(self) -> bool:
        """SIGKILL one serving engine process of our supervisor; whether one was."""
        try:
            workers = live_workers(self.conn, KEYS)
        except (redis.ConnectionError, redis.TimeoutError):
            return False
        pids = [int(w["pid"]) for w in workers if w.get("pid")]
        pids = [p for p in pids if _parent_pid(p) == self.supervisor_pid]  # alive, ours
        if not pids:
            return False
        try:
            os.kill(self.rng.choice(pids), signal.SIGKILL)
        except ProcessLookupError:
            return False
        self.kills += 1
        return True


def run_soak(
    config: SoakConfig, model: Path, workdir: Path, reference: Any = None
) -> tuple[SoakResult, dict[str, list]]:
    """Run it; (figures, the final rows as columns). ``reference(lines)``, if given,
    returns the fault-free token ids to compare every ok row with."""
    server = RedisServer(workdir / "redis")
    server.start()
    env = {**os.environ, "BATCHGEN_REDIS_URL": server.url, "BATCHGEN_HOME": str(workdir / "home"),
           "PYTHONUNBUFFERED": "1"}  # fmt: skip
    for name in ("BATCHGEN_TEST_CRASH_AT", "BATCHGEN_CHAOS_POISON", "BATCHGEN_PREFIX",
                 "OMP_NUM_THREADS"):  # fmt: skip
        env.pop(name, None)
    cli = [sys.executable, "-m", "batchgen"]
    lines = prompt_lines(config)
    src = workdir / "soak.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out_dir = workdir / "out"
    result = SoakResult(config.requests, config.workers)
    log = workdir / "worker.log"
    supervisor = None
    chaos = None
    try:
        start = time.monotonic()
        subprocess.run([*cli, "submit", str(src), "--model", str(model), "--job-id", "soak",
                        "--output", str(out_dir)], env=env, check=True, capture_output=True)  # fmt: skip
        with open(log, "wb") as sink:
            supervisor = subprocess.Popen(
                [*cli, "worker", "--model", str(model), "--device", "cpu", "--burst",
                 "--workers", str(config.workers), "--max-num-seqs", str(config.max_num_seqs),
                 "--claim-timeout", str(config.claim_timeout_s),
                 "--max-attempts", str(config.max_attempts)],
                env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        chaos = Chaos(config, server, supervisor.pid)
        chaos.start()
        try:
            code = supervisor.wait(timeout=config.timeout_s)
        except subprocess.TimeoutExpired:
            code = None
            result.problems.append(f"the worker did not finish in {config.timeout_s}s")
        chaos.stop.set()
        chaos.join()
        result.wall_s = round(time.monotonic() - start, 1)
        if chaos.error is not None:
            result.problems.append(f"chaos thread failed: {chaos.error!r}")
        if code not in (0, None):
            result.problems.append(f"the worker exited with {code}")
        result.kills, result.redis_restarts = chaos.kills, chaos.redis_restarts
        worker_log = log.read_text(errors="replace")
        result.restarts = len(re.findall(r"worker \d+ exited with .*; restarting", worker_log))
        rows = _collect(result, server, out_dir, lines, reference)
    finally:
        if chaos is not None:
            chaos.stop.set()
        if supervisor is not None and supervisor.poll() is None:
            os.killpg(supervisor.pid, signal.SIGKILL)
            supervisor.wait()
        server.kill()
    result.ok = not result.problems
    return result, rows


def _collect(
    result: SoakResult, server: RedisServer, out_dir: Path, lines: list[dict], reference: Any
) -> dict[str, list]:
    conn: Any = redis.Redis.from_url(server.url)
    record = load_job(conn, KEYS, "soak")
    result.done, result.failed = record.done, record.failed
    qk = KEYS.queue(record.tag)
    result.stream_entries_at_end = int(conn.xlen(qk.stream))
    result.pending_at_end = int(conn.xpending(qk.stream, GROUP)["pending"])
    for raw in conn.hvals(qk.job("soak").parts):
        result.discarded_duplicates += len(json.loads(text(raw)).get("lost") or [])
    if record.state.value != "completed":
        result.problems.append(f"the job is {record.state.value}, not completed")
        return {}
    rows = pq.read_table(out_dir / "result.parquet").to_pydict()
    n = result.requests
    result.rows = len(rows["index"])
    ids = Counter(rows["id"])
    indices = Counter(rows["index"])
    result.duplicated = sum(c - 1 for c in ids.values() if c > 1) + sum(
        c - 1 for c in indices.values() if c > 1
    )
    errors = [e or "" for e in rows["error"]]
    result.lost = sum(e.startswith(LOST[:5]) for e in errors)
    result.dead_lettered = sum(e.startswith("dead-lettered") for e in errors)
    result.max_attempts_seen = max(rows["attempts"], default=0)
    result.rows_per_s = round(result.rows / max(result.wall_s, 1e-9), 1)
    checks = [
        (result.rows == n, f"{result.rows} rows for {n} requests"),
        (rows["index"] == list(range(n)), "rows not one per index in input order"),
        (rows["id"] == [line["id"] for line in lines], "ids differ from the submitted ones"),
        (result.done + result.failed == n, f"done {result.done} + failed {result.failed} != {n}"),
        (result.duplicated == 0, f"{result.duplicated} duplicated rows"),
        (result.lost == 0, f"{result.lost} lost rows"),
        (result.failed == result.dead_lettered, "failed rows other than dead letters"),
        (result.pending_at_end == 0, f"{result.pending_at_end} entries still pending"),
        (result.stream_entries_at_end == 0, "entries left in the stream"),
    ]
    result.problems += [message for good, message in checks if not good]
    if reference is not None:
        expected = reference(lines)
        wrong = [
            i for i, tokens in enumerate(rows["token_ids"])
            if not errors[i] and tokens != expected[i]
        ]  # fmt: skip
        if wrong:
            result.problems.append(f"{len(wrong)} rows differ from a fault-free run: {wrong[:5]}")
    return rows


def table(result: SoakResult) -> str:
    names = ["requests", "workers", "kills", "restarts", "redis_restarts", "rows", "done",
             "failed", "dead_lettered", "lost", "duplicated", "discarded_duplicates",
             "pending_at_end", "max_attempts_seen", "wall_s", "rows_per_s"]  # fmt: skip
    data = asdict(result)
    width = max(len(n) for n in names)
    out = [f"{'figure':<{width}}  value", f"{'-' * width}  -----"]
    out += [f"{name:<{width}}  {data[name]}" for name in names]
    out.append(f"{'verdict':<{width}}  " + ("ok" if result.ok else "; ".join(result.problems)))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--kill-every", type=float, default=3.0, help="seconds between kills")
    parser.add_argument("--model", type=Path, default=None, help="default: a toy llama")
    parser.add_argument("--keep", type=Path, default=None, help="keep the work dir here")
    args = parser.parse_args(argv)
    config = SoakConfig(requests=args.requests, workers=args.workers,
                        kill_every_s=args.kill_every)  # fmt: skip
    workdir = Path(tempfile.mkdtemp(prefix="batchgen-soak-")) if args.keep is None else args.keep
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        model = args.model
        if model is None:
            from batchgen.toy import write_toy_checkpoint

            model = write_toy_checkpoint(workdir / "toy", arch="llama", size="tiny")
        result, _ = run_soak(config, model, workdir)
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(table(result))
    print(json.dumps(asdict(result)))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
