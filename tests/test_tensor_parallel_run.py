"""``batchgen run --device cpu --tensor-parallel-size 2``: one rank's rows, and a size that
cannot work refused in one line before anything is queued."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from tests.cli_session import Shell, rows, write_jsonl

LINES = [
    {"id": "greedy", "prompt": "hello there", "max_tokens": 6},
    {"id": "seeded", "prompt": "question 2", "max_tokens": 6, "temperature": 1.0, "seed": 3},
    {"id": "two", "prompt": "question 3", "max_tokens": 4, "temperature": 0.8, "seed": 4, "n": 2},
]
SAME = ["index", "id", "text", "token_ids", "finish_reason", "prompt_tokens",
        "completion_tokens", "choices"]  # fmt: skip


def _run(shell: Shell, tmp_path: Path, name: str, *flags: str):
    return shell.run("run", "p.jsonl", "--model", "tiny", "-o", f"{name}.parquet", "--device",
                     "cpu", "--job-output", str(tmp_path / name), *flags)  # fmt: skip


def test_two_ranks_write_one_ranks_rows(tmp_path, toy_model, redis_url):
    (tmp_path / "tiny").symlink_to(toy_model("llama"))
    write_jsonl(tmp_path / "p.jsonl", LINES)
    shell = Shell(tmp_path, tmp_path / "home", redis_url)
    one = _run(shell, tmp_path, "one")
    assert one.returncode == 0, one.stderr[-3000:]
    two = _run(shell, tmp_path, "two", "--tensor-parallel-size", "2")
    assert two.returncode == 0, two.stderr[-3000:]
    assert "rank 1 ERROR" not in two.stderr  # closed at the end, not cut off
    expected, got = rows(tmp_path / "one.parquet"), rows(tmp_path / "two.parquet")
    assert {k: got[k] for k in SAME} == {k: expected[k] for k in SAME}
    assert got["finish_reason"] == ["length"] * 3 and len(got["choices"][2]) == 2


@pytest.mark.parametrize(
    ("size", "message"),
    [
        ("0", "tensor_parallel_size must be an integer >= 1, got 0"),
        ("3", "tensor_parallel_size 3 must divide llama's 4 attention heads"),
    ],
)
def test_a_size_that_cannot_work_is_one_line_and_queues_nothing(
    tmp_path, toy_model, redis_url, size, message
):
    (tmp_path / "tiny").symlink_to(toy_model("llama"))
    write_jsonl(tmp_path / "p.jsonl", LINES)
    out = _run(Shell(tmp_path, tmp_path / "home", redis_url), tmp_path, "bad",
               "--tensor-parallel-size", size)  # fmt: skip
    assert (out.returncode, out.stderr, out.stdout) == (2, f"batchgen: error: {message}\n", "")
    assert redis.Redis.from_url(redis_url).dbsize() == 0
