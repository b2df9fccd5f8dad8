"""End to end: real subprocess workers, the real engine on a toy checkpoint, real Redis.

Greedy rows must equal ``Engine.generate`` on the same prompts, whatever ran
them: two workers, a worker SIGKILLed mid-job, a worker stopped by SIGTERM
that hands its requests back, or ``batchgen run`` in one process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import redis

from batchgen.jobs.ops.job_record import load_job
from batchgen.jobs.ops.lifecycle import JobState
from batchgen.jobs.redis.keys import GROUP, Keys
from tests.hooks import hook_env

KEYS = Keys("bg")
N_PROMPTS = 200


def mixed_lines(n: int) -> list[dict[str, Any]]:
    """Native prompts and messages, OpenAI chat and completions lines, varied max_tokens."""
    lines: list[dict[str, Any]] = []
    for i in range(n):
        text = f"Line {i}: tell me about item {i * 7 % 13} and color {i % 5}."
        max_tokens = 4 + i % 9
        kind = i % 4
        if kind == 0:
            lines.append({"id": f"n{i}", "prompt": text, "max_tokens": max_tokens})
        elif kind == 1:
            lines.append({"messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": text}],
                          "max_tokens": max_tokens, "metadata": {"i": i}})  # fmt: skip
        elif kind == 2:
            lines.append({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                          "body": {"model": "toy", "messages": [{"role": "user", "content": text}],
                                   "max_completion_tokens": max_tokens}})  # fmt: skip
        else:
            lines.append({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                          "body": {"model": "toy", "prompt": text, "max_tokens": max_tokens}})  # fmt: skip
    return lines


def prompt_and_tokens(line: dict[str, Any]) -> tuple[Any, int]:
    body = line.get("body", line)
    prompt = body.get("prompt") or body["messages"]
    return prompt, body.get("max_tokens") or body.get("max_completion_tokens")


def write_jsonl(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def model(toy_model) -> Path:
    return toy_model("llama")


@pytest.fixture(scope="module")
def reference(model: Path) -> Iterator[Callable[[list[dict[str, Any]]], list[list[int]]]]:
    """Greedy token ids from ``Engine.generate`` (cached per prompt list)."""
    import torch

    from batchgen import Engine, SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers run; 2 threads on 2 shared cores is slower
    engine = Engine.from_pretrained(model, device="cpu")
    cache: dict[str, list[list[int]]] = {}

    def run(lines: list[dict[str, Any]]) -> list[list[int]]:
        key = json.dumps(lines)
        if key not in cache:
            prompts, params = [], []
            for line in lines:
                prompt, max_tokens = prompt_and_tokens(line)
                prompts.append(prompt)
                params.append(SamplingParams(max_tokens=max_tokens))
            cache[key] = [list(o.token_ids) for o in engine.generate(prompts, params)]
        return cache[key]

    yield run
    torch.set_num_threads(threads)


@pytest.fixture
def env(redis_url: str, tmp_path: Path) -> dict[str, str]:
    out = {**os.environ, "BATCHGEN_REDIS_URL": redis_url, "BATCHGEN_HOME": str(tmp_path / "home"),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip
    out.pop("BATCHGEN_TEST_CRASH_AT", None)
    return out


@pytest.fixture
def workers(env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen]]:
    started: list[subprocess.Popen] = []

    def start(model: Path, *args: str, step_s: float | None = None) -> subprocess.Popen:
        """``batchgen worker --model MODEL ARGS``, its engine steps paced to ``step_s``
        at least if given (tests.hooks)."""
        log = open(tmp_path / f"worker-{len(started)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", "batchgen", "worker", "--model", str(model), "--device", "cpu",
             *args], env={**env, **hook_env(step_s=step_s)}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def batchgen(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "batchgen", *args], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def submit(env, model: Path, path: Path, job_id: str, tmp_path: Path, *extra: str) -> None:
    out = batchgen(env, "submit", str(path), "--model", str(model), "--job-id", job_id,
                   "--output", str(tmp_path / f"out-{job_id}"), *extra)  # fmt: skip
    assert out.returncode == 0, out.stderr


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def state(redis_url: str, job_id: str) -> JobState:
    return load_job(redis.Redis.from_url(redis_url), KEYS, job_id).state


def download(env, job_id: str, tmp_path: Path) -> dict[str, list]:
    dest = tmp_path / f"{job_id}.parquet"
    out = batchgen(env, "download", job_id, "-o", str(dest))
    assert out.returncode == 0, out.stderr
    return pq.read_table(dest).to_pydict()


def test_two_cpu_workers_burst_through_200_mixed_prompts(
    model, reference, workers, env, redis_url, tmp_path
):
    lines = mixed_lines(N_PROMPTS)
    submit(env, model, write_jsonl(tmp_path / "p.jsonl", lines), "mixed", tmp_path)
    proc = workers(model, "--workers", "2", "--burst", "--max-num-seqs", "8")
    assert proc.wait(timeout=600) == 0, (tmp_path / "worker-0.log").read_text()[-3000:]
    status = json.loads(batchgen(env, "status", "mixed", "--json").stdout)
    assert (status["state"], status["done"], status["failed"]) == ("completed", N_PROMPTS, 0)
    rows = download(env, "mixed", tmp_path)
    assert rows["index"] == list(range(N_PROMPTS))
    assert rows["token_ids"] == reference(lines)
    assert rows["id"][:4] == ["n0", None, "c2", "c3"]
    assert rows["metadata"][1] == '{"i":1}'
    assert len(set(rows["worker"])) == 2  # both workers took part
    manifest = json.loads((tmp_path / "out-mixed" / "manifest.json").read_text())
    assert manifest["model"]["fingerprint"].startswith("sha256:")
    assert manifest["counts"]["rows"] == N_PROMPTS


def test_run_writes_the_same_rows_as_submit_and_worker(model, reference, env, tmp_path):
    lines = mixed_lines(24)
    out = batchgen(env, "run", str(write_jsonl(tmp_path / "p.jsonl", lines)), "--model", str(model),
                   "-o", str(tmp_path / "run.parquet"), "--device", "cpu",
                   "--job-output", str(tmp_path / "run-job"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = pq.read_table(tmp_path / "run.parquet").to_pydict()
    assert rows["index"] == list(range(24))
    assert rows["token_ids"] == reference(lines)


def test_too_long_prompts_are_error_rows(model, workers, env, tmp_path):
    long_prompt = " ".join(f"word{i}" for i in range(300))
    lines = [{"prompt": "short", "max_tokens": 4}, {"prompt": long_prompt, "max_tokens": 4},
             {"prompt": "medium " * 10, "max_tokens": 120}]  # fmt: skip
    submit(env, model, write_jsonl(tmp_path / "p.jsonl", lines), "long", tmp_path)
    proc = workers(model, "--burst", "--max-model-len", "128")
    assert proc.wait(timeout=300) == 0
    rows = download(env, "long", tmp_path)
    assert rows["finish_reason"] == ["length", "error", "error"]
    assert rows["text"][1:] == ["", ""]
    assert rows["error"][1].startswith("prompt is ") and rows["error"][1].endswith(
        " tokens; the model's context is 128 tokens")  # fmt: skip
    assert rows["error"][2].startswith("request rejected: prompt (")
    assert rows["error"][2].endswith("exceeds the model's context of 128 tokens")


def test_cancel_mid_job(model, workers, env, redis_url, tmp_path):
    # paced (a step >= 30 ms, a row >= 1.9 s, the job >= 19 s on 4 slots): cancelled well
    # before most finish however fast the machine (in tokens alone, each faster engine
    # had finished most before the cancel)
    lines = [{"prompt": f"story {i}", "max_tokens": 64} for i in range(40)]
    submit(env, model, write_jsonl(tmp_path / "p.jsonl", lines), "cancelme", tmp_path)
    workers(model, "--max-num-seqs", "4", step_s=0.03)
    conn: Any = redis.Redis.from_url(env["BATCHGEN_REDIS_URL"])
    wait_for(lambda: load_job(conn, KEYS, "cancelme").done >= 2, 300, "two rows")
    out = batchgen(env, "cancel", "cancelme")
    assert out.returncode == 0 and out.stdout == "cancelme cancelling (a worker finalizes it)\n"
    wait_for(lambda: state(redis_url, "cancelme") == JobState.CANCELLED, 60, "cancelled")
    rows = download(env, "cancelme", tmp_path)
    assert rows["index"] == list(range(40))
    reasons = rows["finish_reason"]
    assert reasons.count("length") >= 2 and reasons.count("cancelled") >= 20
    assert set(reasons) <= {"length", "stop", "cancelled"}
    qk = KEYS.queue_for_model(str(model))
    wait_for(lambda: conn.xlen(qk.stream) == 0, 60, "the cancelled entries to be dropped")


@pytest.mark.slow
def test_a_worker_killed_mid_job_and_a_new_one_give_exactly_one_row_per_line(
    model, reference, workers, env, redis_url, tmp_path
):
    # paced (a step >= 30 ms, a row >= 1.4 s, the job >= 14 s on 4 slots): the first
    # committed rows come well before the last however fast the machine (in tokens
    # alone, 48 a line, the CPU engine had done all 40 before the kill landed)
    lines = [{"prompt": f"Tell the tale of number {i}", "max_tokens": 48} for i in range(40)]
    submit(env, model, write_jsonl(tmp_path / "p.jsonl", lines), "killed", tmp_path)
    first = workers(model, "--max-num-seqs", "4", "--claim-timeout", "3", step_s=0.03)
    conn: Any = redis.Redis.from_url(redis_url)
    wait_for(lambda: load_job(conn, KEYS, "killed").done >= 4, 300, "some rows")
    os.killpg(first.pid, signal.SIGKILL)  # supervisor and engine process, mid-decode
    first.wait()
    second = workers(model, "--burst", "--claim-timeout", "3")
    assert second.wait(timeout=600) == 0
    rows = download(env, "killed", tmp_path)
    assert rows["index"] == list(range(40))
    assert rows["token_ids"] == reference(lines)
    assert max(rows["attempts"]) >= 2  # the killed worker's requests ran again
    qk = KEYS.queue_for_model(str(model))
    assert conn.xlen(qk.stream) == 0 and conn.xpending(qk.stream, GROUP)["pending"] == 0


@pytest.mark.slow
def test_sigterm_hands_back_and_the_next_worker_resumes(
    model, reference, workers, env, redis_url, tmp_path
):
    # paced (a step >= 30 ms, a row >= 6 s): under way at the SIGTERM however fast the
    # machine (in tokens alone, 200 a line, the CPU engine had finished them all first)
    lines = [{"prompt": f"Once upon a time {i}", "max_tokens": 200} for i in range(4)]
    submit(env, model, write_jsonl(tmp_path / "p.jsonl", lines), "handback", tmp_path)
    first = workers(model, "--max-num-seqs", "4", step_s=0.03)
    conn: Any = redis.Redis.from_url(redis_url)
    qk = KEYS.queue_for_model(str(model))
    wait_for(lambda: conn.xpending(qk.stream, GROUP)["pending"] > 0, 300, "requests in flight")
    time.sleep(1.0)  # let them generate some tokens (200 take 6 s at least)
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=60) == 0
    resumed = [json.loads(f[b"x"]) for _, f in conn.xrange(qk.stream) if b"x" in f]
    assert resumed and all(len(x["resume"]) > 0 for x in resumed)
    second = workers(model, "--burst")
    assert second.wait(timeout=600) == 0
    rows = download(env, "handback", tmp_path)
    assert rows["token_ids"] == reference(lines)  # resumed, not restarted, and still identical


def test_a_sliding_window_model_end_to_end(zoo_model, workers, env, tmp_path):
    """Mistral-shaped, a window of 16 on every layer: generations several windows long
    through submit -> worker -> Parquet, in a pool of 12 blocks of 16 tokens (the
    worker hands blocks that left the window back), token for token as transformers."""
    from batchgen import Engine
    from tests.hf_reference import hf_greedy

    model = zoo_model("mistral")
    lines: list[dict[str, Any]] = [{"id": f"w{i}", "prompt": f"Item {i}: the weather today is sunny with a light breeze "
              f"from the west, {'and rain ' * i}tomorrow.", "max_tokens": 70 + 9 * i}
             for i in range(6)]  # fmt: skip
    submit(env, model, write_jsonl(tmp_path / "p.jsonl", lines), "slide", tmp_path)
    proc = workers(model, "--burst", "--num-kv-blocks", "12")
    assert proc.wait(timeout=300) == 0, (tmp_path / "worker-0.log").read_text()[-3000:]
    rows = download(env, "slide", tmp_path)
    tokenizer = Engine.from_pretrained(model, num_kv_blocks=12).tokenizer
    for line, tokens, reason in zip(lines, rows["token_ids"], rows["finish_reason"]):
        prompt = tokenizer.encode(line["prompt"], add_special_tokens=True)
        assert tokens == hf_greedy(model, prompt, line["max_tokens"], stop_at_eos=True)
        assert reason in ("stop", "length")
    assert rows["id"] == [line["id"] for line in lines]
    assert max(len(t) for t in rows["token_ids"]) > 4 * 16  # past several windows
