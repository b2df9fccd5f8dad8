"""The pipeline's commands as users call them: exit codes and one-line errors."""

from __future__ import annotations

import json
from typing import Any

import pyarrow.parquet as pq
import redis
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.jobs.ops.finalize import finalize_tasks as tasks
from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.redis.redis_server import free_port
from batchgen.worker.loop import EngineAPI, LoopConfig, QueueLoop
from tests.engine_double import FakeEngine, RequestRejected, SamplingParams


def rconn(url: str, **kwargs: Any) -> Any:
    """A client typed loosely: redis-py's reply unions make tests unreadable."""
    return redis.Redis.from_url(url, **kwargs)


def cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def write(tmp_path, text: str):
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    return str(path)


def test_submit_prints_the_job_id_and_json(redis_url, tmp_path):
    src = write(tmp_path, '{"prompt": "a"}\n{"prompt": "b"}\n')
    out = str(tmp_path / "out")
    result = cli(
        "submit", src, "--model", "m", "--output", out, "--job-id", "j1", "--redis", redis_url
    )
    assert (result.exit_code, result.stdout) == (0, "j1\n")  # stderr: no worker serves m
    result = cli("submit", src, "--model", "m", "--output", out, "--job-id", "j1", "--json",
                 "--redis", redis_url)  # fmt: skip
    assert json.loads(result.stdout) == {
        "job_id": "j1", "total": 2, "skipped": 0, "enqueued": 0, "resumed": True, "output": out,
    }  # fmt: skip


def test_invalid_input_is_one_message_and_exit_2(redis_url, tmp_path):
    src = write(tmp_path, '{"prompt": "a", "temperature": NaN}\n')
    result = cli("submit", src, "--model", "m", "--output", str(tmp_path), "--redis", redis_url)
    assert result.exit_code == 2
    assert result.output.endswith("line 1, column 32: NaN is not a valid JSON number\n")
    assert "Traceback" not in result.output
    assert rconn(redis_url).dbsize() == 0


def test_bad_flags_and_names_are_usage_errors(redis_url, tmp_path):
    src = write(tmp_path, '{"prompt": "a"}\n')
    result = cli("submit", src, "--model", "m", "--top-p", "0", "--redis", redis_url)
    assert (
        result.exit_code == 2
        and "--top-p: top_p must be a number in (0, 1], got 0" in result.output
    )
    result = cli("submit", src, "--model", "m", "--job-id", "../x", "--redis", redis_url)
    assert result.exit_code == 2 and "job id '../x' is not a plain name" in result.output
    result = cli("submit", src, "--model", "m", "--output", "/a/../b", "--redis", redis_url)
    assert result.exit_code == 2 and "contains '..'" in result.output
    result = cli("submit", src, "--model", "m", "--redis", redis_url)
    assert (
        result.exit_code == 2
        and "output directory is required with a shared Redis (submit --output" in result.output
    )


def test_unreachable_redis_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHGEN_REDIS_WAIT", "0.5")  # how long a command waits (default 10 s)
    url = f"redis://127.0.0.1:{free_port()}/0"
    for args in (["status"], ["download", "j"], ["submit", write(tmp_path, '{"prompt": "a"}\n'),
                                                 "--model", "m", "--output", str(tmp_path)]):  # fmt: skip
        result = cli(*args, "--redis", url)
        assert result.exit_code == 1
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            f"batchgen: error: cannot reach Redis at {url}"
        )


def test_status_jobs_cancel_download(redis_url, tmp_path):
    src = write(tmp_path, "".join(f'{{"prompt": "p{i}"}}\n' for i in range(4)))
    out = tmp_path / "out"
    cli("submit", src, "--model", "m", "--output", str(out), "--job-id", "j1", "--max-tokens", "2",
        "--redis", redis_url)  # fmt: skip
    status = json.loads(cli("status", "j1", "--json", "--redis", redis_url).output)
    assert (status["state"], status["total"], status["queued"], status["done"]) == (
        "queued",
        4,
        4,
        0,
    )
    text = cli("status", "j1", "--redis", redis_url).output
    assert "state      queued" in text and "[..............................] 0/4" in text
    assert "j1" in cli("jobs", "--redis", redis_url).output
    assert "j1" in cli("status", "--redis", redis_url).output
    result = cli("download", "j1", "-o", str(tmp_path / "x.parquet"), "--redis", redis_url)
    assert result.exit_code == 1 and "job 'j1' is queued (0/4 rows)" in result.output
    # one worker pass over half the job, then cancel
    conn = rconn(redis_url)
    api = EngineAPI(FakeEngine(max_num_seqs=2), SamplingParams, (RequestRejected,))
    loop = QueueLoop(conn, api, LoopConfig(model="m", flush_interval_s=0.0, block_ms=10))
    while json.loads(cli("status", "j1", "--json", "--redis", redis_url).output)["done"] < 2:
        loop.tick()
    loop.shutdown()
    result = cli(
        "download", "j1", "-o", str(tmp_path / "part.parquet"), "--partial", "--redis", redis_url
    )
    assert result.exit_code == 0, result.output
    assert pq.read_table(tmp_path / "part.parquet").column("index").to_pylist()[:2] == [0, 1]
    assert (
        cli("cancel", "j1", "--redis", redis_url).output
        == "j1 cancelling (a worker finalizes it)\n"
    )
    tasks.run_pending(conn, Keys("bg"), Keys("bg").queue_for_model("m").tag)
    assert (
        json.loads(cli("status", "j1", "--json", "--redis", redis_url).output)["state"]
        == "cancelled"
    )
    result = cli("download", "j1", "-o", str(tmp_path), "--redis", redis_url)
    assert result.output == f"wrote 4 rows to {tmp_path / 'j1.parquet'}\n"
    reasons = pq.read_table(tmp_path / "j1.parquet").column("finish_reason").to_pylist()
    assert reasons[:2] == ["length", "length"] and reasons[2:] == ["cancelled", "cancelled"]
    result = cli("cancel", "j1", "--redis", redis_url)
    assert result.output == "j1 was already cancelled\n"
    result = cli("status", "nope", "--redis", redis_url)
    assert result.exit_code == 1 and "no job 'nope' in this Redis" in result.output


def test_gpus_without_cuda_is_a_clear_error(redis_url):
    result = cli("worker", "--model", "m", "--gpus", "0-1", "--redis", redis_url)
    assert result.exit_code == 2
    assert result.output == (
        "batchgen: error: --gpus: no CUDA device is visible on this machine "
        "(torch.cuda.device_count() is 0); use --device cpu [--workers N]\n"
    )
    result = cli("worker", "--model", "m", "--gpus", "0", "--workers", "2", "--redis", redis_url)
    assert result.exit_code == 2 and "--workers is for CPU workers" in result.output
