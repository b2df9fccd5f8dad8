"""A finished batch's output files from its job's ``result.parquet``: one OpenAI
batch-output line per succeeded request in ``output_file_id``, the failed and
cancelled ones in ``error_file_id``; read in record batches, written streaming."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow.parquet as pq

from batchgen.jobs.intake.lines import read_lines
from batchgen.jobs.ops.finalize.result import RESULT
from batchgen.jobs.ops.job_record import JobRecord
from batchgen.jobs.schema.rows import SUCCEEDED, FinishReason
from batchgen.jobs.storage.output_store import OutputDir
from batchgen.serve.batch.batch_lifecycle import BatchState
from batchgen.serve.batch.batch_record import BatchRecord
from batchgen.serve.files import FileStore, new_file_id

COLUMNS = ["index", "id", "text", "finish_reason", "error", "prompt_tokens",
           "completion_tokens", "cached_tokens", "choices", "logprobs", "embedding", "reasoning",
           "reasoning_tokens", "tool_calls"]  # fmt: skip
OK = SUCCEEDED


@dataclass(slots=True)
class Outputs:
    output_file_id: str
    error_file_id: str
    completed: int
    failed: int  # requests that ran and failed (OpenAI's count: cancelled ones are not)


def request_hash(batch_id: str, index: int) -> str:
    return hashlib.blake2b(f"{batch_id}/{index}".encode(), digest_size=12).hexdigest()


def completion_body(batch: BatchRecord, row: dict[str, Any], created: int) -> dict[str, Any]:
    h = request_hash(batch.id, row["index"])
    prompt, completion = row["prompt_tokens"] or 0, row["completion_tokens"] or 0
    if batch.endpoint == "/v1/embeddings":
        return {"object": "list", "model": batch.model,
                "data": [{"object": "embedding", "index": 0, "embedding": row["embedding"]}],
                "usage": {"prompt_tokens": prompt, "total_tokens": prompt}}  # fmt: skip
    usage = {"prompt_tokens": prompt, "completion_tokens": completion,
             "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": row["cached_tokens"] or 0},
             "completion_tokens_details": {
                 "reasoning_tokens": row.get("reasoning_tokens") or 0}}  # fmt: skip
    samples = row.get("choices") or [
        {"index": 0, "text": row["text"], "finish_reason": row["finish_reason"],
         "logprobs": row.get("logprobs"), "reasoning": row.get("reasoning"),
         "tool_calls": row.get("tool_calls")}
    ]  # n > 1: every sample  # fmt: skip
    if batch.endpoint == "/v1/completions":
        choices = [{"text": c["text"], "index": c["index"],
                    "logprobs": completion_logprobs(c.get("logprobs")),
                    "finish_reason": c["finish_reason"]} for c in samples]  # fmt: skip
        return {"id": f"cmpl-{h}", "object": "text_completion", "created": created,
                "model": batch.model, "choices": choices, "usage": usage}  # fmt: skip
    choices = [{"index": c["index"], "logprobs": chat_logprobs(c.get("logprobs")),
                "finish_reason": c["finish_reason"], "message": chat_message(c)}
               for c in samples]  # fmt: skip
    return {"id": f"chatcmpl-{h}", "object": "chat.completion", "created": created,
            "model": batch.model, "choices": choices, "usage": usage,
            "system_fingerprint": None}  # fmt: skip


def chat_message(sample: dict[str, Any]) -> dict[str, Any]:
    """A choice's ``message``; with a reasoning parser, its reasoning as vLLM returns it;
    with tool calls, OpenAI's ``tool_calls`` (and no content when none came with them)."""
    calls = sample.get("tool_calls")
    content = None if calls and not sample["text"].strip() else sample["text"]
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if calls:
        message["tool_calls"] = calls
    if sample.get("reasoning") is not None:
        message["reasoning_content"] = sample["reasoning"]
    return message


