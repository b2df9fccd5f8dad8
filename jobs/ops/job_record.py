"""The job record: one Redis hash per job (its states: lifecycle.py; its codec: hash_codec.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import redis

from batchgen.jobs.ops.lifecycle import JobState
from batchgen.jobs.redis import hash_codec
from batchgen.jobs.redis.hash_codec import OMIT_EMPTY, SORTED
from batchgen.jobs.redis.keys import Keys, QueueKeys, run_queue_name, text
from batchgen.jobs.schema.errors import JobNotFound


@dataclass(slots=True)
class JobRecord:
    id: str
    state: JobState = JobState.QUEUED
    model: str = ""
    # the tenant of the API key that submitted it through ``batchgen serve``; "" for a job
    # the CLI submitted (left out of the hash): serve shows a job to that tenant and to
    # admins only, whatever fair-share ``tenant`` it runs under
    api_tenant: str = field(default="", metadata=OMIT_EMPTY)
    queue: str = ""  # the queue name (see keys.queue_name)
    tag: str = ""  # the queue's hash tag
    output: str = ""  # URI of the job's output directory
    output_token: str = ""  # the token of the output's marker (ownership.py)
    # job-level sampling defaults (sorted: the manifest shows them so)
    defaults: dict[str, Any] = field(default_factory=dict, metadata=SORTED)
    source: str = ""  # input file name, for the manifest
    source_sha256: str = ""  # of the valid entries, so a re-submit can prove it is the same job
    total: int = 0  # input lines or rows = rows the output will hold (skipped ones: errors)
    enqueued: int = 0  # entries appended so far; == total once submit finished
    done: int = 0  # rows that finished (stop, length)
    failed: int = 0  # rows that did not (error, cancelled): done + failed = rows so far
    cancelled_rows: int = 0  # of the failed, those cancelled before they ran (finalize's)
    skipped: int = 0  # invalid lines skipped with --skip-invalid (each an error row)
    prompt_tokens: int = 0  # of the rows that finished (stop, length): billed
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0  # of the completion tokens, those rows' reasoning parser found
    created_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    error: str = ""
    storage_error: str = ""  # a worker cannot write the job's parts (rows kept, not charged)
    refused: str = ""  # a worker holding other weights under the model's name would not run it
    last_id: str = ""  # newest stream id carrying one of its requests
    closed: bool = False  # finalize has frozen the committed parts
    retention_s: int = 0  # the finished job's Redis state expires after this (retention.py)
    finalize_attempts: int = 0  # failed finalize runs (a killed finalizer is not one)
    finalize_retry_at: float = 0.0  # after a failed finalize: when the workers retry it
    # of the weights; "" for an HF id, left out of the hash for the first worker to set (HSETNX)
    model_fingerprint: str = field(default="", metadata=OMIT_EMPTY)
    cache: str = ""  # the result cache's location (result_cache.py) when submitted with --cache
    # what splits each output into reasoning and answer (jobs/schema/reasoning.py); "": none
    reasoning_parser: str = ""
    # what finds the tool calls of tool_choice auto rows (jobs/schema/tool_parsers.py)
    tool_call_parser: str = ""
    retried: int = 0  # rows re-queued by `batchgen retry`, all rounds together (rerun.py)
    retry_rounds: int = 0  # retries that re-opened the job
    retry_cursor: int = 0  # the input index the current retry enqueues from next
    input_format: str = ""  # "jsonl", "parquet" or "csv" (sources.py); "" before tables
    table: str = ""  # a table input's flags, TableSpec.to_json (tables.py); "" for JSONL
    kept_columns: list[str] = field(default_factory=list)  # input columns in the result (kept.py)
    # -- fair share (worker/consumer/dispatch.py, tenants.py, deadlines.py) --
    tenant: str = ""  # who the job is for ("": no tenant); its weight and quotas: tenants.py
    priority: int = 0  # higher classes are dispatched first
    deadline: float = 0.0  # unix s by which it should be done; 0.0: none
    expire: bool = False  # cancel it at its deadline (else it is only reported late)
    est_input_tokens: int = 0  # submit's estimate (a quarter of the prompts' bytes): quotas
    cost: float = 0.0  # estimated tokens a request costs (input + max_tokens): fair share
    backlog: int = 0  # requests in its backlog, not yet dispatched to the stream
    vtime: float = 0.0  # its virtual time: tokens charged at dispatch (within its tenant)
    urgent: bool = False  # it would miss its deadline at its fair share: served first (EDF)
    late: bool = False  # it cannot make its deadline at any share it may take: served fairly
    eta: float = 0.0  # unix s it should finish at the rate it is served; 0.0: unknown
    engine_us: int = 0  # engine time its committed rows took (usage)
    # input tokens of its failed rows: not billed (worker/consumer/commit.py)
    failed_prompt_tokens: int = 0

    @property
    def retry_incomplete(self) -> bool:
        """A retry re-opened the job but was stopped before it queued every retried row."""
        return self.state.live and self.retry_rounds > 0 and self.retry_cursor < self.total

    @property
    def submitted(self) -> bool:
        return self.enqueued >= self.total

    @property
    def run_alone(self) -> bool:
        """Made by ``batchgen run``: its queue is its own, which no worker reads."""
        return self.queue == run_queue_name(self.model, self.id)

    @property
    def finished_rows(self) -> int:
        return self.done + self.failed

    @property
    def errors(self) -> int:
        """Rows that failed (error rows), cancelled ones not counted."""
        return self.failed - self.cancelled_rows

    def to_hash(self) -> dict[str, str]:
        return hash_codec.to_hash(self)

    @classmethod
    def from_hash(cls, job_id: str, raw: object) -> JobRecord:
        return hash_codec.from_hash(cls, raw, id=job_id)

    def spec(self) -> dict[str, Any]:
        """What the user asked for, for the manifest."""
        return {
            "job_id": self.id,
            "model": self.model,
            "queue": self.queue,
            "defaults": self.defaults,
            "source": self.source,
            "source_sha256": self.source_sha256,
            "input_format": self.input_format or "jsonl",
            "kept_columns": self.kept_columns,
            "output": self.output,
        }


def queue_of_job(conn: redis.Redis, keys: Keys, job_id: str) -> QueueKeys:
    tag = conn.hget(keys.jobs, job_id)
    if not tag and (tombstone := conn.get(keys.deleted(job_id))):
        raise JobNotFound(f"job {job_id!r} was deleted ({text(tombstone)})")
    if not tag:
        raise JobNotFound(
            f"no job {job_id!r} in this Redis (see `batchgen jobs`; if it existed, "
            "Redis lost its state: was it restarted without persistence?)"
        )
    return keys.queue(text(tag))


def load_job(conn: redis.Redis, keys: Keys, job_id: str) -> JobRecord:
    qk = queue_of_job(conn, keys, job_id)
    raw = conn.hgetall(qk.job(job_id).job)
    if not raw:
        raise JobNotFound(
            f"job {job_id!r} is indexed but its record is gone: Redis lost its state "
            "(restarted without persistence?); re-submit the file"
        )
    return JobRecord.from_hash(job_id, raw)


def now() -> float:
    return time.time()
