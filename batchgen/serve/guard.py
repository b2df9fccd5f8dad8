"""What every response and every request goes through, before any route.

- Security headers on every response: a Content-Security-Policy that lets the
  dashboard load only its own script and style (no inline code, no framing),
  ``X-Frame-Options: DENY``, ``X-Content-Type-Options: nosniff``,
  ``Referrer-Policy: same-origin``.
- A request that changes something (POST, DELETE) sent by a browser from another
  site is refused (403): its ``Origin`` (else ``Referer``) must be this server's
  own. One that carries the dashboard's session cookie must say where it comes
  from at all; API clients (a bearer key, no cookie) send neither header.
- Without any key (loopback only), a ``Host`` other than a loopback name is
  refused (421), so a web page whose DNS name is rebound to 127.0.0.1 cannot
  reach the server.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

from batchgen.serve.auth import COOKIE
from batchgen.serve.openai_errors import body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGI = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
                Awaitable[None]]  # fmt: skip

HEADERS = [
    (b"content-security-policy", b"default-src 'none'; script-src 'self'; style-src 'self'; "
     b"img-src 'self' data:; connect-src 'self'; form-action 'self'; base-uri 'none'; "
     b"frame-ancestors 'none'"),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
]  # fmt: skip
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
CHANGES = ("POST", "PUT", "PATCH", "DELETE")


class Guard:
    """ASGI middleware (not Starlette's BaseHTTPMiddleware: uploads stream through as they are)."""

    def __init__(self, app: ASGI, loopback_only: bool) -> None:
        self.app, self.loopback_only = app, loopback_only

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.refusal(scope)
        if refusal is not None:
            status, message, code = refusal
            await _reply(send, status, body(status, message, code))
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *HEADERS]
            await send(message)

        await self.app(scope, receive, with_headers)

    def refusal(self, scope: Scope) -> tuple[int, str, str] | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}  # fmt: skip
        host = headers.get("host", "")
        if self.loopback_only and _hostname(host) not in LOOPBACK_NAMES:
            return 421, (f"Host {host[:100]!r} is not this server's: without an API key it "
                         "answers only to localhost, 127.0.0.1 or [::1]"), "misdirected_request"  # fmt: skip
        if scope["method"] not in CHANGES:
            return None
        origin = headers.get("origin") or _origin_of(headers.get("referer", ""))
        own = f"{scope.get('scheme', 'http')}://{host}"
        if origin and origin != own:
            return 403, (f"a request from {origin[:100]} may not change anything here "
                         "(cross-site)"), "cross_site_request"  # fmt: skip
        if (
            not origin
            and f"{COOKIE}=" in headers.get("cookie", "")
            and (not headers.get("authorization"))
        ):
            return 403, ("a signed-in browser's request must say where it comes from "
                         "(Origin)"), "cross_site_request"  # fmt: skip
        return None


def _hostname(host: str) -> str:
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _origin_of(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}" if parts.scheme and parts.netloc else ""


async def _reply(send: Any, status: int, payload: dict[str, Any]) -> None:
    data = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(data)).encode()), *HEADERS]})  # fmt: skip
    await send({"type": "http.response.body", "body": data})
