"""The Redis layer's errors. A home apart from jobs/schema/errors.py because each is a kind
of a redis-py error (so every outage handler catches it), and the schema, which the engine
imports, never loads redis (tests/test_structure.py)."""

from __future__ import annotations

import redis


class RedisRefused(redis.ConnectionError):
    """An error reply that means an outage (OUTAGE_REPLIES); ``code`` says which."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code} {message}")
        self.code = code
