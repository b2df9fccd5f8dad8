"""``batchgen run`` runs its job alone: a worker of the same model on the same Redis, live
and idle before the run starts, never takes one of its requests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import redis

from batchgen.jobs.redis.keys import GROUP, Keys, queue_tag, run_queue_name
from tests.cli_session import Shell, rows, wait_for, write_jsonl


def live_workers(url: str) -> list[dict]:
    conn: Any = redis.Redis.from_url(url)
    names = [n.decode() for n in conn.zrange("bg:workers", 0, -1)]
    return [json.loads(raw) for raw in conn.mget([f"bg:worker:{n}" for n in names] or ["-"]) if raw]


def test_a_worker_of_the_same_model_never_takes_a_runs_requests(
    tmp_path: Path, toy_model, private_redis
):
    (tmp_path / "tiny").symlink_to(toy_model("llama"))
    shell = Shell(tmp_path, tmp_path / "home", private_redis.url)
    try:
        other = shell.start("worker", "--model", "tiny", "--device", "cpu")
        wait_for(lambda: live_workers(private_redis.url), "the other worker's heartbeat")
        long_prompt = " ".join(f"word{i}" for i in range(80))  # over 64 tokens
        lines = [{"id": f"r{i}", "prompt": f"question {i}", "max_tokens": 3} for i in range(12)]
        lines.append({"id": "long", "prompt": long_prompt, "max_tokens": 3})
        write_jsonl(tmp_path / "p.jsonl", lines)
        run = shell.start("run", "p.jsonl", "--model", "tiny", "-o", "out.parquet", "--job-id",
                          "alone", "--max-model-len", "64", "--device", "cpu",
                          "--job-output", str(tmp_path / "job"), log="run.log")  # fmt: skip
        assert run.wait(timeout=300) == 0, (tmp_path / "run.log").read_text()[-3000:]
        assert other.poll() is None  # it was there all along, and saw nothing of the job
        got = rows(tmp_path / "out.parquet")
        assert got["id"] == [f"r{i}" for i in range(12)] + ["long"]
        # every row was made by the run's own loop (its name: host-PID-hex)
        assert {name.rsplit("-", 2)[1] for name in got["worker"]} == {str(run.pid)}
        # the run's --max-model-len held: the 4096-context worker would have generated
        assert got["finish_reason"][-1] == "error"
        assert got["error"][-1].endswith("; the model's context is 64 tokens")
        conn = redis.Redis.from_url(private_redis.url)
        model_queue = Keys("bg").queue_for_model(str(tmp_path / "tiny"))
        # nothing ever went through the model's own stream, which the other worker reads
        assert conn.xinfo_stream(model_queue.stream)["last-generated-id"] == b"0-0"
        own = Keys("bg").queue(queue_tag(run_queue_name(str(tmp_path / "tiny"), "alone")))
        consumers = conn.xinfo_consumers(own.stream, GROUP)
        assert [c["name"].decode().rsplit("-", 2)[1] for c in consumers] == [str(run.pid)]
        assert shell.status("alone")["state"] == "completed"

        # its failed row, retried: only batchgen run serves the job's queue, and says so
        assert shell.ok("retry", "alone") == (
            "alone: retry 1: queued 1 row(s) again; the job is running\n"
            "alone was made by `batchgen run`, whose queue no worker reads: run the same "
            "`batchgen run` command with --job-id alone to run them\n"
        )
        again = shell.run("run", "p.jsonl", "--model", "tiny", "-o", "out.parquet", "--force",
                          "--job-id", "alone", "--device", "cpu",
                          "--job-output", str(tmp_path / "job"))  # fmt: skip
        assert again.returncode == 0, again.stderr
        retried = rows(tmp_path / "out.parquet")
        assert retried["finish_reason"][-1] == "length"  # a full context this time
        assert retried["token_ids"][:12] == got["token_ids"][:12]  # the rest kept as they were
        assert conn.xinfo_stream(model_queue.stream)["last-generated-id"] == b"0-0"
    finally:
        shell.stop_all()
