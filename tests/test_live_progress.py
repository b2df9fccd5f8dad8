"""A running job looks alive before any of its rows commits: `batchgen status` says
``running`` as soon as a worker holds its requests, counts output tokens as they are
generated (the workers' heartbeats carry them) with a tok/s over the last minute, and
once the job ends its counts are its rows' exactly (nothing counted twice at a commit).
A real worker on a toy checkpoint, paced so that a row takes many seconds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

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

    done = wait_for(lambda: (s := shell.status("long"))["state"] == "completed" and s,
                    "the job", timeout=300)  # fmt: skip
    made = rows(shell.cwd / "out" / "result.parquet")
    assert made["completion_tokens"] == [MAX_TOKENS] * ROWS
    assert done["completion_tokens"] == ROWS * MAX_TOKENS  # the rows' own: none twice
    assert done["prompt_tokens"] == sum(made["prompt_tokens"])
