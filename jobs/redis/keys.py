"""Every Redis key name batchgen uses, in one place.

Layout (prefix ``P``, default ``bg``, from ``BATCHGEN_PREFIX``)::

    P:jobs                        hash  job id -> queue tag (the job index)
    P:queues                      hash  queue tag -> model name
    P:workers                     zset  worker name -> last heartbeat (unix s)
    P:worker:NAME                 str   heartbeat JSON, expires (TTL)
    P:supervisors                 zset  supervisor id -> last announcement (unix s)
    P:supervisor:ID               str   a live supervisor's model (JSON, TTL): workers starting
    P:{TAG}:stream                stream  dispatched requests of one model; group "workers"
    P:{TAG}:ready                 set   jobs whose backlog holds requests (dispatch picks)
    P:{TAG}:fair                  hash  fair-share clocks, tenant weights, the fleet's rate
    P:{TAG}:classes               zset  priority classes with ready jobs (fair_index.py)
    P:{TAG}:tenants:C             zset  tenants with ready jobs in class C -> virtual time
    P:{TAG}:jobs:C:T              zset  tenant T's ready jobs in class C -> virtual time
    P:{TAG}:urgent:C              zset  class C's jobs at risk of missing their deadline
    P:{TAG}:deadlines             zset  unfinished jobs with a deadline -> deadline
    P:{TAG}:expiry                zset  those of them that expire at it -> deadline
    P:{TAG}:usage                 hash  "TENANT|counter" -> committed usage on this model
    P:{TAG}:active                set   unfinalized jobs of this model
    P:{TAG}:cancelled             set   cancelled jobs workers must drop
    P:{TAG}:events                channel  "cancel:JOB" (workers subscribe)
    P:{TAG}:expiring              zset  finished job -> when its state expires
    P:{TAG}:job:ID                hash  the job record (see job_record.py)
    P:{TAG}:job:ID:done           bitmap  bit i set = input i has a committed row
    P:{TAG}:job:ID:parts          hash  committed part URI -> commit record JSON
    P:{TAG}:job:ID:errors         hash  input index -> error row JSON (dead letters)
    P:{TAG}:job:ID:dead           stream  the job's dead-lettered requests, with reasons
    P:{TAG}:job:ID:finalizer      str   the finalize lease (holder, TTL)
    P:{TAG}:job:ID:q:G            list  the job's backlog, prefix group G (backlog.py)

Tenants (tenants.py; ``H`` a short hash of the tenant's name)::

    P:tenants                     set   tenant names with settings or reservations
    P:{tenant-H}:settings         hash  the tenant's weight and quotas
    P:{tenant-H}:jobs             hash  unfinished job id -> "TOKENS UNIX_S" (its quota share)

``batchgen serve`` (the OpenAI Files/Batches API and the dashboard) adds::

    P:files                       zset  file id -> created_at (unix s)
    P:file:ID                     hash  an uploaded or result file's metadata
    P:batches                     zset  batch id -> created_at (newest first in lists)
    P:batches:open                set   batches whose output files are not written yet
    P:batch:ID                    hash  the batch record (its job has the same id)
    P:batch:ID:lock               str   the lease of who validates or finishes the batch
    P:tenant:T:files              zset  tenant T's files (as P:files)
    P:tenant:T:batches            zset  tenant T's batches (as P:batches)
    P:files:expiring:D            zset  file id -> when it expires (D: a hash of the files dir)
    P:batches:expiring:D          zset  final batch id -> when its record and outputs go
    P:serve:instance:ID           str   a live serve process (lease): its uploads in flight
    P:serve:session:H             str   a dashboard session (H: its token's hash): key id (TTL)
    P:serve:series                zset  tok/s samples (JSON) by time, the last hour
    P:serve:sampled:SLOT          str   taken by the server that samples SLOT (TTL)

The result cache (result_cache.py) keeps one index per cache location ``URI``::

    P:{cache-H}:index             hash  content key -> "FILE ROW" (a row of a cache file)
    P:{cache-H}:files             zset  cache file -> last used (unix s): LRU eviction order
    P:{cache-H}:meta              hash  cache file -> {bytes, job, keys} JSON
    P:{cache-H}:stats             hash  bytes, entries stored, hits, misses, evicted
    P:{cache-H}:secret            str   the key of the cached rows' MACs (never in the files)

``H`` is a short hash of the location's URI; the five keys share its hash tag.

``TAG`` is a short hash of the model's queue name. It is a Redis Cluster hash
tag: a model's stream and all its jobs' keys share one slot, so the commit step
(XACK + XDEL on the stream, done-marks and counters of the jobs in a batch) is
one Lua script even on a cluster. One model's queue is therefore one shard;
scale a cluster out with more models (queues), not bigger ones. The global keys
are touched only by single-key commands.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from batchgen.jobs.environment import PREFIX

DEFAULT_PREFIX = PREFIX.default or ""
GROUP = "workers"
# A job's backlog is split into this many lists by prompt prefix (backlog.py): a worker
# takes first from the groups rendezvous hashing gives it, where its prefix cache is warm.
BACKLOG_GROUPS = 16


def prefix_from_env() -> str:
    return PREFIX.get() or ""


def model_name(model: str) -> str:
    """A model as jobs and workers record and show it: local paths made absolute, ids
    as given.

    Symlinks are not resolved: a worker and a submitter that spell a path the
    same way meet on the same queue even where the path exists on one only.
    """
    looks_local = model.startswith(("/", "./", "../", "~")) or os.path.isdir(model)
    if looks_local:
        return os.path.abspath(os.path.expanduser(model)).rstrip("/") or "/"
    return model


def queue_name(model: str) -> str:
    """The queue a model's requests go to: named by the model's name (model_name)."""
    return model_name(model)


def run_queue_name(model: str, job_id: str) -> str:
    """The queue of one ``batchgen run`` job: its own, so no worker of the model takes its
    requests; named by the job, so re-running it with the same --job-id finds it again."""
    return f"{queue_name(model)}#run:{job_id}"


def queue_tag(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()[:16]


@dataclass(slots=True, frozen=True)
class JobKeys:
    job: str  # the hash
    done: str
    parts: str
    errors: str
    dead: str  # dead-lettered requests (a stream)
    finalizer: str  # the finalize lease
    backlogs: tuple[str, ...]  # requests waiting for dispatch, one list per prefix group

    def all(self) -> tuple[str, ...]:
        """Every key of the job (they expire, or go, together)."""
        return (self.job, self.done, self.parts, self.errors, self.dead, self.finalizer,
                *self.backlogs)  # fmt: skip


@dataclass(slots=True, frozen=True)
class QueueKeys:
    prefix: str
    tag: str

    @property
    def base(self) -> str:
        return f"{self.prefix}:{{{self.tag}}}"

    @property
    def stream(self) -> str:
        return f"{self.base}:stream"

    @property
    def active(self) -> str:
        return f"{self.base}:active"

    @property
    def ready(self) -> str:
        """Jobs whose backlog holds requests: the ones dispatch chooses from."""
        return f"{self.base}:ready"

    @property
    def fair(self) -> str:
        """Fair-share state: virtual clocks, tenant weights, the fleet's measured rate."""
        return f"{self.base}:fair"

    @property
    def usage(self) -> str:
        """Committed usage on this model per tenant: ``TENANT|counter`` -> int."""
        return f"{self.base}:usage"

    @property
    def cancelled(self) -> str:
        return f"{self.base}:cancelled"

    @property
    def expiring(self) -> str:
        """Finished jobs by when their state expires (the index entry goes then too)."""
        return f"{self.base}:expiring"

    @property
    def events(self) -> str:
        """A pub/sub channel: ``cancel:JOB`` when a job is cancelled (workers listen)."""
        return f"{self.base}:events"

    def job(self, job_id: str) -> JobKeys:
        base = f"{self.base}:job:{job_id}"
        return JobKeys(
            job=base,
            done=f"{base}:done",
            parts=f"{base}:parts",
            errors=f"{base}:errors",
            dead=f"{base}:dead",
            finalizer=f"{base}:finalizer",
            backlogs=tuple(f"{base}:q:{g}" for g in range(BACKLOG_GROUPS)),
        )


