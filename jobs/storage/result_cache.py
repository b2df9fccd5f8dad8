"""The result cache across jobs: a row generated once is served again, never re-generated.

A job submitted with ``--cache`` looks up each request whose output its inputs
decide (greedy, or sampling with a seed; never unseeded sampling, never
embeddings) by a content key (``content_key``): sha256 of the model fingerprint
of the weights the worker holds, the engine's numerics (device, dtype, context),
the exact prompt token ids (tools and template variables rendered in them),
every sampling field of ``params.FIELDS`` and how the row's output is split (its
job's reasoning parser, its tool_choice and tool-call parser). A hit
becomes the row without the engine; a miss is generated and, after its part is
committed, stored.

Where it lives: the rows in immutable Parquet files at the cache location
(``BATCHGEN_CACHE``: a folder or an object-store prefix; default
``$BATCHGEN_HOME/cache`` with the embedded Redis), each written whole or not at
all (output_store.py), and an index in Redis per location (keys.py ``CacheKeys``):
content key -> file and row. Every cached row carries its key and a MAC
(HMAC-SHA256) of its key, its job and its values under a secret kept in Redis
beside the index (created once per location), never in the cache's storage: a
row whose file is missing, unreadable, or whose key or MAC does not match is a
miss, so a damaged cache costs a regeneration, never a wrong or missing row,
and whoever can write the cache's files but not read Redis cannot make rows it
serves. (Files written before the MAC carried an unkeyed digest: misses.)

Eviction: a size limit (``BATCHGEN_CACHE_MAX_BYTES``, default 10G) on the
files' bytes; past it the least recently used files go, with their index
entries. Torch-free, like everything in ``jobs/``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import io
import json
import logging
import os
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import redis

from batchgen.jobs.environment import CACHE, CACHE_MAX_BYTES
from batchgen.jobs.redis import embedded
from batchgen.jobs.redis.keys import Keys, text
from batchgen.jobs.redis.lua import LuaScript
from batchgen.jobs.schema.errors import BatchgenError, UsageError
from batchgen.jobs.schema.rows import Row, to_table
from batchgen.jobs.schema.sampling import FIELDS, check
from batchgen.jobs.storage.names import check_output
from batchgen.jobs.storage.output_store import OutputDir

log = logging.getLogger(__name__)

KEY_VERSION = 2  # 2: the key holds how the output is split; the rows its columns
# What a cached row gives back: the generation's own values (the rest is the new request's).
GENERATED = ("text", "token_ids", "finish_reason", "prompt_tokens", "completion_tokens",
             "cached_tokens", "structured", "logprobs", "choices", "reasoning",
             "reasoning_tokens", "tool_calls")  # fmt: skip


def location(embedded_redis: bool) -> str:
    """Where the cache lives: ``$BATCHGEN_CACHE``, else ``$BATCHGEN_HOME/cache`` with the
    embedded Redis; with a shared Redis it must be given (every worker must reach it)."""
    raw = (CACHE.get() or "").strip()
    if raw:
        try:
            return check_output(raw)
        except BatchgenError as exc:
            raise UsageError(
                f"{CACHE.name}: {str(exc).replace('--output', 'the cache location')}"
            ) from None
    if not embedded_redis:
        raise UsageError(
            f"--cache with a shared Redis needs {CACHE.name}=URI: a folder or object-store prefix "
            "(s3://bucket/cache, a shared path) that every worker can reach"
        )
    return os.path.abspath(embedded.home() / "cache")


def content_key(
    fingerprint: str, engine: str, token_ids: list[int], sampling: dict,
    split: dict[str, str] | None = None,
) -> str | None:  # fmt: skip
    """The content key of a request, or None when its output is not decided by its inputs
    (unseeded sampling) or the model has no fingerprint (not a local checkpoint).

    ``sampling``: a request's sampling parameters (fields missing there take their
    defaults, as in the engine's SamplingParams); ``engine``: the worker's numerics
    (device, dtype, ...); ``split``: how its output becomes columns (the parsers' names,
    its tool_choice), when it is split at all.
    """
    if not fingerprint:
        return None
    values: dict[str, Any] = {}
    for name, spec in FIELDS.items():
        value = sampling.get(name, spec.default)
        if value is not None:
            value = check(name, list(value) if isinstance(value, tuple) else value)
        values[name] = value
    if values["temperature"] != 0.0 and values["seed"] is None:
        return None
    payload = {"v": KEY_VERSION, "model": fingerprint, "engine": engine,
               "prompt": list(token_ids), "sampling": values, "split": split or {}}  # fmt: skip
    return hashlib.sha256(_canonical(payload).encode()).hexdigest()


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _mac(secret: bytes, key: str, job_id: str, row: dict[str, Any]) -> str:
    """Of a cached row's content key, job and generated values as read back from Parquet."""
    message = _canonical([key, job_id, [row[name] for name in GENERATED]]).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


