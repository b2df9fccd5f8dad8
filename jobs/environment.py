"""Every ``BATCHGEN_*`` environment variable, declared once: its name, what a value is
(the class), its default and what it means. batchgen reads them only through here
(tests/test_environment.py checks the tree), and docs/commands.md's Environment table
lists each one.

A variable set to the empty string counts as unset, except where ``keeps_empty`` says
otherwise. A value that is not what the variable takes is a one-line ``UsageError``
that names the variable, never a traceback.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from batchgen.jobs.schema.errors import UsageError

_SIZE = re.compile(r"(\d+)\s*([KMGT]?)I?B?", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


@dataclass(frozen=True, slots=True)
class Variable:
    name: str
    meaning: str  # one line

    def raw(self) -> str | None:
        """The value as set; None when unset or empty."""
        return os.environ.get(self.name) or None

    def bad(self, raw: str, hint: str) -> UsageError:
        """The one-line error for a value this variable does not take."""
        return UsageError(f"{self.name}={raw!r}: {hint}")


@dataclass(frozen=True, slots=True)
class Text(Variable):
    """A string used as given (a URL, a name, a file the reader checks itself)."""

    default: str | None = None
    keeps_empty: bool = False  # an empty value is a value ("" is not unset)

    def get(self) -> str | None:
        value = os.environ.get(self.name)
        if value is None or (value == "" and not self.keeps_empty):
            return self.default
        return value


@dataclass(frozen=True, slots=True)
class Folder(Variable):
    """A local folder; ``~`` is expanded. Unset: None (the reader's fallback)."""

    def get(self) -> Path | None:
        raw = self.raw()
        return Path(raw).expanduser() if raw else None


@dataclass(frozen=True, slots=True)
class Number(Variable):
    """A number of ``unit`` from 0 up (fractions allowed)."""

    default: float = 0.0
    unit: str = "seconds"

    def get(self) -> float:
        raw = self.raw()
        if raw is None:
            return self.default
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not 0 <= value < math.inf:
            raise self.bad(raw, f"give a number of {self.unit}, 0 or more")
        return value


@dataclass(frozen=True, slots=True)
class Count(Variable):
    """A whole number; unset: None (the reader's fallback)."""

    def get(self) -> int | None:
        raw = self.raw()
        if raw is None:
            return None
        try:
            return int(raw)
        except ValueError:
            raise self.bad(raw, "give a whole number") from None


@dataclass(frozen=True, slots=True)
class Size(Variable):
    """Bytes, or with K/M/G/T (binary units: 10G is 10 << 30)."""

    default: int = 0

    def get(self) -> int:
        raw = (self.raw() or "").strip()
        if not raw:
            return self.default
        match = _SIZE.fullmatch(raw)
        if match is None:
            raise self.bad(raw, "give a size like 500M, 10G or 1048576")
        return int(match.group(1)) * _SIZE_UNITS[match.group(2).upper()]


@dataclass(frozen=True, slots=True)
class Names(Variable):
    """Comma-separated names; blanks around and between them are dropped."""

    def get(self) -> list[str]:
        return [name.strip() for name in (self.raw() or "").split(",") if name.strip()]


# -- Redis ---------------------------------------------------------------------------
REDIS_URL = Text(
    "BATCHGEN_REDIS_URL", "the Redis every command and worker uses; unset: the embedded one"
)
REDIS_CA = Text("BATCHGEN_REDIS_CA", "CA bundle that verifies a rediss:// server")
REDIS_CERT = Text("BATCHGEN_REDIS_CERT", "client certificate for rediss://")
REDIS_KEY = Text("BATCHGEN_REDIS_KEY", "the client certificate's key for rediss://")
REDIS_WAIT = Number(
    "BATCHGEN_REDIS_WAIT", "seconds a command waits for an unreachable Redis", default=10.0
)
PREFIX = Text("BATCHGEN_PREFIX", "prefix of every Redis key", default="bg", keeps_empty=True)

# -- where files live ------------------------------------------------------------------
HOME = Folder(
    "BATCHGEN_HOME",
    "data dir: embedded Redis, default outputs, weight digests; unset: "
    "$XDG_DATA_HOME/batchgen, else ~/.local/share/batchgen",
)
OUTPUT_ROOT = Folder(
    "BATCHGEN_OUTPUT_ROOT",
    "where jobs write without --output (embedded Redis only); unset: $BATCHGEN_HOME/outputs",
)
CACHE = Text(
    "BATCHGEN_CACHE",
    "the result cache's folder or object-store prefix; unset: $BATCHGEN_HOME/cache with "
    "the embedded Redis",
)
CACHE_MAX_BYTES = Size(
    "BATCHGEN_CACHE_MAX_BYTES", "the result cache's size limit", default=10 << 30
)

# -- submit ----------------------------------------------------------------------------
TENANT = Text(
    "BATCHGEN_TENANT",
    "a job's tenant without --tenant; unset: the login name; empty: none",
    keeps_empty=True,
)
RETENTION = Text(
    "BATCHGEN_RETENTION",
    "how long a finished job's Redis state is kept without --retention",
    default="7d",
)
SUBMIT_PROCS = Count(
    "BATCHGEN_SUBMIT_PROCS", "processes that validate a big input; unset: the CPU count, at most 8"
)
SPOOL_DIR = Text(
    "BATCHGEN_SPOOL_DIR", "where submit spools valid entries; unset: the system's temp dir"
)

# -- finalize --------------------------------------------------------------------------
FINALIZE_LEASE_S = Number(
    "BATCHGEN_FINALIZE_LEASE_S", "a finalizer silent this long is taken for dead", default=30.0
)
FINALIZE_RETRY_S = Number(
    "BATCHGEN_FINALIZE_RETRY_S",
    "first retry after a failed finalize; doubles each time",
    default=2.0,
)
FINALIZE_RETRY_CAP_S = Number(
    "BATCHGEN_FINALIZE_RETRY_CAP_S", "the longest wait between finalize retries", default=300.0
)
FINALIZE_WINDOW_BYTES = Number(
    "BATCHGEN_FINALIZE_WINDOW_BYTES",
    "rows finalize holds in memory at once (about)",
    default=float(256 << 20),
    unit="bytes",
)

# -- serve -----------------------------------------------------------------------------
API_KEYS = Names("BATCHGEN_API_KEYS", "batchgen serve's keys, comma-separated, without --api-key")
KEYS_FILE = Text("BATCHGEN_KEYS_FILE", "batchgen serve's keys file without --keys-file")

# -- fault tests -----------------------------------------------------------------------
TEST_CRASH_AT = Text(
    "BATCHGEN_TEST_CRASH_AT", "NAME[:N[:stop|exit]]: crash at a named point (fault tests)"
)
TEST_CRASH_ONCE = Text(
    "BATCHGEN_TEST_CRASH_ONCE", "a file: the crash point fires in the first process only"
)

VARIABLES: tuple[Variable, ...] = tuple(
    v for v in list(globals().values()) if isinstance(v, Variable)
)


def check_values() -> None:
    """Read every variable that takes a number or a size: a bad one is its one-line
    ``UsageError`` now (a long-running process checks at start, not at first use)."""
    for variable in VARIABLES:
        if isinstance(variable, (Number, Count, Size)):
            variable.get()
