"""A job that a worker refuses (it holds other weights under the job's model name) reads
refused in ``batchgen status`` while nothing runs it, and no more once a worker that
holds its weights takes it; ``batchgen serve`` shows its batch in_progress (the job is
live: a worker with the weights may still run it) with the refusal in ``errors``. Real
Redis; the workers' JobBook (worker/loop/job_book.py) and the dispatch read, as a
worker runs them, without an engine. A model no worker can load never gets that far:
its jobs wait queued, unserved (real processes)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import redis
from openai import OpenAI

from batchgen.cli.status import _render, _table
from batchgen.jobs.ops.job_record import load_job
from batchgen.jobs.ops.modelinfo import fingerprint
from batchgen.jobs.ops.status_report import job_status
from batchgen.jobs.ops.submission import submit
from batchgen.jobs.redis import heartbeat
from batchgen.jobs.redis.keys import Keys, queue_name
from batchgen.jobs.schema.sampling import DEFAULTS
from batchgen.worker.consumer.queue import HandBack, hand_back, read_new
from batchgen.worker.loop.job_book import JobBook
from batchgen.worker.loop.loop_config import LoopConfig
from tests.serve_stack import KEY, Stack, wait_for

KEYS = Keys("bg")
WEIGHTS = "model.safetensors"


@pytest.fixture
def model(toy_model, tmp_path) -> Path:
    """A copy of a toy checkpoint whose weights the test changes in place."""
    return Path(shutil.copytree(toy_model("llama"), tmp_path / "model"))


def _flip_weights(model: Path) -> None:
    """One bit of the first tensor's data: other weights, the same header."""
    data = bytearray((model / WEIGHTS).read_bytes())
    data[8 + int.from_bytes(data[:8], "little") + 64] ^= 0x01
    (model / WEIGHTS).write_bytes(bytes(data))


def _worker(conn: Any, model: Path, name: str) -> JobBook:
    """The job book of a live worker of ``model`` (its heartbeat names no request held)."""
    config = LoopConfig(model=str(model), name=name)
    qk = KEYS.queue_for_model(str(model))
    beat = {"name": name, "tag": qk.tag, "queue": queue_name(str(model)), "in_flight": {}}
    heartbeat.beat(conn, KEYS, name, beat, 60)
    return JobBook(conn, KEYS, qk, config, lambda name, n: None)


def refuse(conn: Any, model: Path, job_id: str) -> str:
    """A stale host's worker (other weights under ``model``'s path) meets the job's four
    requests and hands them back uncharged, as Requests._refuse does; its refusal, said
    on the job."""
    _flip_weights(model)
    stale = _worker(conn, model, "stale")
    qk = KEYS.queue_for_model(str(model))
    taken = read_new(conn, qk, "stale", 8)
    assert [d.index for d in taken] == [0, 1, 2, 3]
    info = stale.job(job_id)
    assert info is not None and info.refused.startswith("worker stale on ")
    assert hand_back(conn, qk, "stale", [HandBack(d, [], ran=False) for d in taken]) == 4
    return info.refused


def test_a_refused_job_reads_refused_until_a_worker_with_its_weights_takes_it(
    redis_url, tmp_path, model
):
    conn: Any = redis.Redis.from_url(redis_url)
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(4)))
    submit(conn, KEYS, source_path=str(src), model=str(model), output=str(tmp_path / "out"),
           defaults=dict(DEFAULTS), job_id="fp")  # fmt: skip
    submitted_for = load_job(conn, KEYS, "fp").model_fingerprint
    assert submitted_for == fingerprint(str(model)) != ""

    refused = refuse(conn, model, "fp")  # a stale host's copy under the same path

    status = job_status(conn, KEYS, "fp")
    text = _render(status)
    assert status.record.state.value == "running"  # the lifecycle's: a worker read it
    assert "state      running  [refused: no worker holding its weights runs it]\n" in text
    assert "eta        - (refused by the live workers: see refused)\n" in text
    assert f"refused    {refused}" in text
    assert f"the job was submitted for {submitted_for}" in refused
    assert status.to_dict()["refused_now"] is True
    assert _table([status]).splitlines()[1].split()[-1] == "refused"

    _flip_weights(model)  # back to the weights it was submitted for
    good = _worker(conn, model, "good")
    assert good.fingerprint == submitted_for
    info = good.job("fp")
    assert info is not None and info.refused == ""
    record = load_job(conn, KEYS, "fp")
    assert record.refused == ""  # it runs: the stale worker's refusal is no longer the job's
    status = job_status(conn, KEYS, "fp")
    text = _render(status)
    assert "\nstate      running\n" in text and "\nrefused    " not in text
    assert "eta        - (no row finished yet)\n" in text
    assert status.to_dict()["refused_now"] is False

    # a stale worker meets the job while the good one runs it: its refusal is said, but
    # the job runs (the good worker's heartbeat holds two of its requests)
    qk = KEYS.queue_for_model(str(model))
    heartbeat.beat(conn, KEYS, "good", {"name": "good", "tag": qk.tag, "in_flight": {"fp": 2}}, 60)
    _flip_weights(model)
    late = _worker(conn, model, "late").job("fp")
    assert late is not None and late.refused.startswith("worker late on ")
    status = job_status(conn, KEYS, "fp")
    text = _render(status)
    assert "\nstate      running\n" in text and f"\nrefused    {late.refused}" in text
    assert (status.in_flight, status.to_dict()["refused_now"]) == (2, False)


