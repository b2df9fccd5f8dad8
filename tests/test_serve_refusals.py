"""``batchgen serve`` while Redis answers an error reply that means "cannot serve now"
(OOM, READONLY, MISCONF, BUSY, LOADING; NOSCRIPT after each, tests/chaos/refusals.py):
a request Redis refuses gets a 503 whose JSON error says why (never a 500 or a
traceback), /api/overview carries `batchgen status`'s outage line while reads still
work, the server stays up and logs each outage once, and every batch completes with
exactly its rows once Redis serves again. A real serve, a CPU worker, one redis-server."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from functools import partial
from pathlib import Path
from typing import Any

import openai
from openai import OpenAI

from batchgen.jobs.redis.redis_server import RedisServer
from tests.chaos.refusals import Refusal, answers_loading
from tests.serve_stack import KEY, Stack, wait_for

CODES = ("OOM", "READONLY", "MISCONF", "BUSY", "LOADING")
REFUSE_READS = ("BUSY", "LOADING")  # the others refuse writes only
WAITING = "the sweep of batches waits for Redis: "
RESUMED = "the sweep of batches resumes: Redis serves again"


def api(stack: Stack, path: str) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(stack.base + path, headers={"Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def status_is(c: OpenAI, batch_id: str, status: str) -> bool:
    return c.batches.retrieve(batch_id).status == status


def serve_log(tmp_path: Path) -> str:
    return (tmp_path / "serve.log").read_text()  # whole (Stack.log: its end only)


def batch_of(c: OpenAI, model: str, tag: str) -> str:
    rows = [{"custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": model, "prompt": f"{tag} {i}", "max_tokens": 200,
                      "ignore_eos": True}}
            for i in range(3)]  # long enough that the test sees it in_progress  # fmt: skip
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    file = c.files.create(file=("in.jsonl", data), purpose="batch")
    return c.batches.create(input_file_id=file.id, endpoint="/v1/completions",
                            completion_window="24h").id  # fmt: skip


def assert_refused(exc: openai.APIStatusError, code: str) -> None:
    assert exc.status_code == 503, (exc.status_code, exc.body)
    error = exc.response.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "redis_unavailable"), error
    assert re.match(rf"Redis cannot serve now: {code} ", error["message"]), error


def test_serve_answers_503_while_redis_refuses_and_every_batch_completes(tmp_path: Path, toy_model):
    server = RedisServer(tmp_path / "redis", extra_args=("--appendfsync", "always"))
    server.start()
    stack = Stack(server.url, tmp_path)
    model = str(toy_model("llama"))
    try:
        (tmp_path / "keys.txt").write_text(f"{KEY} ops admin\n")
        serve = stack.serve("--keys-file", str(tmp_path / "keys.txt"), "--refresh", "0.3")
        stack.worker(Path(model), "--max-num-seqs", "2")
        c = OpenAI(base_url=stack.base + "/v1", api_key=KEY, max_retries=0, timeout=60)
        batches = {}
        for code in CODES:
            batches[code] = batch_of(c, model, code.lower())  # submitted before the outage
            wait_for(partial(status_is, c, batches[code], "in_progress"), 60,
                     "the batch to be validated")  # fmt: skip
            refusal = Refusal(code, server, tmp_path)
            refusal.refuse()
            try:
                status, overview = api(stack, "/api/overview")
                if code in REFUSE_READS:
                    assert status == 503 and re.match(
                        rf"Redis cannot serve now: {code} ", overview["error"]["message"]
                    ), overview
                else:
                    assert status == 200, overview
                    assert overview["outage"].startswith(f"Redis refuses writes ({code}: ")
                    assert c.batches.retrieve(batches[code]).status != "completed"
                try:
                    c.files.create(file=("in.jsonl", b"{}\n"), purpose="batch")
                    # LOADING ends on its own: an upload after it is rightly taken
                    assert code == "LOADING" and not answers_loading(server.url), (
                        f"an upload was taken under {code}"
                    )
                except openai.APIStatusError as exc:
                    assert_refused(exc, code)
                wait_for(lambda: serve_log(tmp_path).count(WAITING) == len(batches), 30,
                         f"serve to log the {code} outage")  # fmt: skip
                assert serve.poll() is None, serve_log(tmp_path)
            finally:
                refusal.allow()
            wait_for(lambda: serve_log(tmp_path).count(RESUMED) == len(batches), 30,
                     f"serve to log the end of the {code} outage")  # fmt: skip
            assert api(stack, "/api/overview")[1]["outage"] is None
        for code, batch_id in batches.items():
            wait_for(partial(status_is, c, batch_id, "completed"), 300,
                     f"the {code} batch to complete")  # fmt: skip
            done = c.batches.retrieve(batch_id)
            assert done.output_file_id is not None and done.error_file_id is None
            out = [json.loads(x) for x in c.files.content(done.output_file_id).text.splitlines()]
            assert [r["custom_id"] for r in out] == [f"{code.lower()}-{i}" for i in range(3)]
            assert all(r["response"]["status_code"] == 200 for r in out), out
        log = serve_log(tmp_path)
        assert log.count(WAITING) == log.count(RESUMED) == len(CODES), (
            log
        )  # once an outage, not a tick
        assert all(log.count(f"{WAITING}Redis refuses writes ({code}: ") == 1
                   for code in ("OOM", "READONLY", "MISCONF")), log  # fmt: skip
        assert "Traceback" not in log and " 500 " not in log, log
        assert serve.poll() is None
    finally:
        stack.stop()
        server.kill()
