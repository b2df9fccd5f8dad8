"""Tenants: keys that cannot touch each other's batches, files and jobs, tried for real with
the official ``openai`` client per key against a live ``batchgen serve`` and a CPU worker.

Keys: two of team-a (from a keys file), one of team-b, an admin (ops), and a bare
``--api-key`` (its own tenant). Another tenant's object is a 404 in OpenAI's error
shape on the API, on /api/ and on the dashboard; a job submitted from the CLI is
visible to admins only. (The README's Security section states these.)
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
from openai import OpenAI

from batchgen.jobs.ops.job_record import load_job
from batchgen.jobs.ops.lifecycle import JobState
from batchgen.jobs.ops.submission import submit
from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.schema.sampling import DEFAULTS
from tests.serve_stack import Stack, private_stack

KEYS_FILE = """\
# key        tenant   role
sk-a1        team-a
sk-a2        team-a   # a second key of the same team
sk-b         team-b
sk-root      ops      admin
"""
DONE = ("completed", "failed", "cancelled", "expired")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, toy_model) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("serve-tenants")
    (tmp / "keys.txt").write_text(KEYS_FILE)
    with private_stack(tmp, toy_model("llama")) as stack:
        stack.serve("--keys-file", str(tmp / "keys.txt"), "--api-key", "sk-solo")
        stack.worker(stack.model, "--max-num-seqs", "4")  # type: ignore[attr-defined]
        yield stack


def client(stack: Stack, key: str) -> OpenAI:
    return OpenAI(base_url=stack.base + "/v1", api_key=key, max_retries=0)


def requests(model: str, n: int, prefix: str) -> bytes:
    lines = [{"custom_id": f"{prefix}-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": model, "prompt": f"secret prompt {prefix} {i}", "max_tokens": 4}}
             for i in range(n)]  # fmt: skip
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def done(c: OpenAI, batch_id: str) -> Any:
    deadline = time.monotonic() + 300
    while (batch := c.batches.retrieve(batch_id)).status not in DONE:
        assert time.monotonic() < deadline, batch.status
        time.sleep(0.3)
    return batch


def api(stack: Stack, path: str, key: str, method: str = "GET") -> tuple[int, Any]:
    request = urllib.request.Request(stack.base + path, method=method,
                                     headers={"Authorization": f"Bearer {key}"})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def not_found(call: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """The 404 ``call(*args, **kwargs)`` raises, in OpenAI's shape: its error object."""
    with pytest.raises(openai.NotFoundError) as caught:
        call(*args, **kwargs)
    error = caught.value.body
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "not_found_error"
    return error


def test_a_key_sees_only_its_tenants_batches_and_files(stack):
    model = str(stack.model)
    a1, a2, b, root, solo = (client(stack, k) for k in ("sk-a1", "sk-a2", "sk-b", "sk-root",
                                                         "sk-solo"))  # fmt: skip
    a_in = a1.files.create(file=("a.jsonl", requests(model, 3, "a")), purpose="batch")
    a_batch = a1.batches.create(input_file_id=a_in.id, endpoint="/v1/completions",
                                completion_window="24h")  # fmt: skip
    b_in = b.files.create(file=("b.jsonl", requests(model, 2, "b")), purpose="batch")
    a_batch = done(a2, a_batch.id)  # the team's other key follows it
    assert a_batch.status == "completed" and a_batch.request_counts.completed == 3
    out_id = a_batch.output_file_id

    # team-b (and the bare --api-key, a tenant of its own) see nothing of team-a's
    for other in (b, solo):
        assert [f.id for f in other.files.list()] == ([b_in.id] if other is b else [])
        assert [x.id for x in other.batches.list()] == []
        for file_id in (a_in.id, out_id):
            error = not_found(other.files.retrieve, file_id)
            assert error["message"] == f"No such file: '{file_id}'"
            never = not_found(other.files.retrieve, "file-never-made")  # told apart by nothing
            assert error == never | {"message": f"No such file: '{file_id}'"}
            not_found(other.files.content, file_id)  # the prompts, the outputs
            not_found(other.files.delete, file_id)
        error = not_found(other.batches.retrieve, a_batch.id)
        assert error["message"] == f"No such batch: '{a_batch.id}'"
        never = not_found(other.batches.retrieve, "batch_never_made")
        assert error == never | {"message": error["message"]}
        not_found(other.batches.cancel, a_batch.id)
        not_found(other.batches.create, input_file_id=a_in.id, endpoint="/v1/completions",
                  completion_window="24h")  # fmt: skip
    # ... and their tries changed nothing
    assert a1.files.retrieve(a_in.id).id == a_in.id
    assert b"secret prompt a 0" in a2.files.content(a_in.id).content
    assert len(a2.files.content(out_id).text.splitlines()) == 3
    assert {f.id for f in a2.files.list()} == {a_in.id, out_id}
    assert [x.id for x in a2.batches.list()] == [a_batch.id]
    not_found(a1.files.retrieve, b_in.id)
    # the admin sees every tenant's
    assert {a_in.id, out_id, b_in.id} <= {f.id for f in root.files.list()}
    assert root.batches.retrieve(a_batch.id).status == "completed"
    assert b"secret prompt b" in root.files.content(b_in.id).content


