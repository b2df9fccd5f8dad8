"""The batch record (``P:batch:ID``) and how a batch looks to OpenAI's client.

A batch's own phase is stored (validating, failed, submitted); once submitted
its status follows its batchgen job (same id) until the server has written its
output files, when ``final_status`` is fixed: the job's Redis state may expire
after that, the batch stays.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from batchgen.jobs.ops.job_record import JobRecord
from batchgen.jobs.ops.lifecycle import JobState
from batchgen.jobs.ops.result import RESULT
from batchgen.jobs.redis.keys import text_hash
from batchgen.jobs.storage.names import redact_uri

VALIDATING, FAILED, SUBMITTED = "validating", "failed", "submitted"
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
    phase: str = VALIDATING
    model: str = ""
    output: str = ""  # the job's output directory (its Parquet)
    errors: list[dict[str, Any]] = field(default_factory=list)
    output_file_id: str = ""
    error_file_id: str = ""
    final_status: str = ""  # set with the output files: completed, cancelled or expired
    total: int = 0
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0  # kept with the output files (the job's state may expire)
    completion_tokens: int = 0
    cached_tokens: int = 0
    cancel_requested: bool = False
    expiring: bool = False  # its window passed: unfinished requests were cancelled
    in_progress_at: int = 0
    finalizing_at: int = 0
    completed_at: int = 0
    failed_at: int = 0
    expired_at: int = 0
    cancelling_at: int = 0
    cancelled_at: int = 0

    def to_hash(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("metadata", "errors"):
                out[f.name] = json.dumps(value)
            elif isinstance(value, bool):
                out[f.name] = "1" if value else "0"
            else:
                out[f.name] = str(value)
        return out

    @classmethod
    def from_hash(cls, raw: object) -> BatchRecord:
        data = text_hash(raw)
        record = cls(id=data["id"])
        for f in fields(cls):
            if f.name == "id" or f.name not in data:
                continue
            value = data[f.name]
            if f.name in ("metadata", "errors"):
                setattr(record, f.name, json.loads(value))
            elif f.type == "bool":
                setattr(record, f.name, value == "1")
            elif f.type == "int":
                setattr(record, f.name, int(value or 0))
            else:
                setattr(record, f.name, value)
        return record


def status(record: BatchRecord, job: JobRecord | None) -> str:
    if record.final_status:
        return record.final_status
    if record.phase == VALIDATING:
        return "cancelling" if record.cancel_requested else VALIDATING
    if record.phase == FAILED or job is None:
        return FAILED
    state = job.state
    if state.live:
        return "in_progress"
    if record.expiring or state in (JobState.FINALIZING, JobState.COMPLETED):
        return "finalizing"  # output files are written once the job is done
    return "cancelling"


def to_openai(record: BatchRecord, job: JobRecord | None) -> dict[str, Any]:
    source: BatchRecord | JobRecord = record if record.final_status or job is None else job
    if isinstance(source, JobRecord):
        counts = {"total": source.total, "completed": source.done, "failed": source.failed}
    else:
        counts = {"total": record.total, "completed": record.completed, "failed": record.failed}
    usage = {
        "input_tokens": source.prompt_tokens,
        "input_tokens_details": {"cached_tokens": source.cached_tokens},
        "output_tokens": source.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": source.prompt_tokens + source.completion_tokens,
    }
    metadata = dict(record.metadata or {})
    if record.output:
        metadata["batchgen_job_id"] = record.id
        metadata["batchgen_result"] = redact_uri(f"{record.output.rstrip('/')}/{RESULT}")
    out: dict[str, Any] = {
        "id": record.id,
        "object": "batch",
        "endpoint": record.endpoint,
        "model": record.model or None,
        "errors": {"object": "list", "data": record.errors} if record.errors else None,
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
