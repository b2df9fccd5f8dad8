"""Soak: a seeded, replayable storm of faults over three jobs at once; nothing lost,
nothing twice, nothing left behind.

    .venv/bin/python benchmarks/soak.py                          # seeds 1-3, 300 requests a job
    .venv/bin/python benchmarks/soak.py --seeds 7 --requests 100  # replay one seed

Three jobs go to one ``batchgen worker --workers N`` supervisor on a toy model,
against a private redis-server with AOF everysec: one plain, one cancelled
midway, one whose output directory is broken for ``broken_for_s`` (a file
where its parts folder goes). Meanwhile, at points drawn from the seed and
reached by progress (not by the clock: a slow machine sees the same story),
serving engine processes are SIGKILLed, redis-server is SIGKILLed once and
restarted on its AOF, and one finalize is killed mid-run (it freezes at a crash
point and is SIGKILLed). Afterwards: each completed job holds exactly one row
per line, tokens equal to a fault-free run, no error rows; the cancelled job
did no work after its cancel beyond the step each worker was in; no output
holds a file its manifest does not list; nothing is pending; and after
``batchgen delete`` no Redis key or value mentions any of the jobs. Prints a
table and one JSON object per seed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: its sibling modules are benchmarks.*
    sys.path.insert(0, str(REPO))

from batchgen.jobs.redis.redis_server import RedisServer  # noqa: E402
from benchmarks.soak_chaos import JOBS, Storm  # noqa: E402
from benchmarks.soak_checks import check_world  # noqa: E402


@dataclass(slots=True)
class SoakConfig:
    seed: int = 1
    requests: int = 300  # per job
    workers: int = 3
    max_tokens: tuple[int, int] = (16, 48)
    # a few requests of the job to cancel run this long, so that it cannot be done before
    # the storm cancels it, however fast the machine (its other rows take a blink)
    long_requests: int = 3
    long_tokens: int = 1500
    max_num_seqs: int = 16
    claim_timeout_s: float = 2.0
    max_attempts: int = 20  # kills must never dead-letter an innocent request
    kill_gap: tuple[float, float] = (0.04, 0.10)  # share of all rows between two kills
    kill_until: float = 0.9  # no kills once this share of all rows is in
    # ... and one anyway once this long passed without one: rows are committed in bursts
    # (three jobs share the workers), which can leap over several gaps at once
    kill_every_s: float = 4.0
    broken_for_s: float = 15.0
    timeout_s: float = 900.0


@dataclass(slots=True)
class SoakResult:
    seed: int
    requests: int  # per job
    kills: int = 0  # engine processes SIGKILLed
    restarts: int = 0  # engine processes the supervisor started again
    redis_restarts: int = 0
    finalize_kills: int = 0
    broken_s: float = 0.0  # how long the broken job's output failed
    rows: int = 0
    error_rows: int = 0
    lost: int = 0
    duplicated: int = 0
    cancelled_at: int = 0  # rows the cancelled job had when the cancel landed
    late_cancelled_rows: int = 0  # rows of the cancelled job made after its cancel
    orphan_files: int = 0
    pending_at_end: int = 0
    keys_left: int = 0  # Redis keys or values mentioning a job after delete
    wall_s: float = 0.0
    ok: bool = False
    problems: list[str] = field(default_factory=list)


def job_lines(config: SoakConfig) -> dict[str, list[dict[str, Any]]]:
    rng = random.Random(config.seed)
    lo, hi = config.max_tokens
    words = ["sea", "storm", "harbour", "lighthouse", "gull", "tide", "reef", "anchor", "sail"]
    lines = {
        job: [
            {
                "id": f"{job}-{i}",
                "max_tokens": rng.randint(lo, hi),
                "prompt": f"{job} {i}: {rng.choice(words)} and {rng.choice(words)}.",
            }
            for i in range(config.requests)
        ]
        for job in JOBS
    }
    for i in rng.sample(range(config.requests), config.long_requests):
        lines["cancelled"][i]["max_tokens"] = config.long_tokens
    return lines


def run_soak(config: SoakConfig, model: Path, workdir: Path, reference: Any = None) -> SoakResult:
    """Run one seed. ``reference(lines)``, if given, returns fault-free token ids."""
    result = SoakResult(config.seed, config.requests)
    server = RedisServer(workdir / "redis")
    server.start()
    env = {**os.environ, "BATCHGEN_REDIS_URL": server.url, "BATCHGEN_HOME": str(workdir / "home"),
           "PYTHONUNBUFFERED": "1", "BATCHGEN_FINALIZE_LEASE_S": "2",
           # the first finalize of all freezes before marking its job: the storm kills it
           "BATCHGEN_TEST_CRASH_AT": "before_finalize_commit:1:stop",
           "BATCHGEN_TEST_CRASH_ONCE": str(workdir / "finalize-crashed")}  # fmt: skip
    for name in ("BATCHGEN_CHAOS_POISON", "BATCHGEN_PREFIX", "OMP_NUM_THREADS"):
        env.pop(name, None)
    cli = [sys.executable, "-m", "batchgen"]
    lines = job_lines(config)
    outputs = {job: workdir / f"out-{job}" for job in JOBS}
    supervisor = storm = None
    start = time.monotonic()
    try:
        for job in JOBS:
            src = workdir / f"{job}.jsonl"
            src.write_text("".join(json.dumps(line) + "\n" for line in lines[job]))
            subprocess.run([*cli, "submit", str(src), "--model", str(model), "--job-id", job,
                            "--output", str(outputs[job])], env=env, check=True,
                           capture_output=True)  # fmt: skip
        (outputs["broken"] / "parts").write_text("not a directory: every part write fails")
        log = workdir / "worker.log"
        with open(log, "wb") as sink:
            supervisor = subprocess.Popen(
                [*cli, "worker", "--model", str(model), "--device", "cpu",
                 "--workers", str(config.workers), "--max-num-seqs", str(config.max_num_seqs),
                 "--claim-timeout", str(config.claim_timeout_s),
                 "--max-attempts", str(config.max_attempts)],
                env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        storm = Storm(config, server, supervisor.pid, model, outputs, cli, env)
        storm.run_until_done()
        result.wall_s = round(time.monotonic() - start, 1)
        supervisor.send_signal(signal.SIGTERM)
        supervisor.wait(timeout=120)
        storm.report(result, log.read_text(errors="replace"))
        conn: Any = redis.Redis.from_url(server.url)
        check_world(result, conn, lines, outputs, storm.qk, storm.cancel, reference, cli, env)
    except Exception as exc:  # a problem of the run itself: reported, not raised
        result.problems.append(f"{type(exc).__name__}: {exc}")
    finally:
        if supervisor is not None and supervisor.poll() is None:
            os.killpg(supervisor.pid, signal.SIGKILL)
            supervisor.wait()
        server.kill()
    result.ok = not result.problems
    return result


def fault_free(model: Path) -> Any:
    """``lines -> token ids`` of ``Engine.generate`` on the same lines, no fault at all
    (one thread, as the workers run)."""
    import torch

    from batchgen import Engine, SamplingParams

    torch.set_num_threads(1)
    engine = Engine.from_pretrained(model, device="cpu")

    def run(lines: list[dict[str, Any]]) -> list[list[int]]:
        params = [SamplingParams(max_tokens=line["max_tokens"]) for line in lines]
        return [list(o.token_ids) for o in engine.generate([ln["prompt"] for ln in lines], params)]

    return run


def table(results: list[SoakResult]) -> str:
    names = ["seed", "requests", "kills", "restarts", "redis_restarts", "finalize_kills",
             "broken_s", "rows", "error_rows", "lost", "duplicated", "cancelled_at",
             "late_cancelled_rows",
             "orphan_files", "pending_at_end", "keys_left", "wall_s"]  # fmt: skip
    rows = [asdict(r) for r in results]
    widths = [max(len(n), *(len(str(r[n])) for r in rows)) for n in names]
    out = ["  ".join(n.rjust(w) for n, w in zip(names, widths))]
    out += ["  ".join(str(r[n]).rjust(w) for n, w in zip(names, widths)) for r in rows]
    for r in results:
        out.append(f"seed {r.seed}: " + ("ok" if r.ok else "; ".join(r.problems)))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated seeds to run")
    parser.add_argument("--requests", type=int, default=300, help="per job")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--model", type=Path, default=None, help="default: a toy llama")
    parser.add_argument("--keep", type=Path, default=None,
                        help="work (and keep logs, Redis data, outputs) in this directory")  # fmt: skip
    args = parser.parse_args(argv)
    results = []
    base = args.keep or Path(tempfile.mkdtemp(prefix="batchgen-soak-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        model = args.model
        if model is None:
            from batchgen.toy import write_toy_checkpoint

            model = write_toy_checkpoint(base / "toy", arch="llama", size="tiny")
        for seed in (int(s) for s in args.seeds.split(",")):
            config = SoakConfig(seed=seed, requests=args.requests, workers=args.workers)
            workdir = base / f"seed-{seed}"
            workdir.mkdir()
            results.append(run_soak(config, model, workdir, reference=fault_free(model)))
            print(json.dumps(asdict(results[-1])), flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)
    print(table(results))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
