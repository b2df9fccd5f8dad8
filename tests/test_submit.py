"""submit: whole-file validation, atomic chunks, idempotent and resumable, queue full."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis

from batchgen.jobs.ops import chunk_append
from batchgen.jobs.ops.fair_share import backlog
from batchgen.jobs.ops.job_record import load_job
from batchgen.jobs.ops.lifecycle import JobState
from batchgen.jobs.ops.submission import submit
from batchgen.jobs.redis.keys import Keys, queue_name
from batchgen.jobs.redis.redis_server import RedisServer
from batchgen.jobs.schema.errors import InvalidInput, JobConflict, QueueFull
from batchgen.jobs.schema.sampling import COMPLETION_MAX_TOKENS, DEFAULTS

KEYS = Keys("bg")


def rconn(url: str, **kwargs: Any) -> Any:
    """A client typed loosely: redis-py's reply unions make tests unreadable."""
    return redis.Redis.from_url(url, **kwargs)


def write_prompts(path: Path, n: int, start: int = 0, pad: int = 0) -> Path:
    with open(path, "w") as f:
        for i in range(start, start + n):
            f.write(json.dumps({"id": f"r{i}", "prompt": f"prompt {i} " + "x" * pad}) + "\n")
    return path


def run(conn, path, job_id="job1", **kw):
    kw.setdefault("output", str(Path(path).parent / f"out-{job_id}"))
    return submit(conn, KEYS, source_path=str(path), model="m", defaults=dict(DEFAULTS),
                  job_id=job_id, **kw)  # fmt: skip


def stream_indices(conn, job_id="job1") -> list[int]:
    """The job's queued requests' input indices (in its backlog until a worker takes them)."""
    return [index for index, _, _ in backlog.queued(conn, KEYS.queue_for_model("m"), job_id)]


def test_invalid_file_enqueues_nothing_and_names_every_bad_line(redis_url, tmp_path):
    conn = rconn(redis_url)
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"prompt": "ok"}\n{"prompt": ""}\n{"prompt": "ok"}\n{"prompt": "x", "top_p": 2}\n'
    )
    with pytest.raises(InvalidInput) as info:
        run(conn, path)
    assert str(info.value) == (
        f"{path}: 2 invalid line(s); nothing was enqueued. Fix them, or pass --skip-invalid "
        "to submit only the valid lines.\n"
        "  line 2, column 12: prompt is empty\n"
        "  line 4, column 26: top_p must be a number in (0, 1], got 2"
    )
    assert conn.dbsize() == 0


def test_submit_creates_the_job_and_one_entry_per_line(redis_url, tmp_path):
    conn = rconn(redis_url)
    result = run(conn, write_prompts(tmp_path / "p.jsonl", 5))
    assert (result.job_id, result.total, result.enqueued_now, result.resumed) == (
        "job1",
        5,
        5,
        False,
    )
    record = load_job(conn, KEYS, "job1")
    assert (record.state, record.total, record.enqueued, record.done, record.failed) == (
        JobState.QUEUED, 5, 5, 0, 0)  # fmt: skip
    assert (record.model, record.queue, record.output) == ("m", "m", str(tmp_path / "out-job1"))
    qk = KEYS.queue_for_model("m")
    entries = backlog.queued(conn, qk, "job1")
    assert [index for index, _, _ in entries] == [0, 1, 2, 3, 4]
    sampling = {"max_tokens": COMPLETION_MAX_TOKENS, **DEFAULTS}  # a prompt line's default
    assert json.loads(entries[3][2]) == {"id": "r3", "p": "prompt 3 ", "s": sampling}
    assert (record.backlog, conn.smembers(qk.ready)) == (5, {b"job1"})
    assert conn.smembers(qk.active) == {b"job1"}
    assert conn.hget(KEYS.jobs, "job1") == qk.tag.encode()
    assert conn.xinfo_groups(qk.stream)[0]["name"] == b"workers"


def test_resubmit_same_job_id_never_enqueues_twice(redis_url, tmp_path):
    conn = rconn(redis_url)
    path = write_prompts(tmp_path / "p.jsonl", 7)
    run(conn, path)
    again = run(conn, path)
    assert (again.enqueued_now, again.resumed, again.total) == (0, True, 7)
    assert stream_indices(conn) == list(range(7))


def test_resubmit_with_other_input_or_model_is_refused(redis_url, tmp_path):
    conn = rconn(redis_url)
    run(conn, write_prompts(tmp_path / "a.jsonl", 3))
    with pytest.raises(JobConflict, match="was submitted from different input or flags"):
        run(conn, write_prompts(tmp_path / "b.jsonl", 4))
    with pytest.raises(JobConflict, match="already exists for model 'm'"):
        submit(conn, KEYS, source_path=str(tmp_path / "a.jsonl"), model="other",
               output=str(tmp_path / "o"), defaults=dict(DEFAULTS), job_id="job1")  # fmt: skip
    assert stream_indices(conn) == [0, 1, 2]


def test_crashed_submit_resumes_where_it_stopped(redis_url, tmp_path, monkeypatch):
    conn = rconn(redis_url)
    path = write_prompts(tmp_path / "p.jsonl", 95)
    monkeypatch.setattr(chunk_append, "CHUNK_ENTRIES", 10)
    real_send, calls = chunk_append._ChunkSender.send, list[int]()

    def dying_send(self, start, chunk):
        if len(calls) == 3:
            raise KeyboardInterrupt  # the submitting process dies between chunks
        calls.append(1)
        return real_send(self, start, chunk)

    monkeypatch.setattr(chunk_append._ChunkSender, "send", dying_send)
    with pytest.raises(KeyboardInterrupt):
        run(conn, path)
    assert load_job(conn, KEYS, "job1").enqueued == 30
    assert stream_indices(conn) == list(range(30))
    monkeypatch.setattr(chunk_append._ChunkSender, "send", real_send)
    result = run(conn, path)
    assert (result.resumed, result.enqueued_now) == (True, 65)
    assert stream_indices(conn) == list(range(95))
    assert load_job(conn, KEYS, "job1").enqueued == 95


