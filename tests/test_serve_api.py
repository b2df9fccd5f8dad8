"""The official ``openai`` client against a live ``batchgen serve`` and a CPU worker.

Real processes throughout: a private redis-server, ``batchgen worker`` on a toy
checkpoint, ``batchgen serve`` on a free port, and PyPI's ``openai`` package.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pyarrow.parquet as pq
import pytest
import redis
from openai import OpenAI

from batchgen.jobs.ops.fair_share import tenants
from batchgen.jobs.ops.job_record import load_job
from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.redis.redis_server import RedisServer
from batchgen.serve.api_keys import KeyRing
from tests.serve_stack import KEY, Stack

DONE = ("completed", "failed", "cancelled", "expired")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, toy_model) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("serve-api")
    server = RedisServer(tmp / "redis")
    server.start()
    stack = Stack(server.url, tmp)
    stack.model = toy_model("llama")  # type: ignore[attr-defined]
    try:
        stack.serve("--api-key", KEY, "--api-key", "second-key", "--sample", "1")
        stack.worker(stack.model, "--max-num-seqs", "4")  # type: ignore[attr-defined]
        yield stack
    finally:
        stack.stop()
        server.kill()


@pytest.fixture
def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=stack.base + "/v1", api_key=KEY, max_retries=0)


def lines(model: str, n: int, url: str = "/v1/chat/completions", max_tokens: int = 6,
          prefix: str = "req") -> list[dict[str, Any]]:  # fmt: skip
    out = []
    for i in range(n):
        text = f"Question {i}: what is {i} plus {i * 3 % 7}?"
        body: dict[str, Any] = {"model": model, "max_tokens": max_tokens - i % 3}
        if url == "/v1/completions":
            body["prompt"] = text
        else:
            body["messages"] = [{"role": "user", "content": text}]
        out.append({"custom_id": f"{prefix}-{i}", "method": "POST", "url": url, "body": body})
    return out


def upload(client: OpenAI, tmp: Path, rows: list[dict[str, Any]], name: str) -> Any:
    path = tmp / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with path.open("rb") as f:
        obj = client.files.create(file=f, purpose="batch")
    assert (obj.bytes, obj.filename, obj.purpose) == (path.stat().st_size, name, "batch")
    return obj


def wait_done(client: OpenAI, batch_id: str, timeout: float = 300) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in DONE:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.3)


def jsonl(client: OpenAI, file_id: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_batches_run_to_completion_with_the_openai_client(stack, client, tmp_path):
    model = str(stack.model)
    chat = lines(model, 12)
    text = lines(model, 5, url="/v1/completions", prefix="cmpl")
    chat_file = upload(client, tmp_path, chat, "chat.jsonl")
    text[4]["body"]["n"] = 2  # two samples: two choices in one body
    text_file = upload(client, tmp_path, text, "text.jsonl")
    created = client.batches.create(input_file_id=chat_file.id, endpoint="/v1/chat/completions",
                                    completion_window="24h", metadata={"team": "search"})  # fmt: skip
    assert created.status == "validating" and created.request_counts.total == 0
    other = client.batches.create(input_file_id=text_file.id, endpoint="/v1/completions",
                                  completion_window="24h")  # fmt: skip

    batch = wait_done(client, created.id)
    assert batch.status == "completed", batch.errors
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (12, 12, 0)
    assert batch.error_file_id is None and batch.output_file_id
    assert batch.metadata["team"] == "search"
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    assert batch.created_at <= batch.in_progress_at <= batch.finalizing_at <= batch.completed_at

    out = jsonl(client, batch.output_file_id)
    assert len(out) == 12
    assert {line["custom_id"] for line in out} == {line["custom_id"] for line in chat}
    # the Parquet result stays where the job wrote it; its URI is in the metadata
    result = pq.read_table(batch.metadata["batchgen_result"]).to_pydict()
    usage = {cid: (p, c) for cid, p, c in zip(result["id"], result["prompt_tokens"],
                                                result["completion_tokens"])}  # fmt: skip
    texts = dict(zip(result["id"], result["text"]))
    for line in out:
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert (body["object"], body["model"]) == ("chat.completion", model)
        prompt, completion = usage[line["custom_id"]]
        assert body["usage"]["prompt_tokens"] == prompt
        assert body["usage"]["completion_tokens"] == completion
        assert body["usage"]["total_tokens"] == prompt + completion
        assert body["choices"][0]["message"]["content"] == texts[line["custom_id"]]
        want = next(r for r in chat if r["custom_id"] == line["custom_id"])["body"]["max_tokens"]
        assert (completion, body["choices"][0]["finish_reason"]) == (want, "length")
    assert batch.usage.output_tokens == sum(result["completion_tokens"])

    other = wait_done(client, other.id)
    assert other.status == "completed"
    out = jsonl(client, other.output_file_id)
    assert sorted(line["custom_id"] for line in out) == [f"cmpl-{i}" for i in range(5)]
    assert {line["response"]["body"]["object"] for line in out} == {"text_completion"}
    bodies = {line["custom_id"]: line["response"]["body"] for line in out}
    assert [len(bodies[f"cmpl-{i}"]["choices"]) for i in range(5)] == [1, 1, 1, 1, 2]
    assert [c["index"] for c in bodies["cmpl-4"]["choices"]] == [0, 1]


def test_batches_list_pages_newest_first(client, tmp_path):
    bad = [{"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}}]  # fmt: skip
    file = upload(client, tmp_path, bad, "bad.jsonl")
    ids = [client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id for _ in range(3)]  # fmt: skip
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    second = client.batches.list(limit=2, after=first.data[-1].id)
    assert second.data[0].id == ids[0]
    everything = [b.id for b in client.batches.list(limit=2)]  # auto-pagination over `after`
    assert everything[:3] == ids[::-1] and len(everything) == len(set(everything))
    failed = wait_done(client, ids[0])
    assert failed.status == "failed"
    assert failed.errors.data[0].code == "model_not_found"


def test_an_invalid_input_file_fails_validation_with_its_line(stack, client, tmp_path):
    rows = lines(str(stack.model), 3)
    rows[1]["body"]["max_tokens"] = -3
    batch = client.batches.create(input_file_id=upload(client, tmp_path, rows, "a.jsonl").id,
                                  endpoint="/v1/chat/completions", completion_window="24h")  # fmt: skip
    batch = wait_done(client, batch.id)
    assert batch.status == "failed" and batch.failed_at and batch.output_file_id is None
    (error,) = batch.errors.data
    assert error.line == 2 and "max_tokens must be an integer" in error.message

    rows = lines(str(stack.model), 3)
    rows[2]["body"]["model"] = "another-model"
    rows[0]["custom_id"] = rows[1]["custom_id"]
    batch = client.batches.create(input_file_id=upload(client, tmp_path, rows, "b.jsonl").id,
                                  endpoint="/v1/chat/completions", completion_window="24h")  # fmt: skip
    batch = wait_done(client, batch.id)
    assert batch.status == "failed"
    assert [(e.line, e.code) for e in batch.errors.data] == [
        (2, "duplicate_custom_id"), (3, "mismatched_model")]  # fmt: skip
    with pytest.raises(openai.BadRequestError) as caught:
        client.batches.create(input_file_id=batch.input_file_id, endpoint="/v1/responses",
                              completion_window="24h")  # fmt: skip
    assert caught.value.body["param"] == "endpoint"  # type: ignore[index]


@pytest.mark.parametrize(
    ("wrong", "param", "message"),
    [
        ({"completion_window": 24}, "completion_window", "Input should be '24h'"),
        ({"completion_window": ["24h"]}, "completion_window", "Input should be '24h'"),
        ({"input_file_id": ""}, "input_file_id", "String should have at least 1 character"),
        ({"metadata": {"team": 7}}, "metadata.team", "Input should be a valid string"),
        ({"metadata": {"k" * 65: "v"}}, f"metadata.{'k' * 65}.[key]",
         "String should have at most 64 characters"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata",
         "Dictionary should have at most 16 items after validation, not more"),
        ({"output_expires_after": {"anchor": "created_at", "seconds": 60}},
         "output_expires_after.seconds", "Input should be greater than or equal to 3600"),
        ({"output_expires_after": {"anchor": "created_at", "seconds": "7200"}},
         "output_expires_after.seconds", "Input should be a valid integer"),
    ],
    ids=["window-number", "window-list", "file-id-empty", "metadata-value-number",
         "metadata-key-long", "metadata-17-keys", "expiry-short", "expiry-string"],
)  # fmt: skip
def test_a_wrong_create_body_is_400_naming_the_parameter(client, wrong, param, message):
    """Checked before the file is looked up (it does not exist: that would be 404)."""
    body = {"input_file_id": "file-nope", "endpoint": "/v1/completions",
            "completion_window": "24h", **wrong}  # fmt: skip
    with pytest.raises(openai.BadRequestError) as caught:
        client.batches.create(**body)
    assert caught.value.status_code == 400
    assert caught.value.body == {"message": f"{param}: {message}", "param": param,
                                 "type": "invalid_request_error", "code": "invalid_request"}  # fmt: skip


def test_cancel_a_long_batch_keeps_the_finished_requests(stack, client, tmp_path):
    rows = lines(str(stack.model), 120, max_tokens=48)
    batch = client.batches.create(input_file_id=upload(client, tmp_path, rows, "long.jsonl").id,
                                  endpoint="/v1/chat/completions", completion_window="24h")  # fmt: skip
    while (batch := client.batches.retrieve(batch.id)).request_counts.completed == 0:
        assert batch.status in ("validating", "in_progress"), batch.status
        time.sleep(0.2)
    assert batch.status == "in_progress"
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    batch = wait_done(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    counts = batch.request_counts  # OpenAI's: cancelled requests neither completed nor failed
    assert (counts.total, counts.failed) == (120, 0)
    assert 0 < counts.completed < 120
    errors = jsonl(client, batch.error_file_id)
    assert len(errors) == 120 - counts.completed
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    done = jsonl(client, batch.output_file_id) if batch.output_file_id else []
    assert len(done) == counts.completed
    assert {x["custom_id"] for x in done + errors} == {r["custom_id"] for r in rows}
    with pytest.raises(openai.BadRequestError):
        client.batches.cancel(_completed_batch(client))


def _completed_batch(client: OpenAI) -> str:
    return next(b.id for b in client.batches.list(limit=100) if b.status == "completed")


def test_files_round_trip_and_errors_are_shaped_as_openai(stack, client, tmp_path):
    rows = lines("m", 2)
    obj = upload(client, tmp_path, rows, "round.jsonl")
    assert client.files.retrieve(obj.id).bytes == obj.bytes
    assert client.files.content(obj.id).content == (tmp_path / "round.jsonl").read_bytes()
    assert obj.id in [f.id for f in client.files.list(purpose="batch")]
    assert client.files.delete(obj.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(obj.id)
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=stack.base + "/v1", api_key="wrong", max_retries=0).files.list()
    assert OpenAI(base_url=stack.base + "/v1", api_key="second-key").files.list().data == []
    with pytest.raises(urllib.error.HTTPError) as no_key:
        urllib.request.urlopen(stack.base + "/v1/batches")
    assert no_key.value.code == 401
    error = json.loads(no_key.value.read())["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "authentication_error"


def test_a_batch_past_its_window_expires_keeping_finished_requests(stack, client, tmp_path):
    rows = lines(str(stack.model), 120, max_tokens=48, prefix="late")
    batch = client.batches.create(input_file_id=upload(client, tmp_path, rows, "late.jsonl").id,
                                  endpoint="/v1/chat/completions", completion_window="24h")  # fmt: skip
    assert batch.expires_at == batch.created_at + 24 * 3600
    while (batch := client.batches.retrieve(batch.id)).request_counts.completed == 0:
        assert batch.status in ("validating", "in_progress"), batch.status
        time.sleep(0.2)
    # 24 hours pass: the batch record's deadline is moved to now (real Redis, the real sweep)
    conn = redis.Redis.from_url(stack.redis_url)
    conn.hset(Keys("bg").batch(batch.id), "expires_at", int(time.time()))
    batch = wait_done(client, batch.id)
    assert batch.status == "expired" and batch.expired_at and batch.cancelled_at is None
    counts = batch.request_counts
    assert 0 < counts.completed < 120 and counts.failed == 0
    errors = jsonl(client, batch.error_file_id)
    assert len(errors) == 120 - counts.completed
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert len(jsonl(client, batch.output_file_id)) == counts.completed


def test_the_dashboard_json_endpoints(stack, client, tmp_path):
    headers = {"Authorization": f"Bearer {KEY}"}

    def api(path: str, method: str = "GET") -> Any:
        request = urllib.request.Request(stack.base + path, headers=headers, method=method)
        with urllib.request.urlopen(request, timeout=10) as reply:
            return json.loads(reply.read())

    # long enough to be under way at the cancel below: at 48 tokens a row the CPU engine had
    # finished all 60 while the tok/s samples were awaited
    rows = lines(str(stack.model), 60, max_tokens=400, prefix="api")
    batch = client.batches.create(input_file_id=upload(client, tmp_path, rows, "api.jsonl").id,
                                  endpoint="/v1/chat/completions", completion_window="24h")  # fmt: skip
    while client.batches.retrieve(batch.id).request_counts.completed == 0:
        time.sleep(0.2)
    overview = api("/api/overview")
    job = next(j for j in overview["jobs"] if j["job_id"] == batch.id)
    assert job["state"] == "running" and job["total"] == 60 and job["done"] > 0
    (worker,) = overview["workers"]
    assert (worker["device"], worker["model"]) == ("cpu", str(stack.model))
    assert worker["host"] and worker["last_heartbeat"] > time.time() - 30
    assert api("/api/workers")[0]["name"] == worker["name"]
    # the server samples tok/s every second (--sample 1): the fleet and this job produce
    deadline = time.monotonic() + 30
    while not any(p["jobs"].get(batch.id) for p in api("/api/series")):
        assert time.monotonic() < deadline, "no tok/s sample for the job"
        time.sleep(0.5)
    assert any(p["fleet"] > 0 for p in api("/api/series"))
    while not api("/api/workers")[0]["tokens_per_s"] > 0:  # from its heartbeats' counters
        assert time.monotonic() < deadline, "no tok/s for the worker"
        time.sleep(0.5)
    assert api(f"/api/jobs/{batch.id}/cancel", "POST") == {
        "job_id": batch.id,
        "state": "cancelling",
    }
    detail = api(f"/api/jobs/{batch.id}")
    assert detail["state"] in ("cancelling", "cancelled") and detail["dead_letters"] == []
    assert detail["output"].endswith(batch.id)
    assert wait_done(client, batch.id).status == "cancelled"


def test_logprobs_and_embeddings_render_as_openai_objects(stack, client, tmp_path):
    model = str(stack.model)
    chat = lines(model, 2, prefix="lp")
    chat[0]["body"] |= {"logprobs": True, "top_logprobs": 2}
    text = lines(model, 1, url="/v1/completions", prefix="tlp")
    text[0]["body"]["logprobs"] = 3
    embed = [{"custom_id": f"emb-{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": model, "input": f"text number {i}", "dimensions": 8}}
             for i in range(3)]  # fmt: skip
    batches = {}
    for name, requests, endpoint in (("chat", chat, "/v1/chat/completions"),
                                 ("text", text, "/v1/completions"),
                                 ("embed", embed, "/v1/embeddings")):  # fmt: skip
        f = upload(client, tmp_path, requests, f"{name}.jsonl")
        batches[name] = client.batches.create(input_file_id=f.id, endpoint=endpoint,
                                              completion_window="24h").id  # fmt: skip
    done = {name: wait_done(client, bid) for name, bid in batches.items()}
    assert {b.status for b in done.values()} == {"completed"}

    def result(name: str) -> dict[str, Any]:
        table = pq.read_table(done[name].metadata["batchgen_result"]).to_pylist()
        return {row["id"]: row for row in table}

    by_id = result("chat")
    bodies = {line["custom_id"]: line["response"]["body"]
              for line in jsonl(client, done["chat"].output_file_id)}  # fmt: skip
    content = bodies["lp-0"]["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [t["token"] for t in by_id["lp-0"]["logprobs"]]
    assert [c["logprob"] for c in content] == [t["logprob"] for t in by_id["lp-0"]["logprobs"]]
    assert all(len(c["top_logprobs"]) == 2 and c["bytes"] == list(c["token"].encode())
               for c in content)  # fmt: skip
    assert bodies["lp-1"]["choices"][0]["logprobs"] is None

    by_id = result("text")
    body = jsonl(client, done["text"].output_file_id)[0]["response"]["body"]
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [t["token"] for t in by_id["tlp-0"]["logprobs"]]
    assert [len(top) for top in logprobs["top_logprobs"]] == [3] * len(logprobs["tokens"])
    assert "".join(logprobs["tokens"]).startswith(body["choices"][0]["text"][:1])

    by_id = result("embed")
    for line in jsonl(client, done["embed"].output_file_id):
        body = line["response"]["body"]
        assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
        assert body["data"][0]["embedding"] == by_id[line["custom_id"]]["embedding"]
        assert len(body["data"][0]["embedding"]) == 8
        assert body["usage"]["prompt_tokens"] == by_id[line["custom_id"]]["prompt_tokens"] > 0


def test_a_batch_past_its_tenants_queue_limit_fails_with_openais_code(stack, client, tmp_path):
    """The batch's estimated input tokens would take its tenant (the key's own, as no keys
    file names one) past max_enqueued_tokens: the batch fails, nothing is queued; under the
    limit it runs, with the priority class its metadata names and its window as deadline."""
    conn: Any = redis.Redis.from_url(stack.redis_url)
    keys = Keys("bg")
    who = KeyRing.load([KEY]).find(KEY)
    assert who is not None and who.tenant.startswith("key-")
    tenants.save(conn, keys, tenants.Tenant(who.tenant, max_enqueued_tokens=20))
    try:
        rows = lines(str(stack.model), 4)
        file = upload(client, tmp_path, rows, "quota.jsonl")
        refused = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")  # fmt: skip
        refused = wait_done(client, refused.id)
        assert refused.status == "failed"
        (error,) = refused.errors.data
        assert error.code == "token_limit_exceeded"
        assert error.message.startswith(f"Enqueued token limit reached for {stack.model}")
        assert conn.hget(keys.jobs, refused.id) is None  # nothing was queued
        with pytest.raises(openai.BadRequestError) as caught:
            client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"priority": "high"})  # fmt: skip
        assert caught.value.body["param"] == "metadata"  # type: ignore[index]
        # a key that is not an admin's may ask for the normal class at most by default
        for priority, limit in (("1000", 0), ("1", 0)):
            with pytest.raises(openai.BadRequestError) as caught:
                client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                      completion_window="24h", metadata={"priority": priority})  # fmt: skip
            assert caught.value.body == {
                "message": f"priority {priority}: tenant {who.tenant!r} may ask for class {limit} "
                "at most (an API key's tenant without --max-priority); nothing was queued",
                "type": "invalid_request_error", "param": "metadata", "code": "invalid_priority",
            }  # fmt: skip
    finally:
        tenants.save(conn, keys, tenants.Tenant(who.tenant, max_priority=3))
    with pytest.raises(openai.BadRequestError) as caught:
        client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                              completion_window="24h", metadata={"priority": "4"})  # fmt: skip
    assert caught.value.body["message"] == (  # type: ignore[index]
        f"priority 4: tenant {who.tenant!r} may ask for class 3 at most (its --max-priority); "
        "nothing was queued"
    )
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"priority": "3"})  # fmt: skip
    batch = wait_done(client, batch.id)
    assert batch.status == "completed"
    job = load_job(conn, keys, batch.id)
    assert (job.priority, job.deadline, job.tenant) == (3, float(batch.expires_at), who.tenant)
    usage = batch.usage
    assert (usage.input_tokens, usage.output_tokens) == (job.prompt_tokens, job.completion_tokens)
