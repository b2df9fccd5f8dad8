"""HTTP errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from batchgen.interface_errors import APIError

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 409: "invalid_request_error",
         413: "invalid_request_error", 422: "invalid_request_error"}  # fmt: skip


PARAM_PART = 100  # chars of each part of a param's path shown (a metadata key may be longer)
BODY_NOT_JSON = "the body must be a JSON object, sent as Content-Type: application/json"


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
    """A request FastAPI refused (a route's pydantic body, or a query or path parameter):
    400 as OpenAI answers (not FastAPI's 422), naming the first wrong parameter by its
    dotted path in the body (``metadata.k``, ``output_expires_after.seconds``)."""
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    loc = tuple(first.get("loc", ()))
    if loc[:1] == ("body",) and (len(loc) == 1 or first.get("type") == "json_invalid"):
        # not JSON, not an object, or not sent as application/json (FastAPI reads no other)
        return response(400, BODY_NOT_JSON, code="invalid_request")
    where = ".".join(str(part)[:PARAM_PART] for part in loc[1:]) or None
    return response(400, f"{where or 'request'}: {first.get('msg', 'invalid request')}",
                    code="invalid_request", param=where)  # fmt: skip
