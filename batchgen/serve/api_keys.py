"""Who a request is: API keys, their tenants, and what each may see.

Each ``--api-key`` is a tenant of its own (named ``key-`` and a hash of the key:
the name never reveals the key). A keys file (``--keys-file``) names them: one key
a line, ``KEY TENANT`` or ``KEY TENANT admin``, ``#`` starts a comment. Keys of one
tenant share its batches, files and jobs; an admin key sees every tenant's, and
the jobs submitted without serve (the CLI's, which have no tenant). Another
tenant's object does not exist for a key: 404, as for an id never made. Without
any key the server is one user's (loopback only) and that user is an admin.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass, field
from pathlib import Path

from batchgen.jobs.schema.errors import UsageError

TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
ADMIN = "admin"


@dataclass(frozen=True, slots=True)
class Principal:
    tenant: str  # "" without keys (the one user) and for the CLI's jobs
    admin: bool = False
    key_id: str = ""  # a hash of the key (a dashboard session names it, never the key)

    def sees(self, tenant: str) -> bool:
        """Whether an object of ``tenant`` exists for this key."""
        return self.admin or tenant == self.tenant


OPEN = Principal("", admin=True)  # no key configured: the server's one user


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:24]


@dataclass(slots=True)
class KeyRing:
    """The server's keys and who each one is."""

    principals: dict[str, Principal] = field(default_factory=dict)  # key -> who

    @property
    def open(self) -> bool:
        """No key at all: every request is the one user's."""
        return not self.principals

    @classmethod
    def load(cls, keys: list[str], keys_file: str | None = None) -> KeyRing:
        """``keys`` (each its own tenant) and the keys file's (which wins for a key in both)."""
        ring = cls({k: Principal(f"key-{key_id(k)[:12]}", False, key_id(k)) for k in keys})
        if keys_file:
            ring.principals.update(_read_keys_file(keys_file))
        return ring

    def find(self, given: str) -> Principal | None:
        """Who ``given`` is, compared with every key in constant time; None: no key."""
        found = None
        for key, who in self.principals.items():  # no early exit: the time says nothing
            if hmac.compare_digest(given.encode(), key.encode()):
                found = who
        return found

    def by_id(self, wanted: str) -> Principal | None:
        """The principal whose key has ``key_id`` (a session's), while that key is configured."""
        return next((p for p in self.principals.values() if p.key_id == wanted), None)


def _read_keys_file(path: str) -> dict[str, Principal]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--keys-file {path}: cannot read it ({exc})") from None
    out: dict[str, Principal] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"--keys-file {path}, line {number}"
        if len(words) not in (2, 3) or (len(words) == 3 and words[2] != ADMIN):
            raise UsageError(f"{where}: write KEY TENANT, or KEY TENANT admin")
        key, tenant = words[0], words[1]
        if not TENANT_NAME.fullmatch(tenant):
            raise UsageError(f"{where}: a tenant is 1-64 letters, digits, '_', '.' or '-' "
                             "(starting with a letter or digit)")  # fmt: skip
        if key in out:
            raise UsageError(f"{where}: this key is listed twice")
        out[key] = Principal(tenant, len(words) == 3, key_id(key))
    if not out:
        raise UsageError(f"--keys-file {path}: it lists no key")
    return out
