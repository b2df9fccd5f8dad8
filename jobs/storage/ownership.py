"""One job per output directory: a marker file claims it, written (and read back) at submit.

``OUTPUT/batchgen-job.json`` names the job that owns the directory and a token
kept in the job's record (submission.py derives it from the job id and the Redis's
own random identity: a submit interrupted after its claim finds its marker again). Submit refuses a directory whose marker names
another job (or the same job id from another Redis: another token), and a
non-empty directory without a marker (someone's data: finalize would overwrite
a ``result.parquet`` there). The same job re-submitted finds its own marker:
idempotent. Writing the marker is also the probe that the output can be
written at all: an unreachable store or a path that is not a directory fails
the submit before anything is queued.

Locally the marker is created atomically (link of a finished temp file: it
appears whole and only if absent). Object stores have no create-if-absent in
pyarrow.fs: there, two submits racing on one new prefix may both pass; a
job's parts live under ``parts/JOB/`` and finalize deletes only its own, so
even then one job never deletes the other's rows.
"""

from __future__ import annotations

import json
import os
import time
import uuid

import pyarrow as pa
import pyarrow.fs as pafs

from batchgen.jobs.schema.errors import JobConflict, OutputError
from batchgen.jobs.storage.output_store import TEMP_PREFIX, OutputDir

MARKER = "batchgen-job.json"


def claim(out: OutputDir, job_id: str, token: str) -> None:
    """Make ``out`` this job's directory, or raise JobConflict / OutputError."""
    body = json.dumps({"job_id": job_id, "token": token, "created_at": time.time()}).encode()
    owner = _read(out)
    if owner is None:
        _refuse_foreign_content(out)
        _create(out, body)
        owner = _read(out)
    if owner is None:
        raise OutputError(f"cannot read back {out.file(MARKER)} just written: is {out.uri} a "
                          "directory batchgen can write and read?")  # fmt: skip
    if owner.get("job_id") != job_id or owner.get("token") != token:
        other = owner.get("job_id", "?")
        same = " (the same job id, submitted to another Redis)" if other == job_id else ""
        raise JobConflict(
            f"output directory {out.uri} already belongs to job {other!r}{same}; give this job "
            f"a directory of its own with --output (or delete that job: batchgen delete {other} "
            "--outputs)"
        )


def _read(out: OutputDir) -> dict | None:
    try:
        if not out.exists(MARKER):
            return None
        data = json.loads(out.read_bytes(MARKER))
    except ValueError:
        data = {}
    except (OSError, pa.ArrowException) as exc:
        raise OutputError(f"cannot use output directory {out.uri}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _refuse_foreign_content(out: OutputDir) -> None:
    try:
        info = out.fs.get_file_info(out.path)
        if info.type == pafs.FileType.NotFound:
            return
        if info.type != pafs.FileType.Directory:
            raise OutputError(f"output {out.uri} exists and is not a directory")
        entries = out.fs.get_file_info(pafs.FileSelector(out.path, recursive=False))
    except (OSError, pa.ArrowException) as exc:
        raise OutputError(f"cannot use output directory {out.uri}: {exc}") from exc
    if entries:
        names = ", ".join(sorted(os.path.basename(e.path) for e in entries)[:3])
        raise JobConflict(
            f"output directory {out.uri} is not empty ({names}, ...) and belongs to no batchgen "
            "job; give a new or empty directory with --output"
        )


def _create(out: OutputDir, body: bytes) -> None:
    if not out.local:
        out.write_atomic((MARKER,), body)
        return
    final = out.file(MARKER)
    try:
        os.makedirs(out.path, exist_ok=True)
        tmp = f"{out.path}/{TEMP_PREFIX}{uuid.uuid4().hex}-{MARKER}"
        with open(tmp, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, final)  # atomic, and only if absent: a racing submit loses here
        except FileExistsError:
            pass  # someone else's claim: _read decides
        finally:
            os.unlink(tmp)
    except OSError as exc:
        raise OutputError(f"cannot write to output directory {out.uri}: {exc}") from exc
