"""Fair share with real worker processes (a toy model on the CPU): a small job is not
stuck behind a big one, equal jobs progress at equal rates, usage adds up.

The bounds are relative where the machine's speed would decide (rows of the big job
that finished meanwhile), and wall-clock bounds have wide margins for a loaded
2-core machine.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchgen.jobs.ops.submission import submit
from batchgen.jobs.ops.usage import COUNTERS, model_usage
from batchgen.jobs.schema.sampling import DEFAULTS
from batchgen.serve.api_keys import OPEN
from batchgen.serve.dashboard import tenants
from batchgen.worker.loop.loop_config import LoopConfig
from batchgen.worker.supervisor.supervisor import Supervisor
from tests.chaos.harness import KEYS, Chaos, prompt_lines, wait_until, write_jsonl

SETTINGS = {"max_num_seqs": 4, "block_ms": 100}


@pytest.fixture
def fleet(redis_url: str, toy_model, tmp_path: Path) -> Iterator[Chaos]:
    world = Chaos(redis_url, toy_model("llama"), tmp_path)
    yield world
    world.stop_all()


def committed(fleet: Chaos, job_id: str) -> int:
    return fleet.record(job_id).finished_rows


def submit_now(fleet: Chaos, job_id: str, lines: list[dict]) -> None:
    """Submit in this process: the job exists a moment later (no CLI start-up)."""
    src = write_jsonl(fleet.tmp / f"{job_id}.jsonl", lines)
    submit(fleet.conn, KEYS, source_path=str(src), model=str(fleet.model),
           output=str(fleet.output(job_id)), defaults=dict(DEFAULTS), job_id=job_id)  # fmt: skip


def test_a_small_job_behind_a_big_one_gets_its_rows_within_seconds(fleet):
    fleet.submit("big", prompt_lines(2000, "big", max_tokens=(12, 16)))
    worker = fleet.loop_worker("w", **SETTINGS)
    wait_until(lambda: committed(fleet, "big") >= 8, 120, "the big job to be under way")
    big_before = committed(fleet, "big")
    submitted = time.monotonic()
    submit_now(fleet, "small", prompt_lines(5, "small", max_tokens=(4, 4)))
    wait_until(lambda: committed(fleet, "small") >= 1, 60, "the small job's first row")
    first_row_s = time.monotonic() - submitted
    wait_until(lambda: committed(fleet, "small") == 5, 60, "the small job's last row")
    done_s = time.monotonic() - submitted
    big_meanwhile = committed(fleet, "big") - big_before
    # it waited for what was in flight (4 at most) and shared the worker from then on,
    # not for the big job's 1992 queued requests; the rows big commits while the small
    # job's first requests are dispatched grow with the engine's speed (26 seen once)
    assert big_meanwhile <= 32, big_meanwhile
    assert first_row_s < 20 and done_s < 30, (first_row_s, done_s)
    assert fleet.record("big").state.value == "running"
    worker.kill()


def test_two_equal_jobs_submitted_together_progress_at_equal_rates(fleet):
    for job_id in ("left", "right"):
        fleet.submit(job_id, prompt_lines(160, job_id, max_tokens=(8, 8)))
    fleet.loop_worker("w", **SETTINGS)
    wait_until(lambda: any(fleet.record(j).state.value not in ("queued", "running")
                           for j in ("left", "right")), 300, "one job to finish")  # fmt: skip
    left, right = committed(fleet, "left"), committed(fleet, "right")
    assert min(left, right) >= 0.9 * max(left, right), (left, right)


def test_usage_per_job_and_per_tenant_adds_up_to_the_workers_own_counters(fleet, tmp_path):
    shared = "You are a terse assistant; answer in one word. " * 3  # prefix-cache hits
    lines = [{"id": f"u{i}", "prompt": f"{shared}Item {i}?", "max_tokens": 4 + i % 3}
             for i in range(12)]  # fmt: skip
    env = fleet.env(BATCHGEN_CACHE=str(tmp_path / "cache"))
    for job_id, tenant in (("first", "t1"), ("again", "t2")):  # "again": result-cache rows
        src = tmp_path / f"{job_id}.jsonl"
        src.write_text("".join(json.dumps(line) + "\n" for line in lines))
        out = fleet.cli("submit", str(src), "--model", str(fleet.model), "--job-id", job_id,
                        "--output", str(fleet.output(job_id)), "--tenant", tenant, "--cache",
                        env=env)  # fmt: skip
        assert out.returncode == 0, out.stderr
        if job_id == "first":
            fleet.loop_worker("w1", **SETTINGS)
            fleet.loop_worker("w2", **SETTINGS)
            wait_until(lambda: fleet.finalized("first"), 120, "the first job")
    wait_until(lambda: fleet.finalized("again") == "completed", 120, "the second job")

    def workers() -> dict[str, int]:
        beats = [fleet.heartbeat(w) or {} for w in ("w1", "w2")]
        return {k: sum(int(b.get("counters", {}).get(k, 0)) for b in beats)
                for k in ("prompt_tokens", "cached_tokens", "generation_tokens", "engine_us",
                          "rows_ok", "rows_error", "rows_cached")}  # fmt: skip

    wait_until(lambda: workers()["rows_ok"] + workers()["rows_cached"] == 24, 30,
               "the heartbeats to count every row")  # fmt: skip
    counted = workers()
    by_tenant = model_usage(fleet.conn, fleet.qk)
    first, again = fleet.record("first"), fleet.record("again")
    assert by_tenant["t1"] == {
        "requests": 12, "input_tokens": first.prompt_tokens,
        "cached_tokens": first.cached_tokens, "output_tokens": first.completion_tokens,
        "engine_us": first.engine_us, "failed_input_tokens": 0,
    }  # fmt: skip
    assert by_tenant["t2"]["input_tokens"] == again.prompt_tokens == first.prompt_tokens
    assert by_tenant["t2"]["cached_tokens"] == again.prompt_tokens  # all of it: cached rows
    assert (again.engine_us, counted["rows_cached"]) == (0, 12)
    assert 0 < first.cached_tokens < first.prompt_tokens and first.engine_us > 0
    totals = {k: sum(t[k] for t in by_tenant.values()) for k in COUNTERS}
    assert totals == {
        "requests": 24, "input_tokens": counted["prompt_tokens"],
        "cached_tokens": counted["cached_tokens"], "output_tokens": counted["generation_tokens"],
        "engine_us": counted["engine_us"], "failed_input_tokens": 0,
    }  # fmt: skip

    # the same figures where operators read them: Prometheus and the dashboard
    metrics = Supervisor(
        fleet.conn, LoopConfig(model=str(fleet.model)), [], None, tenant_metrics=True
    ).metrics()
    t1 = {"model": str(fleet.model), "tenant": "t1"}
    assert {
        s.name: s.value for f in metrics for s in f.samples if s.name.startswith("batchgen_tenant_")
        and s.labels == t1
    } == {
        "batchgen_tenant_requests_total": 12,
        "batchgen_tenant_input_tokens_total": first.prompt_tokens,
        "batchgen_tenant_cached_tokens_total": first.cached_tokens,
        "batchgen_tenant_output_tokens_total": first.completion_tokens,
        "batchgen_tenant_engine_seconds_total": first.engine_us / 1e6,
    }  # fmt: skip
    shown = {t["tenant"]: t["usage"] for t in tenants(fleet.conn, KEYS, OPEN)}
    assert shown["t1"] == {"requests": 12, "input_tokens": first.prompt_tokens,
                           "cached_input_tokens": first.cached_tokens,
                           "output_tokens": first.completion_tokens,
                           "engine_s": round(first.engine_us / 1e6, 3),
                           "failed_input_tokens": 0}  # fmt: skip
    assert shown["t2"]["cached_input_tokens"] == again.prompt_tokens
