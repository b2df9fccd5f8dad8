"""The result cache (jobs/storage/result_cache.py) as the queue loop uses it.

Before the engine: the requests of jobs submitted with ``--cache`` are looked
up by content key, all of one admitted batch at once; a hit becomes its row
(``cached_row``) without the engine. After the engine: a miss's key is kept
with its entry until the row's part is committed (``store``), and only then
written to the cache. The cache never fails a request: when Redis or the
cache's storage fails, a lookup is a miss and a store is skipped.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import redis

from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.schema import tools
from batchgen.jobs.schema.errors import BatchgenError
from batchgen.jobs.schema.rows import Row
from batchgen.jobs.storage.result_cache import ResultCache, content_key
from batchgen.worker.consumer.commit import PartCommit
from batchgen.worker.consumer.queue import Delivery
from batchgen.worker.loop.flight import cached_row
from batchgen.worker.loop.job_book import JobInfo
from batchgen.worker.loop.loop_config import LoopConfig

log = logging.getLogger(__name__)
_FAILURES = (redis.RedisError, BatchgenError, OSError)
_MAX_PENDING = 100_000  # keys of rows not yet committed; more means rows left another way


class LoopCache:
    def __init__(
        self,
        conn: redis.Redis,
        keys: Keys,
        fingerprint: str,  # of the weights this worker holds ("": no cache)
        engine: str,  # the worker's numerics, part of every key
        worker: str,
        count: Callable[[str, int], None],
    ) -> None:
        self.conn = conn
        self.keys = keys
        self.fingerprint = fingerprint
        self.engine = engine
        self.worker = worker
        self.count = count
        self.caches: dict[str, ResultCache] = {}
        self.keyed: dict[str, tuple[str, str]] = {}  # entry id -> (cache uri, key): misses
        self.pending: dict[str, tuple[str, str]] = {}  # finished, awaiting their commit

    def _cache(self, uri: str) -> ResultCache:
        if uri not in self.caches:
            self.caches[uri] = ResultCache(self.conn, self.keys, uri)
        return self.caches[uri]

    def lookup(self, items: list[tuple[JobInfo, Delivery, list[int]]]) -> dict[str, Row]:
        """(its job, delivery, prompt token ids) -> the rows served from the cache, by
        entry id. The misses' keys are kept for ``finished``."""
        by_uri: dict[str, list[tuple[Delivery, str]]] = {}
        for job, d, token_ids in items:
            uri, sampling = job.cache, d.request.sampling or {}
            key = content_key(self.fingerprint, self.engine, token_ids, sampling, split(job, d))
            if key is not None:
                by_uri.setdefault(uri, []).append((d, key))
        rows: dict[str, Row] = {}
        for uri, keyed in by_uri.items():
            try:
                hits = self._cache(uri).lookup([key for _, key in keyed])
            except _FAILURES as exc:
                log.warning("result cache %s: lookup failed (%s); generating", uri, exc)
                hits = {}
            for d, key in keyed:
                hit = hits.get(key)
                if hit is None:
                    self.keyed[d.entry_id] = (uri, key)
                else:
                    rows[d.entry_id] = cached_row(d, hit.values, hit.job_id, self.worker)
        self.count("cache_hits", len(rows))
        self.count("cache_misses", sum(len(k) for k in by_uri.values()) - len(rows))
        return rows

    def finished(self, entry_id: str, row: Row) -> None:
        """A request left the engine: keep a good row's key until its part is committed."""
        keyed = self.keyed.pop(entry_id, None)
        if keyed is not None and not row.failed:
            self.pending[entry_id] = keyed

    def forget(self, entry_id: str) -> None:
        self.keyed.pop(entry_id, None)

    def store(self, parts: list[PartCommit], held: Callable[[], tuple[str, ...]]) -> None:
        """Committed parts: write their generated rows that have a key to the cache."""
        for part in parts:
            by_uri: dict[str, list[tuple[str, Row]]] = {}
            for entry_id, row in zip(part.entry_ids, part.rows):
                keyed = self.pending.pop(entry_id, None)
                if keyed is not None:
                    by_uri.setdefault(keyed[0], []).append((keyed[1], row))
            for uri, items in by_uri.items():
                try:
                    self._cache(uri).store(part.job_id, self.worker, items)
                    self.count("cache_stored", len(items))
                except _FAILURES as exc:
                    log.warning("result cache %s: could not store %d rows (%s)",
                                uri, len(items), exc)  # fmt: skip
        if len(self.pending) + len(self.keyed) > _MAX_PENDING:  # handed back, not committed
            alive = set(held())
            self.pending = {e: k for e, k in self.pending.items() if e in alive}
            self.keyed = {e: k for e, k in self.keyed.items() if e in alive}


def split(job: JobInfo, d: Delivery) -> dict[str, str]:
    """How a request's output becomes its row's columns, beyond its tokens: the job's
    reasoning parser; with tools, its tool_choice and (for auto) the tool-call parser."""
    out = {"reasoning": job.reasoning.name} if job.reasoning is not None else {}
    if d.request.tools is not None:
        kind = tools.kind(d.request.tool_choice)
        out["tool_choice"] = json.dumps(d.request.tool_choice, sort_keys=True)
        if kind == "auto" and job.tool_parser is not None:
            out["tool_parser"] = job.tool_parser.name
    return out


def numerics(engine: object, config: LoopConfig) -> str:
    """What besides the weights decides the tokens: the device type, the dtype asked for
    (None picks by device and checkpoint) and the context length."""
    device = getattr(getattr(engine, "runner", None), "device", None)
    kind = getattr(device, "type", None) or (config.engine.device or "auto").split(":")[0]
    max_model_len = getattr(engine, "max_model_len", 0)
    return f"{kind}/{config.engine.dtype or 'auto'}/{max_model_len}"