def chat_logprobs(tokens: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The logprobs column as a chat.completion choice's ``logprobs``."""
    if tokens is None:
        return None

    def entry(t: dict[str, Any]) -> dict[str, Any]:
        return {"token": t["token"], "logprob": t["logprob"], "bytes": list(t["token"].encode())}

    content = [entry(t) | {"top_logprobs": [entry(alt) for alt in t["top"]]} for t in tokens]
    return {"content": content, "refusal": None}


def completion_logprobs(tokens: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The logprobs column as a text_completion choice's ``logprobs``."""
    if tokens is None:
        return None
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t["token"])
    return {"tokens": [t["token"] for t in tokens],
            "token_logprobs": [t["logprob"] for t in tokens],
            "top_logprobs": [{alt["token"]: alt["logprob"] for alt in t["top"]} for t in tokens],
            "text_offset": offsets}  # fmt: skip


def output_line(batch: BatchRecord, row: dict[str, Any], created: int) -> tuple[dict, bool]:
    """(the line, whether the request succeeded)."""
    h = request_hash(batch.id, row["index"])
    line: dict[str, Any] = {"id": f"batch_req_{h}", "custom_id": row["id"]}
    reason = row["finish_reason"]
    if reason in OK:
        body = completion_body(batch, row, created)
        line |= {"response": {"status_code": 200, "request_id": f"req_{h}", "body": body},
                 "error": None}  # fmt: skip
        return line, True
    if reason == FinishReason.CANCELLED.value:
        code, message = (
            ("batch_expired", "This request could not be executed before the completion "
             "window expired.") if batch.state == BatchState.EXPIRING
            else ("batch_cancelled", "This request was not executed: the batch was cancelled.")
        )  # fmt: skip
        line |= {"response": None, "error": {"code": code, "message": message}}
        return line, False
    error = {"message": row["error"] or "the request failed", "type": "server_error",
             "param": None, "code": None}  # fmt: skip
    line |= {"response": {"status_code": 500, "request_id": f"req_{h}",
                          "body": {"error": error}}, "error": None}  # fmt: skip
    return line, False


def custom_ids(path: str) -> Iterator[str | None]:
    """The custom_id of each request line of the input file, in order (row i is line i:
    a batch's file has no invalid line), then None for ever."""
    with open(path, "rb") as src:
        for _, raw in read_lines(src):
            try:
                value = json.loads(raw) if isinstance(raw, bytes) else None
            except ValueError:
                value = None
            yield value.get("custom_id") if isinstance(value, dict) else None
    while True:
        yield None


def write_outputs(store: FileStore, batch: BatchRecord, job: JobRecord,
                  halfway: Callable[[], None] = lambda: None) -> Outputs:  # fmt: skip
    """Write both files (an empty one is dropped) and register them (the batch's tenant's,
    expiring with the batch's ``output_expiry_s``). ``halfway``: called once the first
    rows are written (a crash point).

    Rows finalize made up for requests that never ran (cancelled) carry no id: their
    custom_id is read from the input file, walked in step with the rows. The input is
    kept while its batch is open (files.py), so only bytes removed behind the server's
    back leave those ids null; every row still gets its line."""
    with contextlib.ExitStack() as stack:
        if store.exists(batch.input_file_id):
            ids = custom_ids(stack.enter_context(store.as_local_file(batch.input_file_id)))
        else:
            ids = itertools.repeat(None)
        return _write(store, batch, job, ids, halfway)


def _write(store: FileStore, batch: BatchRecord, job: JobRecord, ids: Iterator[str | None],
           halfway: Callable[[], None]) -> Outputs:  # fmt: skip
    created = int(job.finished_at or job.created_at)
    ok_id, err_id = new_file_id(), new_file_id()
    counts, sizes, cancelled = [0, 0], [0, 0], 0
    started = False
    src_dir = OutputDir.open(job.output)
    with (
        src_dir.open_input(RESULT) as src,
        store.writing(ok_id) as ok_out,
        store.writing(err_id) as err_out,
    ):
        sinks = (err_out, ok_out)
        for record_batch in pq.ParquetFile(src).iter_batches(batch_size=4096, columns=COLUMNS):
            for row in record_batch.to_pylist():
                from_input = next(ids)  # advanced for every row: the input walks in step
                row["id"] = row["id"] if row["id"] is not None else from_input
                line, good = output_line(batch, row, created)
                data = (json.dumps(line, ensure_ascii=False) + "\n").encode()
                sinks[good].write(data)
                counts[good] += 1
                cancelled += row["finish_reason"] == FinishReason.CANCELLED.value
                sizes[good] += len(data)
            if not started:  # the first record batch is in the temp files
                ok_out.flush()
                err_out.flush()
                halfway()
                started = True
    expires = int(time.time()) + batch.output_expiry_s if batch.output_expiry_s else 0
    kept = []
    for which, file_id, label in ((1, ok_id, "output"), (0, err_id, "error")):
        if counts[which]:
            store.register(file_id, f"{batch.id}_{label}.jsonl", "batch_output", sizes[which],
                           batch.tenant, expires)  # fmt: skip
            kept.append(file_id)
        else:
            store.dir.delete_file(file_id)
            kept.append("")
    return Outputs(kept[0], kept[1], counts[1], counts[0] - cancelled)
