"""``--files-dir`` on an object store (moto's real S3 API): uploads stream there, content
streams back, and a batch's input is read from there for validation."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.fs as pafs
import pytest
from openai import OpenAI

from tests.serve_stack import KEY, Stack


@pytest.fixture
def stack(redis_url: str, tmp_path: Path, s3_endpoint: str) -> Iterator[Stack]:
    stack = Stack(redis_url, tmp_path)
    files = f"s3://batchgen-test/serve-files?endpoint_override={s3_endpoint}&scheme=http"
    try:
        stack.serve("--api-key", KEY, "--files-dir", files)  # the later --files-dir wins
        yield stack
    finally:
        stack.stop()


def test_files_live_on_the_object_store(stack, s3_endpoint, tmp_path):
    client = OpenAI(base_url=stack.base + "/v1", api_key=KEY, max_retries=0)
    rows = [{"custom_id": f"s{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "not-served", "prompt": f"p{i}"}} for i in range(3)]  # fmt: skip
    data = "".join(json.dumps(r) + "\n" for r in rows).encode() * 2000  # ~0.5 MB
    obj = client.files.create(file=("in.jsonl", data), purpose="batch")
    s3 = pafs.S3FileSystem(endpoint_override=s3_endpoint, scheme="http")
    info = s3.get_file_info(f"batchgen-test/serve-files/{obj.id}")
    assert (info.type, info.size) == (pafs.FileType.File, len(data))
    assert not (tmp_path / "files").exists()  # nothing went to the local default
    assert client.files.content(obj.id).content == data
    # validation reads the input back from the store: the duplicate ids and the model
    batch = client.batches.create(input_file_id=obj.id, endpoint="/v1/completions",
                                  completion_window="24h")  # fmt: skip
    while (batch := client.batches.retrieve(batch.id)).status == "validating":
        time.sleep(0.2)
    assert batch.status == "failed"
    assert batch.errors is not None and batch.errors.data
    assert (batch.errors.data[0].line, batch.errors.data[0].code) == (4, "duplicate_custom_id")
    assert client.files.delete(obj.id).deleted
    assert s3.get_file_info(f"batchgen-test/serve-files/{obj.id}").type == pafs.FileType.NotFound
