"""The queue pipeline's own cost: submit throughput, the loop with a zero-cost engine,
and the share of a tiny-model job's wall time spent outside the engine.

    .venv/bin/python benchmarks/pipeline_bench.py                # all three
    .venv/bin/python benchmarks/pipeline_bench.py --skip-tiny    # no torch needed
    .venv/bin/python benchmarks/pipeline_bench.py --lines 500000 --requests 100000
    .venv/bin/python benchmarks/pipeline_bench.py --only submit --repeat 5

Prints a table and, last, one JSON object. Uses a private redis-server (AOF
everysec, as in production) in a temp dir. Targets on the 2-core dev machine:
submit >= 50k lines/s; stand-in pipeline >= 5k requests/s per worker; share of
a tiny-model job outside the engine < 5%.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from batchgen.jobs.intake.validate import SpoolDir, validate_file
from batchgen.jobs.ops.finalize import finalize_tasks as tasks
from batchgen.jobs.ops.job_record import load_job
from batchgen.jobs.ops.lifecycle import JobState
from batchgen.jobs.ops.submission import submit
from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.redis.redis_server import RedisServer
from batchgen.jobs.schema.sampling import DEFAULTS
from batchgen.worker.loop import EngineAPI, LoopConfig, QueueLoop

KEYS = Keys("bench")
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "small",
    "birds",
    "sing",
]


def write_prompts(path: Path, n: int, seed: int = 0) -> int:
    """A mixed file: native prompts (70%), native messages (20%), OpenAI chat (10%)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 30)))
            kind = i % 10
            if kind < 7:
                line: dict[str, Any] = {"id": f"row-{i}", "prompt": text, "max_tokens": 64,
                                        "temperature": 0.7, "metadata": {"n": i}}  # fmt: skip
            elif kind < 9:
                line = {"messages": [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": text}]}  # fmt: skip
            else:
                line = {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                        "body": {"model": "m", "messages": [{"role": "user", "content": text}],
                                 "max_tokens": 32}}  # fmt: skip
            f.write(json.dumps(line) + "\n")
    return path.stat().st_size


def bench_submit(conn: redis.Redis, tmp: Path, lines: int) -> dict[str, float]:
    path = tmp / "submit.jsonl"
    size = path.stat().st_size if path.exists() else write_prompts(path, lines)
    with SpoolDir() as spool_dir:
        start = time.perf_counter()
        validate_file(str(path), dict(DEFAULTS), spool_dir, procs=1)
        validate_s = time.perf_counter() - start
    start = time.perf_counter()
    result = submit(conn, KEYS, source_path=str(path), model="bench-submit", output=str(tmp / "o"),
                    defaults=dict(DEFAULTS), job_id="submit")  # fmt: skip
    total_s = time.perf_counter() - start
    assert result.total == lines
    return {
        "lines": lines,
        "mb": round(size / 1e6, 1),
        "validate_lines_per_s": round(lines / validate_s),
        "submit_lines_per_s": round(lines / total_s),
        "submit_s": round(total_s, 2),
    }


@dataclass
class _Out:
    request_id: str
    token_ids: list[int]
    text: str = "abcd"
    finish_reason: str = "length"
    num_prompt_tokens: int = 3
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    logprobs: list[dict[int, float]] | None = None
    samples: list[Any] = field(default_factory=list)
    embedding: list[float] | None = None


@dataclass
class ZeroEngine:
    """A stand-in engine that costs nothing: every request finishes at the next step."""

    max_num_seqs: int = 256
    max_model_len: int = 4096
    running: list[str] = field(default_factory=list)

    def token_text(self, token_id: int) -> str:
        return str(token_id)

    def encode(self, prompt: Any, template_kwargs: Any = None, tools: Any = None) -> list[int]:
        return [1, 2, 3]

    def decode(self, token_ids: list[int], keep_special: bool = False) -> str:
        return ""

    def add_embedding(self, request_id, prompt, dimensions=None):
        raise ValueError("the zero engine does not embed")

    def add_request(
        self, request_id, prompt, params, *, resume_token_ids=None, priority=0, reasoning=None
    ):
        self.running.append(request_id)

    def step(self) -> list[_Out]:
        done, self.running = self.running, []
        return [_Out(rid, [5, 6, 7, 8]) for rid in done]

    def abort(self, request_id: str) -> None:
        return None

    def drain(self) -> list[_Out]:
        return self.step()

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def output_token_counts(self) -> dict[str, int]:
        return dict.fromkeys(self.running, 0)

    def free_capacity(self) -> int:
        return self.max_num_seqs + self.max_num_seqs // 4 - len(self.running)

    def stats(self) -> None:
        return None


def _params(**kwargs: Any) -> dict[str, Any]:
    return kwargs


def run_job(conn: redis.Redis, api: EngineAPI, model: str, job_id: str) -> float:
    loop = QueueLoop(conn, api, LoopConfig(model=model, prefix=KEYS.prefix, block_ms=100))

    def finished() -> bool:
        return load_job(conn, KEYS, job_id).state not in (JobState.QUEUED, JobState.RUNNING)

    start = time.perf_counter()
    loop.run(until=finished)
    return time.perf_counter() - start


def bench_standin(conn: redis.Redis, tmp: Path, requests: int) -> dict[str, float]:
    path = tmp / "standin.jsonl"
    write_prompts(path, requests, seed=1)
    submit(conn, KEYS, source_path=str(path), model="bench-standin", output=str(tmp / "standin"),
           defaults=dict(DEFAULTS), job_id="standin")  # fmt: skip
    loop_s = run_job(conn, EngineAPI(ZeroEngine(), _params, ()), "bench-standin", "standin")
    start = time.perf_counter()
    tasks.run_pending(conn, KEYS, KEYS.queue_for_model("bench-standin").tag)
    finalize_s = time.perf_counter() - start
    assert load_job(conn, KEYS, "standin").state == JobState.COMPLETED
    return {
        "requests": requests,
        "pipeline_requests_per_s": round(requests / loop_s),
        "loop_s": round(loop_s, 2),
        "finalize_rows_per_s": round(requests / finalize_s),
    }


class TimedEngine:
    """Wraps the real engine and adds up the time spent inside it."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.max_model_len = engine.max_model_len
        self.inside = 0.0

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.engine, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.inside += time.perf_counter() - start

        return timed


def bench_tiny(conn: redis.Redis, tmp: Path, requests: int) -> dict[str, float]:
    import torch

    from batchgen import Engine, RequestRejected, SamplingParams
    from batchgen.toy import write_toy_checkpoint

    torch.set_num_threads(1)
    model = write_toy_checkpoint(tmp / "tiny", arch="llama", size="tiny")
    path = tmp / "tiny.jsonl"
    write_prompts(path, requests, seed=2)
    submit(conn, KEYS, source_path=str(path), model=str(model), output=str(tmp / "tiny-out"),
           defaults=dict(DEFAULTS), job_id="tiny")  # fmt: skip
    engine = TimedEngine(Engine.from_pretrained(model, device="cpu"))
    api = EngineAPI(engine, SamplingParams, (RequestRejected,))
    wall = run_job(conn, api, str(model), "tiny")
    start = time.perf_counter()
    tasks.run_pending(conn, KEYS, KEYS.queue_for_model(str(model)).tag)
    finalize_s = time.perf_counter() - start
    record = load_job(conn, KEYS, "tiny")
    return {
        "requests": requests,
        "completion_tokens": record.completion_tokens,
        "wall_s": round(wall, 2),
        "engine_s": round(engine.inside, 2),
        "outside_engine_share": round(1 - engine.inside / wall, 4),
        "finalize_s": round(finalize_s, 3),
    }


def _span(runs: list[dict[str, Any]], key: str, unit: str) -> str:
    values = sorted(run[key] for run in runs)
    if len(values) == 1:
        return f"{values[0]:,} {unit}"
    return f"{values[0]:,}-{values[-1]:,} {unit}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=200_000, help="submit benchmark size")
    parser.add_argument("--requests", type=int, default=50_000, help="stand-in pipeline size")
    parser.add_argument("--tiny-requests", type=int, default=200, help="tiny-model job size")
    parser.add_argument("--skip-tiny", action="store_true", help="skip the real-engine part")
    parser.add_argument("--only", choices=("submit", "standin", "tiny"), help="run one part")
    parser.add_argument(
        "--repeat", type=int, default=1, help="submit runs, each into an empty Redis: the range"
    )
    args = parser.parse_args()
    parts = (
        {args.only}
        if args.only
        else {"submit", "standin"} | (set() if args.skip_tiny else {"tiny"})
    )
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="batchgen-bench-") as tmpdir:
        tmp = Path(tmpdir)
        server = RedisServer(tmp / "redis")
        server.start()
        try:
            conn = redis.Redis.from_url(server.url, socket_timeout=60)
            if "submit" in parts:
                runs = []
                for _ in range(args.repeat):
                    conn.flushall()  # each run into an empty Redis, as the first one
                    runs.append(bench_submit(conn, tmp, args.lines))
                best = max(runs, key=lambda run: run["submit_lines_per_s"])
                results["submit"] = {**best, "runs": runs}
            if "standin" in parts:
                results["standin"] = bench_standin(conn, tmp, args.requests)
            if "tiny" in parts:
                results["tiny"] = bench_tiny(conn, tmp, args.tiny_requests)
        finally:
            server.kill()
    rows = []
    if "submit" in results:
        runs = results["submit"]["runs"]
        rows += [
            ("submit (validate + enqueue)", _span(runs, "submit_lines_per_s", "lines/s"),
             ">= 50,000 lines/s"),
            ("  validate only, one process", _span(runs, "validate_lines_per_s", "lines/s"), ""),
        ]  # fmt: skip
    if "standin" in results:
        rows += [
            ("stand-in pipeline, 1 worker",
             f"{results['standin']['pipeline_requests_per_s']:,} req/s", ">= 5,000 req/s"),
            ("finalize", f"{results['standin']['finalize_rows_per_s']:,} rows/s", ""),
        ]  # fmt: skip
    if "tiny" in results:
        share = results["tiny"]["outside_engine_share"]
        rows.append(("tiny model: time outside engine", f"{share:.1%}", "< 5%"))
    for name, value, target in rows:
        print(f"{name:<34} {value:>18}   {target}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