@dataclass(slots=True, frozen=True)
class CacheKeys:
    """One result cache location's index (result_cache.py)."""

    index: str
    files: str
    meta: str
    stats: str
    secret: str  # the MAC key (result_cache.py): kept when the cache is cleared

    def all(self) -> tuple[str, ...]:
        return (self.index, self.files, self.meta, self.stats)


@dataclass(slots=True, frozen=True)
class TenantKeys:
    """One tenant's keys (tenants.py); they share a hash tag."""

    settings: str
    jobs: str  # unfinished jobs -> their quota share
    held: str  # those shares' sum (jobs, tokens) and where the share check goes on


@dataclass(slots=True, frozen=True)
class Keys:
    prefix: str = DEFAULT_PREFIX

    @classmethod
    def from_env(cls) -> Keys:
        return cls(prefix_from_env())

    @property
    def jobs(self) -> str:
        return f"{self.prefix}:jobs"

    @property
    def jobs_by_time(self) -> str:
        """Every job by submit time, for listings (job_index.py)."""
        return f"{self.prefix}:jobs:by-time"

    @property
    def jobs_indexed(self) -> str:
        """Set once every job submitted before the index existed is in it (job_index.py)."""
        return f"{self.prefix}:jobs:by-time:complete"

    def api_tenant_jobs(self, api_tenant: str) -> str:
        """A serve tenant's jobs by submit time (job_index.py)."""
        return f"{self.prefix}:jobs:by-time:api:{api_tenant}"

    @property
    def queues(self) -> str:
        return f"{self.prefix}:queues"

    def deleted(self, job_id: str) -> str:
        """A deleted job's tombstone (deletion.py): what status says of it for a while."""
        return f"{self.prefix}:deleted:{job_id}"

    @property
    def identity(self) -> str:
        """A random id this Redis (and prefix) takes once: a job's output marker is
        derived from it (submission.py), so another Redis's job of the same id is told apart."""
        return f"{self.prefix}:identity"

    @property
    def write_probe(self) -> str:
        """Never created: ``batchgen status`` writes nothing to it to ask whether Redis
        takes writes (outage_probe.py)."""
        return f"{self.prefix}:write-probe"

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"

    def worker(self, name: str) -> str:
        return f"{self.prefix}:worker:{name}"

    @property
    def supervisors(self) -> str:
        return f"{self.prefix}:supervisors"

    def supervisor(self, name: str) -> str:
        return f"{self.prefix}:supervisor:{name}"

    def queue(self, tag: str) -> QueueKeys:
        return QueueKeys(self.prefix, tag)

    def queue_for_model(self, model: str) -> QueueKeys:
        return self.queue(queue_tag(queue_name(model)))

    def finalize_queue(self, tag: str) -> str:
        """The rq queue of one model's finalize tasks (rq adds its own ``rq:`` keys): only
        workers of that model take them, which reach the outputs its jobs write to."""
        return f"{self.prefix}-finalize-{tag}"

    def finalize_task_id(self, job_id: str) -> str:
        return f"{self.prefix}-finalize-{job_id}"

    @property
    def tenants(self) -> str:
        return f"{self.prefix}:tenants"

    def tenant(self, name: str) -> TenantKeys:
        base = f"{self.prefix}:{{tenant-{queue_tag(name)}}}"
        return TenantKeys(f"{base}:settings", f"{base}:jobs", f"{base}:held")

    def cache(self, uri: str) -> CacheKeys:
        base = f"{self.prefix}:{{cache-{queue_tag(uri)}}}"
        return CacheKeys(f"{base}:index", f"{base}:files", f"{base}:meta", f"{base}:stats",
                         f"{base}:secret")  # fmt: skip

    # -- batchgen serve ---------------------------------------------------------

    @property
    def files(self) -> str:
        return f"{self.prefix}:files"

    def file(self, file_id: str) -> str:
        return f"{self.prefix}:file:{file_id}"

    @property
    def batches(self) -> str:
        return f"{self.prefix}:batches"

    @property
    def open_batches(self) -> str:
        return f"{self.prefix}:batches:open"

    def batch(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}"

    def batch_lock(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{batch_id}:lock"

    def tenant_files(self, tenant: str) -> str:
        return f"{self.prefix}:tenant:{tenant}:files"

    def tenant_batches(self, tenant: str) -> str:
        return f"{self.prefix}:tenant:{tenant}:batches"

    def expiring_files(self, files_dir: str) -> str:
        return f"{self.prefix}:files:expiring:{queue_tag(files_dir)}"

    def expiring_batches(self, files_dir: str) -> str:
        return f"{self.prefix}:batches:expiring:{queue_tag(files_dir)}"

    def serve_instance(self, name: str) -> str:
        return f"{self.prefix}:serve:instance:{name}"

    def session(self, token_hash: str) -> str:
        return f"{self.prefix}:serve:session:{token_hash}"

    @property
    def series(self) -> str:
        return f"{self.prefix}:serve:series"

    def sampled(self, slot: int) -> str:
        return f"{self.prefix}:serve:sampled:{slot}"


def text(value: object) -> str:
    """A Redis reply (bytes; str under decode_responses) as text; None as ""."""
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode()
    return str(value)


def text_hash(raw: object) -> dict[str, str]:
    """An HGETALL reply as str -> str."""
    assert isinstance(raw, dict)
    return {text(k): text(v) for k, v in raw.items()}