def test_jobs_on_the_dashboard_api_are_scoped_and_cli_jobs_are_admin_only(stack, tmp_path):
    conn: Any = redis.Redis.from_url(stack.redis_url)
    keys = Keys("bg")
    (tmp_path / "cli.jsonl").write_text('{"prompt": "a job from the CLI"}\n')
    submit(conn, keys, source_path=str(tmp_path / "cli.jsonl"), model="no-worker-model",
           output=str(tmp_path / "cli-out"), defaults=dict(DEFAULTS), job_id="cli-job")  # fmt: skip
    b = client(stack, "sk-b")
    b_in = b.files.create(file=("b.jsonl", requests(str(stack.model), 2, "bj")), purpose="batch")
    b_batch = done(b, b.batches.create(input_file_id=b_in.id, endpoint="/v1/completions",
                                       completion_window="24h").id)  # fmt: skip
    assert load_job(conn, keys, b_batch.id).api_tenant == "team-b"
    assert load_job(conn, keys, "cli-job").api_tenant == ""

    def job_ids(key: str) -> set[str]:
        status, jobs = api(stack, "/api/jobs", key)
        assert status == 200
        return {j["job_id"] for j in jobs}

    assert job_ids("sk-b") == {b_batch.id}
    assert b_batch.id not in job_ids("sk-a1") and "cli-job" not in job_ids("sk-a1")
    assert {b_batch.id, "cli-job"} <= job_ids("sk-root")
    status, overview = api(stack, "/api/overview", "sk-a1")
    assert status == 200 and b_batch.id not in {j["job_id"] for j in overview["jobs"]}
    status, points = api(stack, "/api/series", "sk-a1")
    assert status == 200 and all(b_batch.id not in p["jobs"] for p in points)
    _, everyone = api(stack, "/api/series", "sk-root")
    assert [p["fleet"] for p in points] == [p["fleet"] for p in everyone[: len(points)]]
    for key in ("sk-a1", "sk-b", "sk-solo"):  # the fleet's workers: every key sees them
        status, workers = api(stack, "/api/workers", key)
        assert status == 200 and [w["model"] for w in workers] == [str(stack.model)]
    for key in ("sk-a1", "sk-b", "sk-solo"):  # a CLI job: only admins
        for path, method in (("/api/jobs/cli-job", "GET"), ("/api/jobs/cli-job/cancel", "POST")):
            status, body = api(stack, path, key, method)
            assert (status, body["error"]["type"]) == (404, "not_found_error"), (key, path)
            assert body["error"]["message"] == "No such job: 'cli-job'"
    status, body = api(stack, f"/api/jobs/{b_batch.id}", "sk-a1")
    assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}
    assert load_job(conn, keys, "cli-job").state == JobState.QUEUED  # untouched
    assert api(stack, "/api/jobs/cli-job/cancel", "sk-root", "POST") == (
        200, {"job_id": "cli-job", "state": "cancelling"})  # fmt: skip