@dataclass(slots=True)
class Hit:
    values: dict[str, Any]  # GENERATED -> the original row's value
    job_id: str  # the job it was generated for


@dataclass(slots=True)
class Stats:
    uri: str
    entries: int
    files: int
    bytes: int
    limit: int
    hits: int
    misses: int
    stored: int
    evicted: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


ADD_FILE = LuaScript.define(
    "cache add file",
    keys=[("index", ""), ("files", ""), ("meta", ""), ("stats", "")],
    args=[
        ("name", "the new cache file"),
        ("now", "unix seconds"),
        ("limit", "the size limit in bytes"),
        ("info", "JSON {bytes, job, keys: [content key, ...]} (row r holds keys[r])"),
    ],
    body="""
local data = cjson.decode(info)
for r, key in ipairs(data.keys) do
  redis.call('HSET', index, key, name .. ' ' .. (r - 1))
end
redis.call('ZADD', files, now, name)
redis.call('HSET', meta, name, info)
redis.call('HINCRBY', stats, 'stored', #data.keys)
local total = redis.call('HINCRBY', stats, 'bytes', data.bytes)
local evicted = {}
while total > tonumber(limit) do
  local oldest = redis.call('ZRANGE', files, 0, 0)[1]
  if not oldest then break end
  local m = cjson.decode(redis.call('HGET', meta, oldest) or '{"bytes":0,"keys":[]}')
  for r, key in ipairs(m.keys) do
    if redis.call('HGET', index, key) == oldest .. ' ' .. (r - 1) then
      redis.call('HDEL', index, key)
    end
  end
  redis.call('ZREM', files, oldest)
  redis.call('HDEL', meta, oldest)
  total = redis.call('HINCRBY', stats, 'bytes', -m.bytes)
  redis.call('HINCRBY', stats, 'evicted', #m.keys)
  evicted[#evicted + 1] = oldest
end
return evicted
""",
)

CLEAR = LuaScript.define(
    "cache clear",
    keys=[("index", ""), ("files", ""), ("meta", ""), ("stats", "")],
    body="""
local names = redis.call('HKEYS', meta)
local entries = redis.call('HLEN', index)
redis.call('DEL', index, files, meta, stats)
return {entries, names}
""",
)