def test_a_racing_submit_cannot_append_a_chunk_twice(redis_url, tmp_path):
    conn = rconn(redis_url)
    run(conn, write_prompts(tmp_path / "p.jsonl", 3))
    sender = chunk_append._ChunkSender(conn, KEYS.queue_for_model("m"), "job1", 3)
    sender.send(0, [b"{}"])  # a second submitter that read enqueued=0 before the first ran
    with pytest.raises(JobConflict, match=r"being submitted by another process too \(it has 3"):
        sender.finish()
    sender.close()
    assert stream_indices(conn) == [0, 1, 2]


def test_skip_invalid_keeps_every_line_at_its_index(redis_url, tmp_path):
    conn = rconn(redis_url)
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"prompt": "a"}\n{"prompt": "b", "max_tokens": 0}\nnot json\n{"prompt": "c"}\n'
    )
    result = run(conn, path, skip_invalid=True)
    assert (result.total, result.skipped) == (4, 2)
    assert [str(e) for e in result.errors] == [
        "line 2, column 31: max_tokens must be an integer from 1 to 1048576, got 0",
        "line 3, column 1: malformed JSON: Expecting value",
    ]
    record = load_job(conn, KEYS, "job1")
    assert (record.total, record.skipped) == (4, 2)
    qk = KEYS.queue_for_model("m")
    assert [(i, json.loads(r)) for i, _, r in backlog.queued(conn, qk, "job1")] == [
        (0, {"p": "a", "s": {"max_tokens": 16, "temperature": 0.0, "top_p": 1.0, "top_k": 0}}),
        (1, {"err": "line 2, column 31: max_tokens must be an integer from 1 to 1048576, got 0"}),
        (2, {"err": "line 3, column 1: malformed JSON: Expecting value"}),
        (3, {"p": "c", "s": {"max_tokens": 16, "temperature": 0.0, "top_p": 1.0, "top_k": 0}}),
    ]


def test_queue_full_is_a_clear_error_and_leaves_only_whole_chunks(
    private_redis: RedisServer, tmp_path, monkeypatch
):
    conn = rconn(private_redis.url)
    monkeypatch.setattr(chunk_append, "CHUNK_ENTRIES", 100)
    path = write_prompts(tmp_path / "p.jsonl", 3000, pad=300)  # ~1 MB of entries
    used = int(conn.info("memory")["used_memory"])
    conn.config_set("maxmemory", used + 400_000)
    with pytest.raises(QueueFull) as info:
        run(conn, path)
    enqueued = load_job(conn, KEYS, "job1").enqueued
    assert 0 < enqueued < 3000 and enqueued % 100 == 0
    assert str(info.value) == (
        f"queue full: Redis is out of memory (maxmemory, noeviction) after {enqueued} of 3000 "
        "requests were enqueued. Start workers to drain the queue or raise maxmemory, then "
        "re-run the same submit with --job-id job1 to enqueue the rest"
    )
    assert stream_indices(conn) == list(range(enqueued))  # whole chunks, nothing half-added
    conn.config_set("maxmemory", 0)
    result = run(conn, path)
    assert result.enqueued_now == 3000 - enqueued
    assert stream_indices(conn) == list(range(3000))


def test_local_model_paths_name_the_same_queue(tmp_path, monkeypatch):
    model = tmp_path / "tiny"
    model.mkdir()
    monkeypatch.chdir(tmp_path)
    assert queue_name("./tiny") == str(model)
    assert queue_name(str(model) + "/") == str(model)
    assert queue_name("meta-llama/Llama-3-8B") == "meta-llama/Llama-3-8B"
    assert Keys("bg").queue_for_model("./tiny") == Keys("bg").queue_for_model(str(model))


def test_prompts_from_an_object_store_uri(redis_url, tmp_path, s3_endpoint):
    """PROMPTS may be any URI pyarrow.fs opens: the same entries as the local file;
    a missing object or inline credentials are one-line errors and enqueue nothing."""
    import pyarrow.fs as pafs

    from batchgen.jobs.schema.errors import InlineCredentials, UsageError

    conn = rconn(redis_url)
    local = write_prompts(tmp_path / "p.jsonl", 5)
    fs = pafs.S3FileSystem(endpoint_override=s3_endpoint, scheme="http")
    with fs.open_output_stream("batchgen-test/in/p.jsonl") as out:
        out.write(local.read_bytes())
    query = f"?endpoint_override={s3_endpoint}&scheme=http"
    remote = run(conn, f"s3://batchgen-test/in/p.jsonl{query}", "remote",
                 output=str(tmp_path / "out-remote"))  # fmt: skip
    assert (remote.total, remote.enqueued_now) == (5, 5)
    run(conn, local, "local")
    records = [load_job(conn, KEYS, j) for j in ("remote", "local")]
    assert records[0].source_sha256 == records[1].source_sha256
    assert stream_indices(conn, "remote") == list(range(5))
    with pytest.raises(UsageError, match=r"^cannot read s3://batchgen-test/in/nope.jsonl\?"):
        run(conn, f"s3://batchgen-test/in/nope.jsonl{query}", "nope")
    with pytest.raises(InlineCredentials, match="carries credentials"):
        run(conn, "s3://AKIA:secret@batchgen-test/in/p.jsonl", "creds")
    assert conn.exists(KEYS.queue_for_model("m").job("nope").job) == 0