def test_the_dashboard_shows_a_signed_in_key_its_own_tenant(stack):
    """Signed in through the login form, team-a's session sees team-a's jobs only."""
    form = urllib.parse.urlencode({"key": "sk-a1"}).encode()
    opener = urllib.request.build_opener(_NoRedirect)
    request = urllib.request.Request(stack.base + "/login", data=form,
                                     headers={"Origin": stack.base})  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as redirect:
        opener.open(request, timeout=10)
    assert redirect.value.code == 303
    cookie = redirect.value.headers["set-cookie"].split(";")[0]
    assert cookie.startswith("batchgen_session=") and "sk-a1" not in cookie
    a2 = client(stack, "sk-a2")
    a_in = a2.files.create(file=("d.jsonl", requests(str(stack.model), 1, "d")), purpose="batch")
    batch = done(a2, a2.batches.create(input_file_id=a_in.id, endpoint="/v1/completions",
                                       completion_window="24h").id)  # fmt: skip
    with urllib.request.urlopen(urllib.request.Request(stack.base + "/", headers={
            "Cookie": cookie}), timeout=10) as reply:  # fmt: skip
        assert b'id="jobs"' in reply.read()  # the dashboard, not the sign-in form
    request = urllib.request.Request(stack.base + "/api/jobs", headers={"Cookie": cookie})
    with urllib.request.urlopen(request, timeout=10) as reply:
        shown = {j["job_id"] for j in json.loads(reply.read())}
    conn: Any = redis.Redis.from_url(stack.redis_url)
    _, everything = api(stack, "/api/jobs", "sk-root")
    team_a = {j["job_id"] for j in everything
              if load_job(conn, Keys("bg"), j["job_id"]).api_tenant == "team-a"}  # fmt: skip
    assert batch.id in shown and shown == team_a and len(everything) > len(team_a)


def test_a_key_is_told_why_the_workers_are_busier_than_its_jobs(stack, tmp_path):
    """The one-key setup: the workers hold 600 requests of the user's own CLI job, which
    the key does not see; the overview (the page shows it) says so and how to see it."""
    conn: Any = redis.Redis.from_url(stack.redis_url)
    (tmp_path / "cli.jsonl").write_text('{"prompt": "a job from the CLI"}\n')
    submit(conn, Keys("bg"), source_path=str(tmp_path / "cli.jsonl"), model="no-worker-model",
           output=str(tmp_path / "busy-out"), defaults=dict(DEFAULTS), job_id="cli-busy")  # fmt: skip
    assert api(stack, "/api/overview", "sk-solo")[1]["notice"] is None  # nothing held yet
    payload = {"name": "cli-worker", "model": "no-worker-model", "in_flight": {"cli-busy": 600}}
    conn.set("bg:worker:cli-worker", json.dumps(payload), ex=60)
    conn.zadd("bg:workers", {"cli-worker": time.time()})
    try:
        for key in ("sk-solo", "sk-b"):
            status, overview = api(stack, "/api/overview", key)
            assert status == 200 and "cli-busy" not in {j["job_id"] for j in overview["jobs"]}
            assert overview["notice"] == (
                "The live workers hold 600 requests of jobs this key does not see: jobs "
                "submitted with the CLI (batchgen submit, batchgen run) belong to no tenant "
                "and show only to an admin key, as do other tenants' jobs. Sign in with an "
                "admin key to see them (a --keys-file line: KEY TENANT admin)."
            )
        status, overview = api(stack, "/api/overview", "sk-root")  # an admin sees the job
        assert overview["notice"] is None and "cli-busy" in {j["job_id"] for j in overview["jobs"]}
    finally:
        conn.delete("bg:worker:cli-worker")
        conn.zrem("bg:workers", "cli-worker")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def test_a_keys_file_mistake_is_one_line(tmp_path: Path, redis_url: str):
    from click.testing import CliRunner

    from batchgen.cli import main

    for text, message in (
        ("sk-x team a b\n", "line 1: write KEY TENANT, or KEY TENANT admin"),
        ("sk-x bad/name\n", "line 1: a tenant is 1-64 letters"),
        ("sk-x t\nsk-x u\n", "line 2: this key is listed twice"),
        ("# nothing\n", "it lists no key"),
    ):
        (tmp_path / "k.txt").write_text(text)
        result = CliRunner().invoke(main, ["serve", "--keys-file", str(tmp_path / "k.txt"),
                                           "--redis", redis_url, "--port", "0"])  # fmt: skip
        assert result.exit_code == 2 and message in result.output, result.output
        assert result.output.count("\n") == 1
