"""Uploads stream to the files store: a 150 MB upload sent slowly leaves the server's
memory flat, and one over the limit gets 413 and leaves nothing behind."""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest
import redis
from openai import OpenAI

from batchgen.jobs.redis.keys import Keys
from batchgen.serve.files import FileStore
from tests.serve_stack import KEY, Stack, wait_for

MB = 1 << 20
BOUNDARY = "batchgen-test-boundary"


@pytest.fixture
def stack(redis_url: str, tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(redis_url, tmp_path)
    try:
        stack.serve("--api-key", KEY)
        yield stack
    finally:
        stack.stop()


class PeakRSS:
    """The highest resident set size of a process, sampled every 5 ms in a thread."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = self.process.memory_info().rss
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakRSS:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()

    def _run(self) -> None:
        while not self.done.wait(0.005):
            self.peak = max(self.peak, self.process.memory_info().rss)


def multipart(chunks: Iterator[bytes], name: str) -> Iterator[bytes]:
    yield (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
           f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
           "Content-Type: application/jsonl\r\n\r\n").encode()  # fmt: skip
    yield from chunks
    yield f"\r\n--{BOUNDARY}--\r\n".encode()


def post_file(stack: Stack, body: Iterator[bytes], length: int | None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=120)
    headers = {"Authorization": f"Bearer {KEY}",
               "Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}  # fmt: skip
    if length is not None:
        headers["Content-Length"] = str(length)
    conn.request("POST", "/v1/files", body=body, headers=headers,
                 encode_chunked=length is None)  # fmt: skip
    reply = conn.getresponse()
    return reply.status, json.loads(reply.read())


def stored(stack: Stack) -> list[str]:
    return sorted(os.listdir(stack.tmp / "files"))


def test_a_slow_150_mb_upload_streams_without_taking_memory(stack):
    client = OpenAI(base_url=stack.base + "/v1", api_key=KEY, max_retries=0)
    client.files.create(file=("warm.jsonl", b'{"x": 1}\n'), purpose="batch")  # code paths loaded
    assert stack.server is not None
    digest = hashlib.sha256()
    answered: list[float] = []
    block = (b'{"custom_id": "x", "body": "' + b"y" * 993 + b'"}\n') * 1024  # 1 MiB of lines
    assert len(block) == MB

    def slow_chunks() -> Iterator[bytes]:
        for i in range(150):
            digest.update(block)
            yield block
            time.sleep(0.01)  # a slow client: the server holds what it received so far
            if i == 75:  # half way: the server still answers other requests at once
                start = time.monotonic()
                request = urllib.request.Request(stack.base + "/v1/files",
                                                 headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
                with urllib.request.urlopen(request, timeout=10) as reply:
                    assert reply.status == 200
                answered.append(time.monotonic() - start)

    with PeakRSS(stack.server.pid) as rss:
        baseline = rss.peak
        status, obj = post_file(stack, multipart(slow_chunks(), "big.jsonl"), None)
    assert status == 200, obj
    assert (obj["bytes"], obj["filename"], obj["purpose"]) == (150 * MB, "big.jsonl", "batch")
    path = stack.tmp / "files" / obj["id"]
    assert path.stat().st_size == 150 * MB
    with path.open("rb") as f:
        assert hashlib.file_digest(f, "sha256").hexdigest() == digest.hexdigest()
    grew = (rss.peak - baseline) / MB
    print(
        f"server RSS: {baseline / MB:.0f} MB before, peak {rss.peak / MB:.0f} MB during the upload"
    )
    assert grew < 40, f"the server's RSS grew by {grew:.0f} MB during a 150 MB upload"
    assert answered and answered[0] < 2.0


def test_an_upload_over_the_limit_is_413_and_leaves_nothing(stack, tmp_path):
    client = OpenAI(base_url=stack.base + "/v1", api_key=KEY, max_retries=0)
    before = stored(stack)
    big = tmp_path / "big.jsonl"
    with big.open("wb") as f:
        f.truncate(200 * MB + 1)  # one byte over the default limit (sparse: nothing to write)
    assert stack.server is not None
    with PeakRSS(stack.server.pid) as rss:
        baseline = rss.peak
        with pytest.raises(openai.APIStatusError) as caught, big.open("rb") as f:
            client.files.create(file=f, purpose="batch")  # its Content-Length is over
        # no Content-Length (chunked): refused once the file part passes the limit
        status, body = post_file(stack, multipart(iter([b"z" * MB] * 201), "c.jsonl"), None)
    assert caught.value.status_code == 413
    assert caught.value.body["code"] == "file_too_large"  # type: ignore[index]
    assert status == 413 and body["error"]["code"] == "file_too_large"
    assert "over this server's limit of 209,715,200 bytes" in body["error"]["message"]
    assert stored(stack) == before  # no file, no temp file
    print(f"server RSS: {baseline / MB:.0f} MB before, peak {rss.peak / MB:.0f} MB during both")
    assert (rss.peak - baseline) / MB < 40
    assert client.files.list().data == []


def raw_upload(stack: Stack, head: bytes, length: int) -> socket.socket:
    """A socket that has sent the request line, headers and ``head`` of a multipart body
    whose Content-Length says ``length``."""
    sock = socket.create_connection(("127.0.0.1", stack.port), timeout=60)
    sock.sendall(f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1:{stack.port}\r\n"
                 f"Authorization: Bearer {KEY}\r\n"
                 f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
                 f"Content-Length: {length}\r\n\r\n".encode() + head)  # fmt: skip
    return sock


def reply_of(sock: socket.socket) -> tuple[int, dict]:
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def temp_files(stack: Stack) -> list[str]:
    return [n for n in stored(stack) if n.startswith(".tmp-")]


def test_a_body_without_its_closing_boundary_is_400_and_stores_nothing(stack):
    body = b"".join(multipart(iter([b'{"custom_id": "a"}\n' * 1000]), "cut.jsonl"))
    cut = body[: body.rindex(b"\r\n--")]  # every byte but the closing boundary
    sock = raw_upload(stack, cut, len(cut))  # and a Content-Length that matches what came
    status, reply = reply_of(sock)
    assert (status, reply["error"]["code"]) == (400, "incomplete_upload")
    assert "ended before its closing boundary" in reply["error"]["message"]
    # chunked, the last chunk sent without the closing boundary: the same
    status, reply = post_file(stack, iter([cut]), None)
    assert (status, reply["error"]["code"]) == (400, "incomplete_upload")
    assert stored(stack) == []  # no file, no temp file
    client = OpenAI(base_url=stack.base + "/v1", api_key=KEY, max_retries=0)
    assert client.files.list().data == []


def test_a_serve_killed_mid_upload_leaves_no_temp_file_behind(stack, redis_url, tmp_path):
    sock = raw_upload(stack, next(multipart(iter([]), "big.jsonl")) + b"x" * MB, 100 * MB)
    wait_for(lambda: temp_files(stack) and os.path.getsize(
        stack.tmp / "files" / temp_files(stack)[0]) > 0, 30, "the upload's temp file")  # fmt: skip
    (dead,) = temp_files(stack)
    assert stack.server is not None
    os.killpg(stack.server.pid, signal.SIGKILL)
    stack.server.wait()
    sock.close()
    # a live server's upload in the same folder is left alone while it runs
    other = Stack(redis_url, tmp_path)
    other.tmp = stack.tmp  # the same files dir
    try:
        other.serve("--api-key", KEY, "--lease", "2")
        live = raw_upload(other, next(multipart(iter([]), "live.jsonl")) + b"y" * MB, 50 * MB)
        wait_for(lambda: dead not in temp_files(other), 30, "the dead upload's temp file to go")
        (running,) = temp_files(other)
        time.sleep(3)  # sweeps run every second: the running upload's temp file stays
        assert temp_files(other) == [running]
        live.close()
        wait_for(lambda: temp_files(other) == [], 30, "the dropped upload's temp file to go")
    finally:
        other.stop()


def test_the_sweep_removes_dead_servers_temp_files_and_nothing_else(redis_url, tmp_path):
    """Only a server's tagged upload whose server is gone goes, however old the others."""
    conn = redis.Redis.from_url(redis_url)
    keys = Keys("sweep-test")
    store = FileStore(conn, keys, str(tmp_path), "alive")
    conn.set(keys.serve_instance("alive"), "1")
    names = [".tmp-serve_alive_0a-file-1", ".tmp-serve_gone_0b-file-2", ".tmp-0c-file-3",
             "file-4"]  # fmt: skip
    for name in names:
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (0, 0))  # untouched since 1970
    assert store.sweep(lambda _: False) == 0  # no file record expired
    assert sorted(os.listdir(tmp_path)) == [".tmp-0c-file-3", ".tmp-serve_alive_0a-file-1",
                                            "file-4"]  # fmt: skip


