"""OpenAI's Files API: upload (streamed to the files store), list, get, content, delete.

Every file is its uploader's tenant's (api_keys.py): another tenant's is a 404.
An upload expires after ``expires_after`` (OpenAI's form fields
``expires_after[anchor]=created_at`` and ``expires_after[seconds]=N``), else after
the server's ``--file-expiry``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse

from batchgen.interface_errors import APIError, UploadTooLarge
from batchgen.serve import openai_errors
from batchgen.serve.auth import Who
from batchgen.serve.batch.batch_request import EXPIRES_AFTER_S, ExpiresAfter
from batchgen.serve.batch.batches import Batches
from batchgen.serve.files import FileStore, new_file_id
from batchgen.serve.settings import ServeConfig
from batchgen.serve.upload import MultipartUpload

MULTIPART_SLACK = 1 << 20  # a request may exceed the file's size by its multipart framing
DRAIN_FACTOR = 4  # a too-large body is read (and dropped) up to this many limits, for a clean 413


def router(store: FileStore, batches: Batches, config: ServeConfig) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/files")
    async def create_file(request: Request, who: Who) -> Any:
        limit = config.max_file_bytes
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > limit + MULTIPART_SLACK:
            return await _too_large(request, limit)
        upload = MultipartUpload(request.headers.get("content-type", ""))
        file_id = new_file_id()
        try:
            with store.writing(file_id) as out:
                async for chunk in request.stream():
                    for data in upload.feed(chunk):
                        out.write(data)
                    if upload.file_bytes > limit:
                        raise UploadTooLarge
                upload.finish()
                purpose = upload.fields.get("purpose")
                if upload.filename is None:
                    raise APIError(400, "no file part named 'file'", "invalid_request", "file")
                if purpose != "batch":
                    raise APIError(400, "purpose must be 'batch' (the only one served here)",
                                   "invalid_request", "purpose")  # fmt: skip
                expiry = _expiry(upload.fields, config.file_expiry_s)
        except UploadTooLarge:
            return await _too_large(request, limit)
        created = int(time.time())
        obj = await run_in_threadpool(
            store.register, file_id, upload.filename or "upload.jsonl", purpose,
            upload.file_bytes, who.tenant, created + expiry if expiry else 0,
        )  # fmt: skip
        return obj.to_openai()

    @api.get("/v1/files")
    def list_files(who: Who, purpose: str | None = None, after: str | None = None,
                   limit: int = 100) -> Any:  # fmt: skip
        page, more = store.page(who, purpose, after, checked_limit(limit, 10_000))
        return listing([f.to_openai() for f in page], more)

    @api.get("/v1/files/{file_id}")
    def get_file(file_id: str, who: Who) -> Any:
        return store.get(file_id, who).to_openai()

    @api.get("/v1/files/{file_id}/content")
    def file_content(file_id: str, who: Who) -> Response:
        store.get(file_id, who)
        if not store.exists(file_id):
            raise APIError(404, f"the bytes of file {file_id!r} are gone from the files dir",
                           code="file_missing")  # fmt: skip
        local = store.local_path(file_id)
        if local is not None:
            return FileResponse(local, media_type="application/octet-stream")
        return StreamingResponse(_chunks(store, file_id), media_type="application/octet-stream")

    @api.delete("/v1/files/{file_id}")
    def delete_file(file_id: str, who: Who) -> Any:
        obj = store.get(file_id, who)
        store.delete(obj, in_use=batches.uses_file(file_id))
        return {"id": file_id, "object": "file", "deleted": True}

    return api


def _expiry(fields: dict[str, str], default_s: int) -> int:
    """Seconds from the form fields ``expires_after[anchor]`` and ``expires_after[seconds]``
    (OpenAI's ExpiresAfter object); ``default_s`` when neither is given."""
    anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return default_s
    number = int(seconds) if seconds is not None and seconds.isdecimal() else seconds
    try:
        return ExpiresAfter.model_validate({"anchor": anchor, "seconds": number}).seconds
    except ValidationError:
        low, high = EXPIRES_AFTER_S
        raise APIError(400, f'expires_after must be {{"anchor": "created_at", "seconds": N}} '
                       f"with N from {low} to {high}", "invalid_request", "expires_after") from None  # fmt: skip


async def _too_large(request: Request, limit: int) -> JSONResponse:
    """413, after reading (and dropping) the rest of the body so the client sees it."""
    seen = 0
    with contextlib.suppress(Exception):
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > DRAIN_FACTOR * limit:
                break
    return openai_errors.response(413, f"the file is over this server's limit of {limit:,} bytes",
                           "file_too_large", "file")  # fmt: skip


def checked_limit(limit: int, most: int) -> int:
    if not 1 <= limit <= most:
        raise APIError(400, f"limit must be from 1 to {most}", "invalid_request", "limit")
    return limit


def listing(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}  # fmt: skip


def _chunks(store: FileStore, file_id: str) -> Iterator[bytes]:
    with store.open(file_id) as src:
        while chunk := src.read(1 << 20):
            yield bytes(chunk)
