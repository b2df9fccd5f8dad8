"""How long a finished job's Redis state is kept (its outputs stay).

A job's record, error rows and dead letters expire ``retention`` after it
finishes (default 7 days; ``batchgen submit --retention``, else
``BATCHGEN_RETENTION``); ``batchgen delete`` removes them at once.
"""

from __future__ import annotations

import re

from batchgen.jobs.environment import RETENTION
from batchgen.jobs.schema.errors import UsageError

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"(\d{1,9})([smhdw]?)")


def duration_s(raw: str, what: str) -> int:
    """``7d``, ``36h``, ``90m``, ``3600`` (seconds) -> seconds."""
    match = _DURATION.fullmatch(raw.strip())
    if match is None:
        raise UsageError(f"{what} {raw!r}: give a duration like 7d, 36h, 90m or 3600 (seconds)")
    return int(match.group(1)) * _UNITS[match.group(2) or "s"]


def parse(raw: str, what: str = "--retention") -> int:
    """A retention (``duration_s``); at least a minute."""
    seconds = duration_s(raw, what)
    if not 60 <= seconds <= 10 * 365 * 86400:
        raise UsageError(f"{what} {raw!r}: give a duration between a minute and ten years")
    return seconds


def default() -> int:
    return parse(RETENTION.get() or "", RETENTION.name)
