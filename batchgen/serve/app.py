"""The FastAPI app: OpenAI's Files and Batches API under /v1, the dashboard at /."""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import redis
from fastapi import BackgroundTasks, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from batchgen.interface_errors import APIError
from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.redis.lease import Lease
from batchgen.jobs.redis.outage_probe import OutageLog, refused_writes
from batchgen.jobs.schema.errors import BatchgenError, JobNotFound
from batchgen.serve import dashboard_api, files_api, openai_errors
from batchgen.serve.auth import COOKIE, Sessions, Who, principal_of
from batchgen.serve.batch.batch_request import CreateBatch
from batchgen.serve.batch.batches import Batches
from batchgen.serve.batch.validation import Validator
from batchgen.serve.files import FileStore
from batchgen.serve.guard import Guard
from batchgen.serve.series import RateSampler
from batchgen.serve.settings import ServeConfig
from batchgen.serve.sweep import Sweep

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"
VALIDATORS = 4  # threads validating batches (one may wait for a starting worker)


def create_app(config: ServeConfig, conn: redis.Redis, keys: Keys) -> FastAPI:
    # this server's id: its leases name it, its local temp uploads carry it (files.py)
    instance = secrets.token_hex(6)
    owner = f"serve-{instance}"
    store = FileStore(conn, keys, config.files_dir, instance)
    batches = Batches(conn, keys, config, store)
    pool = ThreadPoolExecutor(VALIDATORS, thread_name_prefix="batchgen-validate")
    validator = Validator(batches, owner)
    sweep = Sweep(batches, validator.validate, owner, pool)
    sampler = RateSampler(conn, keys, config.sample_s)
    stop = threading.Event()

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        alive = Lease(conn, keys.serve_instance(instance), config.lease_s, owner, retake=True)
        alive.__enter__()
        work = (conn, keys, sweep, sampler, config, stop)
        thread = threading.Thread(target=_background, args=work, name="batchgen-serve-sweep",
                                  daemon=True)  # fmt: skip
        thread.start()
        yield
        stop.set()
        thread.join(timeout=5)
        pool.shutdown(wait=False, cancel_futures=True)
        alive.__exit__(None, None, None)

    app = FastAPI(title="batchgen", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)  # fmt: skip
    app.state.config = config
    app.state.sessions = Sessions(conn, keys, config.session_s)
    app.add_middleware(Guard, loopback_only=config.keyring.open)
    app.add_exception_handler(APIError, openai_errors.on_api_error)
    app.add_exception_handler(HTTPException, openai_errors.on_http_error)
    app.add_exception_handler(RequestValidationError, openai_errors.on_validation_error)
    app.add_exception_handler(BatchgenError, _on_batchgen_error)
    app.add_exception_handler(redis.ConnectionError, _on_redis_down)
    app.add_exception_handler(redis.TimeoutError, _on_redis_down)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.include_router(files_api.router(store, batches, config))
    app.include_router(dashboard_api.router(conn, keys))

    # -- batches --------------------------------------------------------------------

    @app.post("/v1/batches")
    async def create_batch(body: CreateBatch, who: Who, after: BackgroundTasks) -> Any:
        record = await run_in_threadpool(batches.create, body, who)
        after.add_task(pool.submit, validator.validate, record.id)  # once the reply is out
        return batches.view(record)

    @app.get("/v1/batches")
    def list_batches(who: Who, after: str | None = None, limit: int = 20) -> Any:
        page, more = batches.page(who, after, files_api.checked_limit(limit, 100))
        return files_api.listing(page, more)

    @app.get("/v1/batches/{batch_id}")
    def get_batch(batch_id: str, who: Who) -> JSONResponse:
        return JSONResponse(batches.get(batch_id, who))  # plain JSON already: no re-encoding

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(batch_id: str, who: Who) -> Any:
        return batches.cancel(batch_id, who)

    # -- the dashboard's page and sign-in ----------------------------------------------

    @app.get("/", response_class=HTMLResponse)
    def index(request: Request) -> HTMLResponse:
        if principal_of(request) is None:
            return _login_page()
        page = (STATIC / "index.html").read_text()
        return HTMLResponse(page.replace("{{REFRESH_MS}}", str(config.refresh_ms)))

    @app.post("/login")
    async def login(request: Request) -> Response:
        form = await request.form()
        who = config.keyring.find(str(form.get("key") or ""))
        if who is None:
            return _login_page("That key is not one of this server's keys.", 401)
        response = Response(status_code=303, headers={"location": "/"})
        token = await run_in_threadpool(app.state.sessions.start, who)
        response.set_cookie(COOKIE, token, max_age=config.session_s, httponly=True,
                            samesite="strict", secure=request.url.scheme == "https")  # fmt: skip
        return response

    @app.post("/logout")
    def logout(request: Request) -> Response:
        app.state.sessions.end(request.cookies.get(COOKIE, ""))
        response = Response(status_code=303, headers={"location": "/"})
        response.delete_cookie(COOKIE)
        return response

    return app


def _login_page(message: str = "", status: int = 200) -> HTMLResponse:
    page = (STATIC / "login.html").read_text()
    return HTMLResponse(page.replace("{{MESSAGE}}", message), status_code=status)


async def _on_batchgen_error(_request: Request, exc: Exception) -> JSONResponse:
    status = 404 if isinstance(exc, JobNotFound) else 400
    return openai_errors.response(status, str(exc), type(exc).__name__)


async def _on_redis_down(_request: Request, exc: Exception) -> JSONResponse:
    return openai_errors.response(503, f"Redis cannot serve now: {exc}", "redis_unavailable")


def _background(conn: redis.Redis, keys: Keys, sweep: Sweep, sampler: RateSampler,
                config: ServeConfig, stop: threading.Event) -> None:  # fmt: skip
    """Expire and finish batches every tick; sample tok/s every sample_s. While Redis
    refuses writes or cannot be reached (outage_probe), the tick waits, and says so once."""
    outage = OutageLog(log, "the sweep of batches")
    next_sample = 0.0
    while not stop.wait(min(config.tick_s, config.sample_s) if next_sample else 0):
        try:
            refused = refused_writes(conn, keys)
            if refused is not None:
                outage.down(refused)
                continue
            outage.up()
            sweep.run()
            if time.monotonic() >= next_sample:
                sampler.sample()
                next_sample = time.monotonic() + config.sample_s
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            outage.down(f"Redis unavailable ({exc})")
        except Exception:
            log.exception("background sweep failed")
