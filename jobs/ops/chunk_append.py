"""Appending a submitted job's entries to its backlogs in whole chunks: one script a
chunk, pipelined, appended only if the job's ``enqueued`` still equals the chunk's
start; after an outage, going on from ``enqueued``. Retry appends in chunks of the
same size with its own script (``rerun.py``: a retry cursor, not ``enqueued``)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator

import redis

from batchgen.jobs.backoff import backoff_delay
from batchgen.jobs.ops.fair_share import backlog
from batchgen.jobs.ops.fair_share.backlog import BACKLOG_PUSH
from batchgen.jobs.ops.lifecycle import script
from batchgen.jobs.redis.connection import is_oom, queue_full
from batchgen.jobs.redis.keys import QueueKeys, text
from batchgen.jobs.schema.errors import JobConflict

CHUNK_ENTRIES = 2000
CHUNK_BYTES = 4 << 20

APPEND_CHUNK = script(
    "append chunk",
    keys=[
        ("job", "the job record"),
        ("ready", "the model's jobs with a backlog"),
        ("*backlogs", "the job's backlog lists"),
    ],
    args=[
        ("job_id", ""),
        ("events", "the model's events channel: 'work' wakes idle workers"),
        ("start", "entries the job had when this chunk was packed"),
        ("*items", "the chunk's requests: prefix group, backlog item, ..."),
    ],
    body="""
local v = redis.call('HMGET', job, 'enqueued', 'state')
if not v[1] then return {-1, ''} end
if v[2] == S.CANCELLING or v[2] == S.CANCELLED then return {-2, v[2]} end
local first = tonumber(start)
if tonumber(v[1]) ~= first then return {tonumber(v[1]), ''} end
push_backlog(job, job_id, ready, events, backlogs, items)
local enqueued = first + #items / 2
redis.call('HSET', job, 'enqueued', enqueued)
return {enqueued, ''}
""",
    prelude=BACKLOG_PUSH,
)


def enqueued_after_outage(
    conn: redis.Redis, qk: QueueKeys, job_id: str, wait_s: float
) -> int | None:
    """Wait (with backoff, up to ``wait_s``) for Redis to answer again; the job's
    ``enqueued`` then (chunks are appended whole or not at all, so go on from
    there), or None if Redis stayed away."""
    deadline = time.monotonic() + wait_s
    attempt = 0
    while True:
        try:
            raw = conn.hget(qk.job(job_id).job, "enqueued")
        except (redis.ConnectionError, redis.TimeoutError):
            delay = backoff_delay(attempt, 0.1, 1.0)
            if time.monotonic() + delay > deadline:
                return None
            time.sleep(delay)
            attempt += 1
            continue
        if raw is None:
            raise JobConflict(
                f"job {job_id!r} disappeared from Redis while submitting (Redis restarted "
                "without its data?); submit the file again"
            )
        return int(raw)


def enqueue_chunks(
    conn: redis.Redis,
    qk: QueueKeys,
    job_id: str,
    entries: Iterator[bytes],
    start: int,
    total: int,
    progress: Callable[[int, int], None] | None,
) -> int:
    for _ in range(start):  # skip what an earlier submit already appended
        next(entries)
    sender = _ChunkSender(conn, qk, job_id, total)
    position, chunk, size = start, list[bytes](), 0
    try:
        for entry in entries:
            chunk.append(entry)
            size += len(entry) + 1
            if len(chunk) >= CHUNK_ENTRIES or size >= CHUNK_BYTES:
                sender.send(position, chunk)
                position += len(chunk)
                chunk, size = [], 0
                if progress:
                    progress(position, total)
        if chunk:
            sender.send(position, chunk)
            position += len(chunk)
        sender.finish()
    finally:
        sender.close()
    if progress:
        progress(position, total)
    return position - start


class _ChunkSender:
    """Chunk scripts on one connection, ``WINDOW`` in flight: Redis runs one chunk
    while this process packs the next. Replies are checked in order; a chunk
    sent after a failed one finds ``enqueued`` unchanged and appends nothing."""

    WINDOW = 2

    def __init__(self, conn: redis.Redis, qk: QueueKeys, job_id: str, total: int) -> None:
        self.sha = conn.script_load(APPEND_CHUNK.source)
        self.pool = conn.connection_pool
        self.connection = self.pool.get_connection()
        self.qk, self.job = qk, qk.job(job_id)
        self.job_id = job_id
        self.total = total
        self.in_flight: deque[tuple[int, int]] = deque()
        self.broken = False

    def send(self, start: int, chunk: list[bytes]) -> None:
        keys, args = APPEND_CHUNK.flatten(
            {"job": self.job.job, "ready": self.qk.ready, "backlogs": self.job.backlogs,
             "job_id": self.job_id, "events": self.qk.events, "start": start,
             "items": backlog.items(enumerate(chunk, start))}
        )  # fmt: skip
        packed = self.connection.pack_command("EVALSHA", self.sha, len(keys), *keys, *args)
        self.connection.send_packed_command(packed, check_health=False)
        self.in_flight.append((start, len(chunk)))
        if len(self.in_flight) > self.WINDOW:
            self._receive()

    def finish(self) -> None:
        while self.in_flight:
            self._receive()

    def close(self) -> None:
        if self.broken or self.in_flight:
            self.connection.disconnect()  # unread replies must not reach the next user
        self.pool.release(self.connection)

    def _receive(self) -> None:
        start, n = self.in_flight.popleft()
        try:
            enqueued, state = self.connection.read_response()
        except redis.RedisError as exc:  # OOM: a RedisRefused (connection.py)
            self.broken = True
            if is_oom(exc):
                raise queue_full(
                    start, self.total,
                    f"re-run the same submit with --job-id {self.job_id} to enqueue the rest",
                ) from exc  # fmt: skip
            raise
        except BaseException:
            self.broken = True
            raise
        if enqueued == start + n:
            return
        self.broken = True
        if enqueued == -1:
            raise JobConflict(f"job {self.job_id!r} disappeared from Redis while submitting")
        if enqueued == -2:
            raise JobConflict(f"job {self.job_id!r} was cancelled while submitting ({text(state)})")
        raise JobConflict(
            f"job {self.job_id!r} is being submitted by another process too "
            f"(it has {enqueued} requests, this one expected {start}); let that one finish"
        )
