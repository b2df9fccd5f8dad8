"""Who a request is: API keys, their tenants, and what each may see.

Each ``--api-key`` is a tenant of its own (named ``key-`` and a hash of the key:
the name never reveals the key). A keys file (``--keys-file``) names them: one key
a line, ``KEY TENANT`` or ``KEY TENANT admin``, ``#`` starts a comment. Keys of one
tenant share its batches, files and jobs; an admin key sees every tenant's, and
the jobs submitted without serve (the CLI's, which have no tenant). Another
tenant's object does not exist for a key: 404, as for an id never made. Without
any key the server is one user's (loopback only) and that user is an admin.

The keys file is read again on SIGHUP and when it changes (its mtime, size and
inode, looked at no more than once a second, on the next request): a key no
longer listed is refused from then on, and so are the dashboard sessions signed
in with it (a session holds its key's id, looked up in the current keys). A new
file that cannot be read or is invalid changes nothing: the keys in force stay,
and one log line says why.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from batchgen.jobs.schema.errors import UsageError

log = logging.getLogger(__name__)
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


FILE_CHECK_S = 1.0  # how often a request may look at the keys file's mtime


@dataclass(slots=True)
class KeyRing:
    """The server's keys and who each one is."""

    principals: dict[str, Principal] = field(default_factory=dict)  # key -> who
    keys: tuple[str, ...] = ()  # --api-key / BATCHGEN_API_KEYS: fixed for the run
    keys_file: str | None = None  # read again on SIGHUP and when it changes
    stamp: tuple[int, int, int] | None = None  # the file's (mtime, size, inode) last read
    checked: float = 0.0  # when a request last looked at the file (monotonic)

    @property
    def open(self) -> bool:
        """No key at all: every request is the one user's."""
        return not self.principals

    @classmethod
    def load(cls, keys: list[str], keys_file: str | None = None) -> KeyRing:
        """``keys`` (each its own tenant) and the keys file's (which wins for a key in both);
        a keys file mistake is a UsageError."""
        ring = cls(keys=tuple(keys), keys_file=keys_file, checked=time.monotonic())
        ring.principals = ring._read()
        return ring

    def reload(self) -> None:
        """Read the keys file again (SIGHUP, or it changed): its keys replace the ones in
        force at once. One that cannot be read or is invalid keeps them, in one log line."""
        if not self.keys_file:
            return
        try:
            self.principals = self._read()
        except UsageError as exc:
            log.error("%s; keeping the %d keys in force", exc, len(self.principals))
            return
        log.warning("--keys-file %s read again: %d keys", self.keys_file, len(self.principals))

    def _read(self) -> dict[str, Principal]:
        out = {k: Principal(f"key-{key_id(k)[:12]}", False, key_id(k)) for k in self.keys}
        if self.keys_file:
            self.stamp = _stamp(self.keys_file)  # before reading: a change while read is seen
            out.update(_read_keys_file(self.keys_file))
        return out

    def _fresh(self) -> None:
        """Reload when the keys file changed, looking at it at most once a FILE_CHECK_S."""
        now = time.monotonic()
        if not self.keys_file or now - self.checked < FILE_CHECK_S:
            return
        self.checked = now
        if _stamp(self.keys_file) != self.stamp:
            self.reload()

    def find(self, given: str) -> Principal | None:
        """Who ``given`` is, compared with every key in constant time; None: no key."""
        self._fresh()
        found = None
        for key, who in self.principals.items():  # no early exit: the time says nothing
            if hmac.compare_digest(given.encode(), key.encode()):
                found = who
        return found

    def by_id(self, wanted: str) -> Principal | None:
        """The principal whose key has ``key_id`` (a session's), while that key is configured."""
        self._fresh()
        return next((p for p in self.principals.values() if p.key_id == wanted), None)


def _stamp(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


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