def test_a_job_for_a_model_no_worker_can_load_waits_queued_and_says_no_worker_serves_it(
    toy_model, private_redis, tmp_path
):
    """The other refusal: a worker that cannot load the model exits (2) before it reads
    anything, so no job of the model ever reads running; status says nothing serves it."""
    from tests.cli_session import Shell, write_jsonl

    bert = Path(shutil.copytree(toy_model("llama"), tmp_path / "bert"))
    config = json.loads((bert / "config.json").read_text())
    config["architectures"] = ["BertForMaskedLM"]  # its files are all there: submit takes it
    (bert / "config.json").write_text(json.dumps(config))
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi", "max_tokens": 2}])
    shell = Shell(tmp_path, tmp_path / "home", private_redis.url)
    shell.ok("submit", "p.jsonl", "--model", "bert", "--job-id", "b", "--output",
             str(tmp_path / "out"))  # fmt: skip
    worker = shell.run("worker", "--model", "bert", "--device", "cpu", "--burst")
    assert worker.returncode == 2 and worker.stderr.startswith(
        "batchgen: error: BertForMaskedLM is not the causal LM transformers builds"
    ), worker.stderr
    status = shell.status("b")
    assert (status["state"], status["unserved"], status["refused"]) == ("queued", True, None)
    assert "eta        - (no live worker serves the model)\n" in shell.ok("status", "b")


def test_serve_shows_a_refused_batch_in_progress_with_the_refusal_in_errors(
    redis_url, tmp_path, model
):
    """Not failed: a batch is failed for good in OpenAI's client, and this one's job still
    runs once a worker that holds its weights reads it (its window's end expires it)."""
    conn: Any = redis.Redis.from_url(redis_url)
    _worker(conn, model, "stale")  # a live worker of the model: the batch is taken
    stack = Stack(redis_url, tmp_path)
    try:
        stack.serve("--api-key", KEY)
        client = OpenAI(base_url=stack.base + "/v1", api_key=KEY, max_retries=0)
        rows = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": str(model), "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 4}} for i in range(4)]  # fmt: skip
        data = "".join(json.dumps(r) + "\n" for r in rows).encode()
        file = client.files.create(file=("in.jsonl", data), purpose="batch")
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")  # fmt: skip
        wait_for(lambda: client.batches.retrieve(batch.id).status == "in_progress", 60,
                 "the batch to be submitted")  # fmt: skip
        assert client.batches.retrieve(batch.id).errors is None

        reason = refuse(conn, model, batch.id)
        seen = client.batches.retrieve(batch.id)
        assert seen.status == "in_progress" and seen.errors is not None
        assert [e.model_dump() for e in seen.errors.data or []] == [
            {"code": "refused_by_worker", "message": reason, "param": None, "line": None}
        ]

        _flip_weights(model)  # a worker holding the weights it was submitted for takes it
        good = _worker(conn, model, "good").job(batch.id)
        assert good is not None and good.refused == ""
        seen = client.batches.retrieve(batch.id)
        assert (seen.status, seen.errors) == ("in_progress", None)
    finally:
        stack.stop()
