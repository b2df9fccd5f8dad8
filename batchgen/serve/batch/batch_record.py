"""The batch record (``P:batch:ID``) and how a batch looks to OpenAI's client.

The batch's state is stored (batch_lifecycle.py); once submitted, its status
follows its batchgen job (same id) until the server has written its output
files and moved it to a final state: the job's Redis state may expire after
that, the batch stays.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchgen.jobs.ops.finalize.result import RESULT
from batchgen.jobs.ops.job_record import JobRecord
from batchgen.jobs.ops.lifecycle import JobState
from batchgen.jobs.redis import hash_codec
from batchgen.jobs.redis.hash_codec import OMIT_EMPTY
from batchgen.jobs.redis.keys import text_hash
from batchgen.jobs.storage.names import redact_uri
from batchgen.serve.batch.batch_lifecycle import BatchState

TIMES = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
         "cancelling_at", "cancelled_at")  # fmt: skip


@dataclass(slots=True)
class BatchRecord:
    id: str
    endpoint: str = ""
    input_file_id: str = ""
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None
    created_at: int = 0
    expires_at: int = 0
    state: BatchState = BatchState.VALIDATING
    model: str = ""
    output: str = ""  # the job's output directory (its Parquet)
    errors: list[dict[str, Any]] = field(default_factory=list)
    output_file_id: str = ""
    error_file_id: str = ""
    total: int = 0
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0  # kept with the output files (the job's state may expire)
    completion_tokens: int = 0
    cached_tokens: int = 0
    failed_prompt_tokens: int = 0  # failed requests' input tokens: not billed, counted apart
    reasoning_tokens: int = 0
    in_progress_at: int = 0
    finalizing_at: int = 0
    completed_at: int = 0
    failed_at: int = 0
    expired_at: int = 0
    cancelling_at: int = 0
    cancelled_at: int = 0
    tenant: str = field(default="", metadata=OMIT_EMPTY)  # api_keys.py; "" without keys
    store: str = ""  # the files dir of its input and output files ("": before stores)
    output_expiry_s: int = 0  # its output files (and then this record) go this long after
    finish_attempts: int = 0  # failed tries at writing the output files
    finish_retry_at: float = 0.0  # after a failed try: not before this (unix s)

    def to_hash(self) -> dict[str, str]:
        return hash_codec.to_hash(self)

    @classmethod
    def from_hash(cls, raw: object) -> BatchRecord:
        data = text_hash(raw)
        if "state" not in data:  # written before states: a phase, a final status, two flags
            data["state"] = _state_before_states(data).value
        return hash_codec.from_hash(cls, data)


def _state_before_states(data: dict[str, str]) -> BatchState:
    if data.get("final_status"):
        return BatchState(data["final_status"])
    phase = data.get("phase", "validating")
    if phase == "validating":
        cancelled = data.get("cancel_requested") == "1"
        return BatchState.CANCELLING if cancelled else BatchState.VALIDATING
    if phase == "failed":
        return BatchState.FAILED
    return BatchState.EXPIRING if data.get("expiring") == "1" else BatchState.SUBMITTED


def status(record: BatchRecord, job: JobRecord | None) -> str:
    """OpenAI's status: the batch's own state, or once submitted what its job is doing."""
    if not record.state.has_job:
        return record.state.value  # validating, cancelling, or final: completed, ...
    if job is None:
        return BatchState.FAILED.value  # the job is gone; the sweep fails the batch
    if job.state.live:
        return "in_progress"
    if record.state == BatchState.EXPIRING or job.state in (
        JobState.FINALIZING, JobState.COMPLETED
    ):  # fmt: skip
        return "finalizing"  # output files are written once the job is done
    return "cancelling"


def _errors(record: BatchRecord, job: JobRecord | None) -> list[dict[str, Any]]:
    """The batch's own errors, and while its job waits refused by a worker that holds
    other weights under the model's name (worker/loop/job_book.py) that worker's reason:
    the batch stays in_progress, as the job stays live, until a worker holding the weights
    it was submitted for takes it (the reason then goes) or its window ends."""
    if job is None or not record.state.has_job or not job.state.live or not job.refused:
        return record.errors
    refused = {"code": "refused_by_worker", "message": job.refused, "param": None, "line": None}
    return [*record.errors, refused]


def to_openai(record: BatchRecord, job: JobRecord | None) -> dict[str, Any]:
    source: BatchRecord | JobRecord = record if record.state.final or job is None else job
    if isinstance(source, JobRecord):
        # OpenAI's counts: completed and failed requests; cancelled ones are neither
        counts = {"total": source.total, "completed": source.done, "failed": source.errors}
    else:
        counts = {"total": record.total, "completed": record.completed, "failed": record.failed}
    usage = {
        "input_tokens": source.prompt_tokens,
        "input_tokens_details": {"cached_tokens": source.cached_tokens},
        "output_tokens": source.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": source.reasoning_tokens},
        "total_tokens": source.prompt_tokens + source.completion_tokens,
        # batchgen's own: failed requests are not billed (OpenAI's rule); their input apart
        "failed_input_tokens": source.failed_prompt_tokens,
    }
    metadata = dict(record.metadata or {})
    errors = _errors(record, job)
    if record.output:
        metadata["batchgen_job_id"] = record.id
        metadata["batchgen_result"] = redact_uri(f"{record.output.rstrip('/')}/{RESULT}")
    out: dict[str, Any] = {
        "id": record.id,
        "object": "batch",
        "endpoint": record.endpoint,
        "model": record.model or None,
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": record.input_file_id,
        "completion_window": record.completion_window,
        "status": status(record, job),
        "output_file_id": record.output_file_id or None,
        "error_file_id": record.error_file_id or None,
        "created_at": record.created_at,
        "expires_at": record.expires_at,
        "request_counts": counts,
        "usage": usage,
        "metadata": metadata or None,
    }
    for name in TIMES:
        out[name] = getattr(record, name) or None
    return out