class ResultCache:
    """One cache location: its files (``OutputDir``) and its index in Redis."""

    def __init__(self, conn: redis.Redis, keys: Keys, uri: str) -> None:
        self.conn = conn
        self.uri = uri
        self.ck = keys.cache(uri)
        self._dir: OutputDir | None = None

    @property
    def dir(self) -> OutputDir:
        if self._dir is None:
            self._dir = OutputDir.open(self.uri)
        return self._dir

    def lookup(self, keys: list[str]) -> dict[str, Hit]:
        """The verified cached rows of ``keys`` (each file read once); the rest are misses."""
        if not keys:
            return {}
        where: dict[str, list[tuple[str, int]]] = {}
        for key, value in zip(keys, self.conn.hmget(self.ck.index, keys)):
            name, _, row = text(value).partition(" ")
            if name and row.isdigit():
                where.setdefault(name, []).append((key, int(row)))
        hits: dict[str, Hit] = {}
        secret = self._secret() if where else b""
        for name, wanted in where.items():
            hits.update(self._read(name, wanted, secret))
        pipe = self.conn.pipeline(transaction=False)
        now = time.time()
        for name in {n for n, w in where.items() if any(k in hits for k, _ in w)}:
            pipe.zadd(self.ck.files, {name: now}, xx=True)
        pipe.hincrby(self.ck.stats, "hits", len(hits))
        pipe.hincrby(self.ck.stats, "misses", len(set(keys)) - len(hits))
        pipe.execute()
        return hits

    def _secret(self) -> bytes:
        """The location's MAC key: made once (SET NX), kept in Redis only."""
        raw = self.conn.get(self.ck.secret)
        if raw is None:
            self.conn.set(self.ck.secret, secrets.token_hex(32), nx=True)
            raw = self.conn.get(self.ck.secret)
        return text(raw).encode()

    def _read(self, name: str, wanted: list[tuple[str, int]], secret: bytes) -> dict[str, Hit]:
        try:
            table = pq.read_table(io.BytesIO(self.dir.read_bytes(name)))
            rows = table.to_pylist()
        except (BatchgenError, OSError, pa.ArrowException, ValueError) as exc:
            log.warning("result cache %s: cannot read %s (%s); regenerating its rows",
                        self.uri, name, exc)  # fmt: skip
            return {}
        hits = {}
        for key, r in wanted:
            row = rows[r] if r < len(rows) else None
            try:
                ok = (
                    row is not None
                    and row["key"] == key
                    and hmac.compare_digest(
                        str(row["mac"]), _mac(secret, key, str(row["job_id"]), row)
                    )
                )
            except (KeyError, TypeError):  # no "mac": written before it, or not by batchgen
                ok = False
            if not ok:
                log.warning("result cache %s: row %d of %s does not match its key and MAC; "
                            "regenerating it", self.uri, r, name)  # fmt: skip
                continue
            assert row is not None
            hits[key] = Hit({n: row[n] for n in GENERATED}, row["job_id"])
        return hits

    def store(self, job_id: str, worker: str, items: list[tuple[str, Row]]) -> None:
        """Write ``items`` (content key, generated row) as one immutable file, then index
        it; evict least recently used files past the size limit."""
        if not items:
            return
        table = to_table([row for _, row in items])
        values = table.to_pylist()  # MACs of the values as Parquet gives them back
        secret = self._secret()
        macs = [_mac(secret, key, job_id, v) for (key, _), v in zip(items, values)]
        table = table.append_column("key", pa.array([key for key, _ in items], pa.string()))
        table = table.append_column("mac", pa.array(macs, pa.string()))
        table = table.append_column("job_id", pa.array([job_id] * len(items), pa.string()))
        sink = io.BytesIO()
        pq.write_table(table, sink, compression="zstd")
        data = sink.getvalue()
        name = f"{worker}-{int(time.time())}-{uuid.uuid4().hex[:12]}.parquet"
        self.dir.write_atomic((name,), data)
        info = _canonical({"bytes": len(data), "job": job_id, "keys": [k for k, _ in items]})
        evicted = ADD_FILE(self.conn, index=self.ck.index, files=self.ck.files, meta=self.ck.meta,
                           stats=self.ck.stats, name=name, now=repr(time.time()),
                           limit=CACHE_MAX_BYTES.get(), info=info)  # fmt: skip
        self._delete([text(n) for n in evicted])

    def stats(self) -> Stats:
        pipe = self.conn.pipeline(transaction=False)
        pipe.hlen(self.ck.index)
        pipe.zcard(self.ck.files)
        pipe.hgetall(self.ck.stats)
        entries, files, raw = pipe.execute()
        counts = {text(k): int(v) for k, v in raw.items()}
        return Stats(self.uri, int(entries), int(files), counts.get("bytes", 0), CACHE_MAX_BYTES.get(),
                     counts.get("hits", 0), counts.get("misses", 0), counts.get("stored", 0),
                     counts.get("evicted", 0))  # fmt: skip

    def clear(self) -> tuple[int, int]:
        """Forget every entry and delete the files; (entries, files) removed."""
        ck = self.ck
        entries, names = CLEAR(self.conn, index=ck.index, files=ck.files, meta=ck.meta,
                               stats=ck.stats)  # fmt: skip
        names = [text(n) for n in names]
        self._delete(names)
        return int(entries), len(names)

    def _delete(self, names: list[str]) -> None:
        for name in names:
            try:
                self.dir.delete_file(name)
            except BatchgenError as exc:  # unindexed already: only its bytes stay behind
                log.warning("result cache %s: cannot delete %s: %s", self.uri, name, exc)
