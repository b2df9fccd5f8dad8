"""A running job looks alive before any of its rows commits: `batchgen status` says
``running`` as soon as a worker holds its requests, counts output tokens as they are
generated (the workers' heartbeats carry them) with a tok/s over the last minute, and
once the job ends its counts are its rows' exactly (nothing counted twice at a commit).
The dashboard's chart and workers table come from the same live rates, so rows that
commit in a burst are no spike. A real worker on a toy checkpoint, paced so that a row
takes many seconds."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from batchgen.jobs.redis.keys import Keys
from batchgen.serve.series import RateSampler
from tests.cli_session import Shell, rows, shells, wait_for, write_jsonl
from tests.hooks import hook_env

ROWS, MAX_TOKENS = 4, 300  # at >= 50 ms a step, a row takes >= 15 s: heartbeats come every 5 s


@pytest.fixture
def shell(tmp_path: Path, toy_model, private_redis) -> Iterator[Shell]:
    (tmp_path / "tiny").symlink_to(toy_model("llama"))
    yield from shells(tmp_path, tmp_path / "home", private_redis.url)


def test_status_is_live_before_any_row_commits(shell):
    write_jsonl(shell.cwd / "long.jsonl",
                [{"prompt": f"tell me about {i}", "max_tokens": MAX_TOKENS, "ignore_eos": True}
                 for i in range(ROWS)])  # fmt: skip
    shell.ok("submit", "long.jsonl", "--model", "tiny", "--job-id", "long",
             "--output", str(shell.cwd / "out"))  # fmt: skip
    before = shell.status("long")
    assert (before["state"], before["completion_tokens"], before["tokens_per_s"]) == (
        "queued", 0, 0.0)  # fmt: skip
    shell.start("worker", "--model", "tiny", "--device", "cpu", "--max-num-seqs", str(ROWS),
                extra_env=hook_env(step_s=0.05))  # fmt: skip

    # running once a worker holds its requests, whatever has committed
    running = wait_for(lambda: (s := shell.status("long"))["in_flight"] == ROWS and s, "dispatch")
    assert running["state"] == "running"

    live = wait_for(lambda: (s := shell.status("long"))["completion_tokens"] > 0 and s,
                    "live tokens")  # fmt: skip
    assert live["done"] + live["failed"] == 0, live  # no row made yet, let alone committed
    assert live["state"] == "running" and live["in_flight"] == ROWS
    assert 0 < live["completion_tokens"] < ROWS * MAX_TOKENS
    assert live["prompt_tokens"] > 0 and live["tokens_per_s"] > 0
    text = shell.ok("status", "long")
    assert "state      running\n" in text
    out = int(text.split("tokens     in ")[1].split("out ")[1].split(",")[0])
    assert out > 0
    assert "eta        - (no row finished yet)\n" in text

    # the dashboard's chart is the workers' live rates, not the committed tokens
    conn: Any = redis.Redis.from_url(shell.env["BATCHGEN_REDIS_URL"])
    point = RateSampler(conn, Keys("bg"), interval_s=0.001).sample()
    assert point is not None and point["jobs"]["long"] > 0
    assert point["fleet"] == sum(point["workers"].values()) > 0

    done = wait_for(lambda: (s := shell.status("long"))["state"] == "completed" and s,
                    "the job", timeout=300)  # fmt: skip
    made = rows(shell.cwd / "out" / "result.parquet")
    assert made["completion_tokens"] == [MAX_TOKENS] * ROWS
    assert done["completion_tokens"] == ROWS * MAX_TOKENS  # the rows' own: none twice
    assert done["prompt_tokens"] == sum(made["prompt_tokens"])


def test_a_burst_of_commits_is_no_spike_in_the_chart(redis_url):
    """Heartbeats say the rate; a job whose 600 rows commit at once adds nothing to it."""
    conn: Any = redis.Redis.from_url(redis_url)
    keys = Keys("bg")
    beat = {"name": "w1", "tag": "t", "in_flight": {"j": 640},
            "progress": {"j": {"tokens_per_s": 115.0, "rows_per_s": 0.0,
                               "prompt_tokens": 64000, "completion_tokens": 9000}}}  # fmt: skip
    conn.set("bg:worker:w1", json.dumps(beat), ex=60)
    conn.zadd("bg:workers", {"w1": time.time()})
    sampler = RateSampler(conn, keys, interval_s=5.0)
    assert sampler.sample(now=100.0) == {
        "t": 100.0, "fleet": 115.0, "jobs": {"j": 115.0}, "workers": {"w1": 115.0}}  # fmt: skip
