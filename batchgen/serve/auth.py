"""API keys: ``Authorization: Bearer KEY`` for the API, or the dashboard's cookie.

Keys are compared in constant time. Without any key configured the server
binds to loopback only (cli/serve.py) and every request is let through.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from batchgen.serve.openai_errors import APIError

COOKIE = "batchgen_key"


def key_ok(given: str, keys: list[str]) -> bool:
    ok = False
    for key in keys:  # no early exit: the time taken does not say which key matched
        ok |= hmac.compare_digest(given.encode(), key.encode())
    return ok


def request_key(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return request.cookies.get(COOKIE, "")


def authorized(request: Request) -> bool:
    keys: list[str] = request.app.state.config.api_keys
    return not keys or key_ok(request_key(request), keys)


async def require_key(request: Request) -> None:
    """A route dependency: 401 in OpenAI's shape without a valid key. (async: it does no
    I/O, and FastAPI would run a plain function in its thread pool, one hop per request)"""
    if not authorized(request):
        raise APIError(
            401,
            "Incorrect API key provided. Pass it as 'Authorization: Bearer KEY' (one of the "
            "server's --api-key / BATCHGEN_API_KEYS).",
            code="invalid_api_key",
        )
