"""Every Redis key name batchgen uses, in one place.

Layout (prefix ``P``, default ``bg``, from ``BATCHGEN_PREFIX``)::

    P:jobs                        hash  job id -> queue tag (the job index)
    P:queues                      hash  queue tag -> model name
    P:workers                     zset  worker name -> last heartbeat (unix s)
    P:worker:NAME                 str   heartbeat JSON, expires (TTL)
    P:{TAG}:stream                stream  requests of one model; group "workers"
    P:{TAG}:dead                  stream  dead-lettered requests
    P:{TAG}:active                set   unfinalized jobs of this model
    P:{TAG}:cancelled             set   cancelled jobs workers must drop
    P:{TAG}:job:ID                hash  the job record (see records.py)
    P:{TAG}:job:ID:done           bitmap  bit i set = input i has a committed row
    P:{TAG}:job:ID:parts          hash  committed part URI -> commit record JSON
    P:{TAG}:job:ID:errors         hash  input index -> error row JSON (dead letters)

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

DEFAULT_PREFIX = "bg"
GROUP = "workers"


def prefix_from_env() -> str:
    return os.environ.get("BATCHGEN_PREFIX", DEFAULT_PREFIX)


def queue_name(model: str) -> str:
    """The queue a model's requests go to: local paths made absolute, ids as given.

    Symlinks are not resolved: a worker and a submitter that spell a path the
    same way meet on the same queue even where the path exists on one only.
    """
    looks_local = model.startswith(("/", "./", "../", "~")) or os.path.isdir(model)
    if looks_local:
        return os.path.abspath(os.path.expanduser(model)).rstrip("/") or "/"
    return model


def queue_tag(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()[:16]


@dataclass(slots=True, frozen=True)
class JobKeys:
    job: str  # the hash
    done: str
    parts: str
    errors: str


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
    def dead(self) -> str:
        return f"{self.base}:dead"

    @property
    def active(self) -> str:
        return f"{self.base}:active"

    @property
    def cancelled(self) -> str:
        return f"{self.base}:cancelled"

    def job(self, job_id: str) -> JobKeys:
        base = f"{self.base}:job:{job_id}"
        return JobKeys(
            job=base, done=f"{base}:done", parts=f"{base}:parts", errors=f"{base}:errors"
        )


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
    def queues(self) -> str:
        return f"{self.prefix}:queues"

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"

    def worker(self, name: str) -> str:
        return f"{self.prefix}:worker:{name}"

    def queue(self, tag: str) -> QueueKeys:
        return QueueKeys(self.prefix, tag)

    def queue_for_model(self, model: str) -> QueueKeys:
        return self.queue(queue_tag(queue_name(model)))

    @property
    def finalize_queue(self) -> str:
        """The rq queue that carries finalize tasks (rq adds its own ``rq:`` keys)."""
        return f"{self.prefix}-finalize"

    def finalize_task_id(self, job_id: str) -> str:
        return f"{self.prefix}-finalize-{job_id}"


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