def test_form_fields_are_bounded_in_number_and_memory(stack):
    """200 MB of 4 KB form fields (the old server held every one: 84 MB -> 288 MB RSS)."""
    field = (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="f{{}}"\r\n\r\n'
             + "v" * 4000 + "\r\n")  # fmt: skip
    count = 200 * MB // len(field)
    assert stack.server is not None
    with PeakRSS(stack.server.pid) as rss:
        baseline = rss.peak
        sock = raw_upload(stack, b"", count * (len(field) + 4))
        sent = 0
        with contextlib.suppress(OSError):  # the server answers and closes mid-way
            for i in range(count):
                sock.sendall(field.format(i).encode())
                sent += 1
        status, reply = reply_of(sock)
    grew = (rss.peak - baseline) / MB
    print(f"sent {sent} of {count} fields; server RSS {baseline / MB:.0f} MB before, peak "
          f"{rss.peak / MB:.0f} MB")  # fmt: skip
    assert (status, reply["error"]["code"]) == (400, "invalid_request")
    assert reply["error"]["message"] == "an upload takes the file and at most 16 other form fields"
    assert grew < 20
    # one field is bounded: its 4,097th byte ends the upload
    long = f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n'.encode()
    sock = raw_upload(stack, long + b"b" * 4097, 10 * MB)
    status, reply = reply_of(sock)
    assert (status, reply["error"]["message"], reply["error"]["param"]) == (
        400, "form field 'purpose' is too long", "purpose")  # fmt: skip
    # a part's headers are bounded too
    huge = f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="x"\r\nX-Pad: '.encode()
    sock = raw_upload(stack, huge + b"p" * 20_000 + b"\r\n\r\nv\r\n", 10 * MB)
    status, reply = reply_of(sock)
    assert (status, reply["error"]["message"]) == (
        400, "the multipart body is malformed: Maximum header size exceeded")  # fmt: skip
    assert stored(stack) == []
