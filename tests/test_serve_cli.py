"""``batchgen serve``'s keys: from --api-key or BATCHGEN_API_KEYS; without any, loopback only."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchgen.cli import main
from tests.serve_stack import Stack


def get(url: str, key: str | None = None, data: bytes | None = None,
        content_type: str = "application/json") -> tuple[int, dict]:  # fmt: skip
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if data is not None:
        headers["Content-Type"] = content_type
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers)) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_without_a_key_only_loopback_is_allowed(monkeypatch):
    monkeypatch.delenv("BATCHGEN_API_KEYS", raising=False)
    result = CliRunner().invoke(main, ["serve", "--host", "0.0.0.0"])
    assert result.exit_code == 2
    assert "--host 0.0.0.0: without an API key the server listens on loopback only" in result.output


def test_without_a_key_it_says_so_and_asks_for_none(redis_url: str, tmp_path: Path):
    stack = Stack(redis_url, tmp_path, env={"BATCHGEN_API_KEYS": ""})
    try:
        stack.serve()
        assert get(stack.base + "/v1/files") == (200, {"object": "list", "data": [],
                   "first_id": None, "last_id": None, "has_more": False})  # fmt: skip
        assert "no API key given: listening on loopback only" in stack.log("serve")
    finally:
        stack.stop()


@pytest.mark.parametrize("given", ["env", "flags"])
def test_keys_come_from_flags_or_the_environment(redis_url: str, tmp_path: Path, given: str):
    stack = Stack(
        redis_url, tmp_path, env={"BATCHGEN_API_KEYS": "k1, k2" if given == "env" else ""}
    )
    try:
        stack.serve(*(["--api-key", "k1", "--api-key", "k2"] if given == "flags" else []))
        assert get(stack.base + "/v1/batches", "k2")[0] == 200
        assert get(stack.base + "/v1/batches", "k1")[0] == 200
        status, body = get(stack.base + "/v1/batches", "k3")
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert get(stack.base + "/api/overview")[0] == 401
        # hostile or wrong requests: OpenAI-shaped errors, never a traceback
        not_json = (400, "the body must be a JSON object, sent as Content-Type: application/json")
        status, body = get(stack.base + "/v1/batches", "k1", b"{not json")
        assert (status, body["error"]["message"]) == not_json
        assert body["error"]["code"] == "invalid_request"
        batch = (b'{"input_file_id": "file-x", "endpoint": "/v1/completions", '
                 b'"completion_window": "24h", "not_an_openai_field": 1}')  # fmt: skip
        status, body = get(stack.base + "/v1/batches", "k1", batch)  # unknown fields: ignored
        assert (status, body["error"]["message"]) == (404, "No such file: 'file-x'")
        status, body = get(stack.base + "/v1/batches", "k1", batch, "text/plain")
        assert (status, body["error"]["message"]) == not_json
        status, body = get(stack.base + "/v1/files", "k1", b"plain body")
        assert status == 400 and "multipart/form-data" in body["error"]["message"]
        assert get(stack.base + "/v1/nothing-here", "k1")[1]["error"]["type"] == "not_found_error"
    finally:
        stack.stop()


def test_a_bad_files_dir_is_one_line(redis_url: str, tmp_path: Path):
    (tmp_path / "plain").write_text("a regular file")
    result = CliRunner().invoke(main, ["serve", "--api-key", "k", "--port", "0", "--redis",
                                       redis_url, "--files-dir", str(tmp_path / "plain" / "x")])  # fmt: skip
    assert result.exit_code == 2
    assert result.output == (f"batchgen: error: --files-dir {tmp_path / 'plain' / 'x'}: cannot "
                             "use it as a folder (Not a directory)\n")  # fmt: skip
