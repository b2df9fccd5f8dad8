"""HTTP errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 409: "invalid_request_error",
         413: "invalid_request_error", 422: "invalid_request_error"}  # fmt: skip


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None,
                 param: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def not_found(what: str, item_id: str) -> APIError:
    return APIError(404, f"No such {what}: {item_id!r}", code="not_found")


def body(status: int, message: str, code: str | None = None,
         param: str | None = None) -> dict[str, Any]:  # fmt: skip
    kind = TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def response(status: int, message: str, code: str | None = None,
             param: str | None = None) -> JSONResponse:  # fmt: skip
    return JSONResponse(body(status, message, code, param), status_code=status)


async def on_api_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return response(exc.status, exc.message, exc.code, exc.param)


async def on_http_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    return response(exc.status_code, str(exc.detail))


async def on_validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    return response(400, f"{where or 'request'}: {first.get('msg', 'invalid request')}",
                    code="invalid_request", param=where)  # fmt: skip
