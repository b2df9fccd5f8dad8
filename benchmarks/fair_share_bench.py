"""Head-of-line blocking and equal shares on one worker, with an engine that takes GPU-like
time: (1) seconds to the first row and to the last of a small job submitted behind a
huge one; (2) two equal jobs submitted together: their rates over each window and over
the first minute.

    .venv/bin/python -m benchmarks.fair_share_bench                       # 100k + 5 lines
    .venv/bin/python -m benchmarks.fair_share_bench --big 20000 --equal 5000 --minute 30

The engine is a stand-in that sleeps ``--step-ms`` per step and generates one token
for each of up to ``--max-num-seqs`` running requests, so the figures are the
queue's, not the CPU's: a loaded machine changes them little. One worker
(``QueueLoop``, default settings: rows commit every 2 s) in a forked process, a private
redis-server. Only APIs older than fair share are used, so the same file measures
the release before it. Prints a table, then one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from batchgen.jobs.ops.job_record import load_job
from batchgen.jobs.ops.submission import submit
from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.redis.redis_server import RedisServer
from batchgen.jobs.schema.sampling import DEFAULTS
from batchgen.worker.loop import EngineAPI, LoopConfig, QueueLoop
from benchmarks.pipeline_bench import ZeroEngine, _Out, _params

KEYS = Keys("fair")
MODEL = "fair-paced"


@dataclass
class PacedEngine(ZeroEngine):
    """Each step sleeps ``step_s`` and gives every running request one token."""

    step_s: float = 0.01
    made: dict[str, list[int]] = field(default_factory=dict)  # id -> [made, wanted]

    def add_request(
        self, request_id, prompt, params, *, resume_token_ids=None, priority=0, reasoning=None
    ):
        self.made[request_id] = [len(resume_token_ids or ()), int(params["max_tokens"])]

    def step(self) -> list[_Out]:
        time.sleep(self.step_s)
        done = []
        for rid, counts in list(self.made.items()):
            counts[0] += 1
            if counts[0] >= counts[1]:
                del self.made[rid]
                done.append(_Out(rid, [7] * counts[1]))
        return done

    def abort(self, request_id: str) -> None:
        self.made.pop(request_id, None)

    def drain(self) -> list[_Out]:
        out = [_Out(rid, [7] * made) for rid, (made, _) in self.made.items()]
        self.made.clear()
        return out

    def has_unfinished(self) -> bool:
        return bool(self.made)

    def output_token_counts(self) -> dict[str, int]:
        return {rid: made for rid, (made, _) in self.made.items()}

    def free_capacity(self) -> int:
        return self.max_num_seqs - len(self.made)


def _worker(url: str, step_s: float, seqs: int, stop: Any) -> None:
    conn = redis.Redis.from_url(url)
    config = LoopConfig(model=MODEL, name="w", prefix=KEYS.prefix, block_ms=100)
    QueueLoop(
        conn, EngineAPI(PacedEngine(max_num_seqs=seqs, step_s=step_s), _params, ()), config
    ).run(stop.is_set)


def _lines(path: Path, n: int, tag: str, max_tokens: int) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"{tag}{i}", "prompt": f"{tag} {i}",
                                "max_tokens": max_tokens}) + "\n")  # fmt: skip
    return path


def _submit(conn: redis.Redis, tmp: Path, job_id: str, n: int, max_tokens: int) -> None:
    src = _lines(tmp / f"{job_id}.jsonl", n, job_id, max_tokens)
    submit(conn, KEYS, source_path=str(src), model=MODEL, output=str(tmp / job_id),
           defaults=dict(DEFAULTS), job_id=job_id)  # fmt: skip


def _rows(conn: redis.Redis, job_id: str) -> int:
    return load_job(conn, KEYS, job_id).finished_rows


class Worker:
    def __init__(self, url: str, step_s: float, seqs: int) -> None:
        ctx = multiprocessing.get_context("fork")
        self.stop = ctx.Event()
        self.proc = ctx.Process(target=_worker, args=(url, step_s, seqs, self.stop))
        self.proc.start()

    def close(self) -> None:
        self.stop.set()
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()


def behind_a_big_job(url: str, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    conn: Any = redis.Redis.from_url(url)
    conn.flushall()
    _submit(conn, tmp, "big", args.big, args.max_tokens)
    worker = Worker(url, args.step_ms / 1000, args.max_num_seqs)
    try:
        while _rows(conn, "big") == 0:
            time.sleep(0.02)
        big_before = _rows(conn, "big")
        start = time.monotonic()
        _submit(conn, tmp, "small", args.small, args.max_tokens)
        first = last = None
        deadline = start + args.timeout
        while last is None and time.monotonic() < deadline:
            done = _rows(conn, "small")
            now = time.monotonic() - start
            if done and first is None:
                first = now
            if done == args.small:
                last = now
            time.sleep(0.02)
        big_meanwhile = _rows(conn, "big") - big_before
    finally:
        worker.close()
    return {"small_first_row_s": None if first is None else round(first, 2),
            "small_done_s": None if last is None else round(last, 2),
            "big_rows_meanwhile": big_meanwhile, "timed_out": last is None}  # fmt: skip


def equal_jobs(url: str, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    conn: Any = redis.Redis.from_url(url)
    conn.flushall()
    for job_id in ("a", "b"):
        _submit(conn, tmp, job_id, args.equal, args.max_tokens)
    worker = Worker(url, args.step_ms / 1000, args.max_num_seqs)
    samples = []
    try:
        while not (_rows(conn, "a") or _rows(conn, "b")):
            time.sleep(0.02)
        start = time.monotonic()
        while (elapsed := time.monotonic() - start) <= args.minute:
            a, b = _rows(conn, "a"), _rows(conn, "b")
            samples.append((elapsed, a, b))
            if args.equal in (a, b):
                break
            time.sleep(args.window / 10)
    finally:
        worker.close()
    windows = []
    for t0, a0, b0 in samples:
        later = [s for s in samples if s[0] >= t0 + args.window]
        if later:
            _, a1, b1 = later[0]
            windows.append((a1 - a0) / (b1 - b0) if b1 > b0 else float("inf"))
    _, a_end, b_end = samples[-1]
    _, a_start, b_start = samples[0]
    return {
        "a_rows": a_end - a_start,
        "b_rows": b_end - b_start,
        "seconds": round(samples[-1][0], 1),
        "ratio_whole": round((a_end - a_start) / (b_end - b_start), 3)
        if b_end > b_start else "inf",
        "ratio_windows_min": round(min(windows), 3) if windows else None,
        "ratio_windows_max": round(max(windows), 3) if windows and max(windows) < 1e9 else "inf",
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--big", type=int, default=100_000)
    parser.add_argument("--small", type=int, default=5)
    parser.add_argument("--equal", type=int, default=20_000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--minute", type=float, default=60.0, help="how long to watch (2)")
    parser.add_argument("--window", type=float, default=10.0, help="rate windows, s")
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="batchgen-fair-") as folder:
        tmp = Path(folder)
        server = RedisServer(tmp / "redis")
        server.start()
        try:
            hol = behind_a_big_job(server.url, tmp, args)
            equal = equal_jobs(server.url, tmp, args)
        finally:
            server.kill()
    result = {"settings": vars(args), "behind_a_big_job": hol, "equal_jobs": equal,
              "load_avg_before": load_before, "load_avg_after": os.getloadavg()}  # fmt: skip
    print(
        f"{args.small}-line job behind a {args.big}-line job, one worker "
        f"({args.max_num_seqs} seqs, {args.step_ms:g} ms a step):"
    )
    print(
        f"  first row {hol['small_first_row_s']} s, all rows {hol['small_done_s']} s, "
        f"big job's rows meanwhile {hol['big_rows_meanwhile']}"
    )
    print(f"two equal jobs of {args.equal} lines, over {equal['seconds']} s: rows "
          f"{equal['a_rows']} / {equal['b_rows']} = {equal['ratio_whole']}; "
          f"{args.window:g}-s windows {equal['ratio_windows_min']} .. "
          f"{equal['ratio_windows_max']}")  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
