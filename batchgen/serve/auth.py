"""Who is asking: ``Authorization: Bearer KEY`` for the API, a session for the dashboard.

Keys are compared in constant time (api_keys.py). Signing in to the dashboard
with a key makes a session: a random token in an HttpOnly, SameSite=Strict
cookie, of which Redis keeps only a hash (``P:serve:session:H``, with the key's
id, expiring after ``session_s``); signing out deletes it, so the cookie is
worthless after that, and a session ends when its key is no longer configured.
The cookie never holds the key. Without any key configured the server binds to
loopback only (cli/serve.py) and every request is its one user (an admin).
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Annotated

import redis
from fastapi import Depends, Request

from batchgen.interface_errors import APIError
from batchgen.jobs.redis.keys import Keys, text
from batchgen.serve.api_keys import OPEN, Principal

COOKIE = "batchgen_session"


def _token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Sessions:
    def __init__(self, conn: redis.Redis, keys: Keys, ttl_s: int) -> None:
        self.conn, self.keys, self.ttl_s = conn, keys, ttl_s

    def start(self, who: Principal) -> str:
        """A new session for ``who``: the cookie's value."""
        token = secrets.token_urlsafe(32)
        self.conn.set(self.keys.session(_token_hash(token)), who.key_id, ex=self.ttl_s)
        return token

    def key_of(self, token: str) -> str:
        """The key id a live session holds; "" when there is none."""
        return text(self.conn.get(self.keys.session(_token_hash(token)))) if token else ""

    def end(self, token: str) -> None:
        if token:
            self.conn.delete(self.keys.session(_token_hash(token)))


def bearer(request: Request) -> str:
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


def principal_of(request: Request) -> Principal | None:
    """Who sent ``request``: by its bearer key, else by its session cookie; None: nobody."""
    state = request.app.state
    ring = state.config.keyring
    if ring.open:
        return OPEN
    key = bearer(request)
    if key:
        return ring.find(key)
    session = state.sessions.key_of(request.cookies.get(COOKIE, ""))
    return ring.by_id(session) if session else None


async def require_key(request: Request) -> Principal:
    """A route dependency: who asks, or 401 in OpenAI's shape. (async: FastAPI would run a
    plain function in its thread pool, one hop per request)"""
    who = principal_of(request)
    if who is None:
        raise APIError(
            401,
            "Incorrect API key provided. Pass it as 'Authorization: Bearer KEY' (one of the "
            "server's --api-key / BATCHGEN_API_KEYS / --keys-file).",
            code="invalid_api_key",
        )
    return who


Who = Annotated[Principal, Depends(require_key)]  # a route's parameter: who asks
