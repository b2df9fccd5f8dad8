"""The serve storm: the soak's seeded faults with ``batchgen serve`` in the loop.

    .venv/bin/python benchmarks/serve_storm.py                 # seeds 1-3
    .venv/bin/python benchmarks/serve_storm.py --seeds 7        # replay one seed

One CPU worker on a toy model, a private redis-server, and a sequence of serve
processes on one files dir, each started with a crash point drawn from the seed:
frozen mid-validation (``serve_validating``) or half way through a batch's output
files (``serve_writing_outputs``), then kill -9, and the next one takes over (2 s
leases). Batches are created a few at a time; each has a fate drawn from the seed:
run plainly, have its input file deleted mid-run, be cancelled mid-run, or both.
A last server without faults finishes. Checked: every batch ends completed, failed
or cancelled with exactly one output or error line per request (its custom_ids,
each once), no batch is left open, no lease held, no temp file left. Prints one
JSON object per seed and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import openai
import redis

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: its sibling modules are benchmarks.*
    sys.path.insert(0, str(REPO))

from batchgen.jobs.redis.keys import Keys  # noqa: E402
from tests.serve_stack import Stack, private_stack  # noqa: E402

FATES = ("plain", "delete_input", "cancel", "delete_input+cancel")
POINTS = ("serve_validating", "serve_writing_outputs")
FINAL = ("completed", "failed", "cancelled")


@dataclass(slots=True)
class StormConfig:
    seed: int = 1
    batches: int = 6
    requests: tuple[int, int] = (4, 12)  # per batch
    max_tokens: tuple[int, int] = (8, 32)
    kills: int = 4  # servers killed at crash points (half of each kind, order from the seed)
    epoch_s: float = 60.0  # a server's crash point not reached by then: it is stopped anyway
    timeout_s: float = 600.0


@dataclass(slots=True)
class StormResult:
    seed: int
    batches: int = 0
    requests: int = 0
    killed_validating: int = 0
    killed_writing: int = 0
    not_reached: int = 0  # crash points no batch reached in their server's time
    deleted_inputs: int = 0
    cancels: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    lines: int = 0  # output + error lines, all batches
    wall_s: float = 0.0
    failures: list[str] = field(default_factory=list)  # each failed batch's errors (allowed)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(slots=True)
class Planned:
    name: str
    requests: int
    max_tokens: int
    fate: str
    batch_id: str = ""
    applied: bool = False


def run_storm(config: StormConfig, model: Path, tmp: Path) -> StormResult:
    rng = random.Random(config.seed)
    result = StormResult(config.seed)
    plan = [Planned(f"b{i}", rng.randint(*config.requests), rng.randint(*config.max_tokens),
                    rng.choice(FATES)) for i in range(config.batches)]  # fmt: skip
    crashes = [POINTS[i % 2] for i in range(config.kills)]
    rng.shuffle(crashes)
    started = time.monotonic()
    try:  # without keys: one user, who sees everything
        with private_stack(tmp, model, {"BATCHGEN_API_KEYS": ""}) as stack:
            stack.worker(model, "--max-num-seqs", "4")
            for epoch, point in enumerate([*crashes, None]):
                if point is not None:
                    stack.env["BATCHGEN_TEST_CRASH_AT"] = f"{point}:1:stop"
                else:
                    stack.env.pop("BATCHGEN_TEST_CRASH_AT", None)
                stack.serve("--lease", "2", name=f"serve-{epoch}", or_frozen=True)
                froze = _epoch(stack, plan, rng, point, config, result, started, model)
                if point is not None:
                    if froze:
                        kind = "killed_validating" if point == POINTS[0] else "killed_writing"
                        setattr(result, kind, getattr(result, kind) + 1)
                    else:
                        result.not_reached += 1
                    stack.kill_server()
            _check(stack, plan, result)
    finally:
        result.wall_s = round(time.monotonic() - started, 1)
    return result


def _epoch(stack: Stack, plan: list[Planned], rng: random.Random, point: str | None,
           config: StormConfig, result: StormResult, started: float, model: Path) -> bool:  # fmt: skip
    """Drive one server until it freezes at its crash point (True), or, for the last one,
    until every batch ended; False when its point was not reached (in ``epoch_s``, or
    at once when nothing is left that could reach it)."""
    client = openai.OpenAI(base_url=stack.base + "/v1", api_key="-", max_retries=0, timeout=10)
    waiting = [p for p in plan if not p.batch_id]
    made = 0
    for p in waiting[: len(waiting) if point is None else rng.randint(1, 3)]:
        if stack.frozen():
            break
        try:
            file = client.files.create(file=("in.jsonl", _lines(p, model)), purpose="batch")
            p.batch_id = client.batches.create(input_file_id=file.id, completion_window="24h",
                                               endpoint="/v1/completions").id  # fmt: skip
            made += 1
        except (openai.APITimeoutError, openai.APIConnectionError):
            break  # frozen mid-request: the batch is made again by the next server
    deadline = time.monotonic() + (config.epoch_s if point else config.timeout_s)
    while time.monotonic() < deadline and time.monotonic() - started < config.timeout_s:
        if stack.frozen():
            return True
        try:
            states = {p.name: client.batches.retrieve(p.batch_id) for p in plan if p.batch_id}
        except (openai.APITimeoutError, openai.APIConnectionError):
            continue  # froze while answering: seen on the next turn
        for p in plan:
            batch = states.get(p.name)
            if batch is not None and not p.applied and batch.status == "in_progress":
                p.applied = True
                _apply(client, p, batch, result)
        ended = all(b.status in FINAL for b in states.values())
        if point is None and len(states) == len(plan) and ended:
            return True
        if point == POINTS[0] and not made and all(
            b.status != "validating" for b in states.values()
        ):  # fmt: skip
            return False  # nothing to validate: this server's point cannot be reached
        if point == POINTS[1] and ended:
            return False  # no output left to write
        time.sleep(0.3)
    return False


def _apply(client: openai.OpenAI, p: Planned, batch: Any, result: StormResult) -> None:
    try:
        if "delete_input" in p.fate:
            client.files.delete(batch.input_file_id)
            result.deleted_inputs += 1
        if "cancel" in p.fate:
            client.batches.cancel(batch.id)
            result.cancels += 1
    except openai.BadRequestError:
        pass  # it finished first
    except (openai.APITimeoutError, openai.APIConnectionError):
        p.applied = False  # the server froze: try again on the next one


def _lines(p: Planned, model: Path) -> bytes:
    rows = [{"custom_id": f"{p.name}-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": str(model), "prompt": f"{p.name} request {i}",
                      "max_tokens": p.max_tokens}} for i in range(p.requests)]  # fmt: skip
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _check(stack: Stack, plan: list[Planned], result: StormResult) -> None:
    client = openai.OpenAI(base_url=stack.base + "/v1", api_key="-", max_retries=0)
    problems = result.problems
    expected = {p.batch_id: p for p in plan if p.batch_id}
    if len(expected) != len(plan):
        problems.append(f"{len(plan) - len(expected)} batches were never made")
    for batch in client.batches.list(limit=100):  # those made without a reply too
        result.batches += 1
        total = batch.request_counts.total if batch.request_counts else 0
        result.requests += total
        if batch.status not in FINAL:
            problems.append(f"{batch.id} ended {batch.status}")
            continue
        setattr(result, batch.status, getattr(result, batch.status) + 1)
        if batch.status == "failed":
            errors = batch.errors.data if batch.errors and batch.errors.data else []
            result.failures.append(f"{batch.id}: " + "; ".join(
                f"{e.code}: {e.message}" for e in errors))  # fmt: skip
        got = []
        for file_id in (batch.output_file_id, batch.error_file_id):
            if file_id:
                got += [json.loads(x)["custom_id"]
                        for x in client.files.content(file_id).text.splitlines()]  # fmt: skip
        result.lines += len(got)
        if len(got) != total:
            problems.append(f"{batch.id}: {len(got)} lines for {total}")
        p = expected.get(batch.id)
        if p is not None and batch.status != "failed":
            want = sorted(f"{p.name}-{i}" for i in range(p.requests))
            if sorted(str(x) for x in got) != want:
                problems.append(f"{batch.id}: custom_ids {sorted(map(str, got))[:5]}...")
    conn: Any = redis.Redis.from_url(stack.redis_url)
    keys = Keys("bg")
    if conn.scard(keys.open_batches):
        problems.append(f"{conn.scard(keys.open_batches)} batches still open")
    if conn.keys("bg:batch:*:lock"):
        problems.append("a batch lease is still held")
    deadline = time.monotonic() + 15  # a dead server's temp files go once its lease expires
    while left := [n for n in os.listdir(stack.tmp / "files") if n.startswith(".tmp-")]:
        if time.monotonic() > deadline:
            problems.append(f"temp files left: {left}")
            break
        time.sleep(0.5)


def table(results: list[StormResult]) -> str:
    head = ("| seed | batches | requests | killed mid-validation | killed mid-output | "
            "not reached | inputs deleted | cancels | completed | cancelled | failed | lines "
            "| problems | wall |")  # fmt: skip
    rows = [head, "|" + " ---: |" * (head.count("|") - 1)]
    for r in results:
        rows.append(f"| {r.seed} | {r.batches} | {r.requests} | {r.killed_validating} | "
                    f"{r.killed_writing} | {r.not_reached} | {r.deleted_inputs} | {r.cancels} "
                    f"| {r.completed} | {r.cancelled} | {r.failed} | {r.lines} | "
                    f"{len(r.problems)} | {r.wall_s} s |")  # fmt: skip
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--keep", metavar="DIR", help="keep the logs of the last seed here")
    args = parser.parse_args()
    from batchgen.toy import write_toy_checkpoint

    results = []
    with tempfile.TemporaryDirectory() as scratch:
        model = Path(scratch) / "toy"
        write_toy_checkpoint(model, arch="llama", size="tiny")
        for seed in args.seeds:
            tmp = Path(args.keep or scratch) / f"seed-{seed}"
            tmp.mkdir(parents=True, exist_ok=True)
            result = run_storm(StormConfig(seed=seed), model, tmp)
            print(json.dumps(asdict(result)), flush=True)
            results.append(result)
    print(table(results))
    sys.exit(0 if all(r.ok for r in results) else 1)


if __name__ == "__main__":
    main()
