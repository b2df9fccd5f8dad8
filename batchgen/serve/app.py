"""The FastAPI app: OpenAI's Files and Batches API under /v1, the dashboard at /."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import redis
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.schema.errors import BatchgenError, JobNotFound
from batchgen.serve import dashboard, openai_errors
from batchgen.serve.auth import COOKIE, authorized, key_ok, require_key
from batchgen.serve.batches import Batches
from batchgen.serve.files import FileStore, new_file_id
from batchgen.serve.openai_errors import APIError
from batchgen.serve.series import Sampler, read_series
from batchgen.serve.settings import ServeConfig
from batchgen.serve.upload import MultipartUpload

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"
MULTIPART_SLACK = 1 << 20  # a request may exceed the file's size by its multipart framing
DRAIN_FACTOR = 4  # a too-large body is read (and dropped) up to this many limits, for a clean 413


def create_app(config: ServeConfig, conn: redis.Redis, keys: Keys) -> FastAPI:
    store = FileStore(conn, keys, config.files_dir)
    batches = Batches(conn, keys, config, store)
    sampler = Sampler(conn, keys, config.sample_s)
    stop = threading.Event()

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        thread = threading.Thread(target=_background, args=(batches, sampler, config, stop),
                                  name="batchgen-serve-sweep", daemon=True)  # fmt: skip
        thread.start()
        yield
        stop.set()
        thread.join(timeout=5)
        batches.pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="batchgen", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)  # fmt: skip
    app.state.config = config
    app.add_exception_handler(APIError, openai_errors.on_api_error)
    app.add_exception_handler(HTTPException, openai_errors.on_http_error)
    app.add_exception_handler(RequestValidationError, openai_errors.on_validation_error)
    app.add_exception_handler(BatchgenError, _on_batchgen_error)
    app.add_exception_handler(redis.ConnectionError, _on_redis_down)
    app.add_exception_handler(redis.TimeoutError, _on_redis_down)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    auth = [Depends(require_key)]

    # -- files ----------------------------------------------------------------------

    @app.post("/v1/files", dependencies=auth)
    async def create_file(request: Request) -> Any:
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
                        raise _TooLarge
                upload.finish()
                purpose = upload.fields.get("purpose")
                if upload.filename is None:
                    raise APIError(400, "no file part named 'file'", "invalid_request", "file")
                if purpose != "batch":
                    raise APIError(400, "purpose must be 'batch' (the only one served here)",
                                   "invalid_request", "purpose")  # fmt: skip
        except _TooLarge:
            return await _too_large(request, limit)
        obj = store.register(file_id, upload.filename or "upload.jsonl", purpose, upload.file_bytes)
        return obj.to_openai()

    @app.get("/v1/files", dependencies=auth)
    def list_files(purpose: str | None = None, after: str | None = None, limit: int = 100) -> Any:
        page, more = store.page(purpose, after, _limit(limit, 10_000))
        return _page([f.to_openai() for f in page], more)

    @app.get("/v1/files/{file_id}", dependencies=auth)
    def get_file(file_id: str) -> Any:
        return store.get(file_id).to_openai()

    @app.get("/v1/files/{file_id}/content", dependencies=auth)
    def file_content(file_id: str) -> Response:
        store.get(file_id)
        local = store.local_path(file_id)
        if local is not None:
            return FileResponse(local, media_type="application/octet-stream")
        from starlette.responses import StreamingResponse

        return StreamingResponse(_chunks(store, file_id), media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}", dependencies=auth)
    def delete_file(file_id: str) -> Any:
        store.delete(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    # -- batches --------------------------------------------------------------------

    @app.post("/v1/batches", dependencies=auth)
    async def create_batch(request: Request) -> Any:
        try:
            body = await request.json()
        except ValueError:
            raise APIError(400, "the body must be a JSON object", "invalid_request") from None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object", "invalid_request")
        from starlette.concurrency import run_in_threadpool

        return await run_in_threadpool(batches.create, body)

    @app.get("/v1/batches", dependencies=auth)
    def list_batches(after: str | None = None, limit: int = 20) -> Any:
        page, more = batches.page(after, _limit(limit, 100))
        return _page(page, more)

    @app.get("/v1/batches/{batch_id}", dependencies=auth)
    def get_batch(batch_id: str) -> JSONResponse:
        return JSONResponse(batches.get(batch_id))  # plain JSON already: no re-encoding

    @app.post("/v1/batches/{batch_id}/cancel", dependencies=auth)
    def cancel_batch(batch_id: str) -> Any:
        return batches.cancel(batch_id)

    # -- dashboard --------------------------------------------------------------------

    @app.get("/", response_class=HTMLResponse)
    def index(request: Request) -> HTMLResponse:
        if not authorized(request):
            return _login_page()
        page = (STATIC / "index.html").read_text()
        return HTMLResponse(page.replace("{{REFRESH_MS}}", str(config.refresh_ms)))

    @app.post("/login")
    async def login(request: Request) -> Response:
        form = await request.form()
        key = str(form.get("key") or "")
        if config.api_keys and not key_ok(key, config.api_keys):
            return _login_page("That key is not one of this server's keys.", 401)
        response = Response(status_code=303, headers={"location": "/"})
        response.set_cookie(COOKIE, key, httponly=True, samesite="strict",
                            secure=request.url.scheme == "https")  # fmt: skip
        return response

    @app.post("/logout")
    def logout() -> Response:
        response = Response(status_code=303, headers={"location": "/"})
        response.delete_cookie(COOKIE)
        return response

    @app.get("/api/overview", dependencies=auth)
    def api_overview() -> Any:
        return dashboard.overview(conn, keys)

    @app.get("/api/jobs", dependencies=auth)
    def api_jobs() -> Any:
        return dashboard.overview(conn, keys)["jobs"]

    @app.get("/api/jobs/{job_id}", dependencies=auth)
    def api_job(job_id: str) -> Any:
        return dashboard.job_detail(conn, keys, job_id)

    @app.post("/api/jobs/{job_id}/cancel", dependencies=auth)
    def api_cancel(job_id: str) -> Any:
        from batchgen.jobs.ops.cancellation import cancel

        return {"job_id": job_id, "state": cancel(conn, keys, job_id).value}

    @app.get("/api/workers", dependencies=auth)
    def api_workers() -> Any:
        series = read_series(conn, keys)
        return dashboard.workers(conn, keys, series[-1]["workers"] if series else {})

    @app.get("/api/series", dependencies=auth)
    def api_series() -> Any:
        return read_series(conn, keys)

    return app


class _TooLarge(Exception):
    pass


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


def _limit(limit: int, most: int) -> int:
    if not 1 <= limit <= most:
        raise APIError(400, f"limit must be from 1 to {most}", "invalid_request", "limit")
    return limit


def _page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}  # fmt: skip


def _chunks(store: FileStore, file_id: str) -> Iterator[bytes]:
    with store.open(file_id) as src:
        while chunk := src.read(1 << 20):
            yield bytes(chunk)


def _login_page(message: str = "", status: int = 200) -> HTMLResponse:
    page = (STATIC / "login.html").read_text()
    return HTMLResponse(page.replace("{{MESSAGE}}", message), status_code=status)


async def _on_batchgen_error(_request: Request, exc: Exception) -> JSONResponse:
    status = 404 if isinstance(exc, JobNotFound) else 400
    return openai_errors.response(status, str(exc), type(exc).__name__)


async def _on_redis_down(_request: Request, exc: Exception) -> JSONResponse:
    return openai_errors.response(503, f"Redis is unreachable: {exc}", "redis_unavailable")


def _background(batches: Batches, sampler: Sampler, config: ServeConfig,
                stop: threading.Event) -> None:  # fmt: skip
    """Expire and finish batches every tick; sample tok/s every sample_s."""
    next_sample = 0.0
    while not stop.wait(min(config.tick_s, config.sample_s) if next_sample else 0):
        try:
            batches.sweep()
            if time.monotonic() >= next_sample:
                sampler.sample()
                next_sample = time.monotonic() + config.sample_s
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("Redis unreachable (%s); retrying", exc)
        except Exception:
            log.exception("background sweep failed")
