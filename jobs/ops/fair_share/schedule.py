"""What a submitter asks of the scheduler for a job: its tenant, priority class and deadline.

- ``tenant``: who the job is for. Tenants share a model's workers by weight and are
  held to their quotas (tenants.py). ``submit --tenant``, else ``$BATCHGEN_TENANT``,
  else the user's login name, so people sharing a fleet share it fairly without
  asking; ``batchgen serve`` sets the API key's tenant ("" when it has none).
- ``priority``: the job's class; a higher class is dispatched first, whole.
- ``deadline``: when it should be done (``--deadline 6h`` or an ISO time); a job the
  fleet's rate says would miss it at its fair share is dispatched first, earliest
  deadline first (deadlines.py). ``expire``: cancel it at the deadline (its finished
  rows are kept) instead of reporting it late.
"""

from __future__ import annotations

import getpass
import re
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from batchgen.jobs.environment import TENANT
from batchgen.jobs.ops import retention
from batchgen.jobs.ops.fair_share.deadlines import deadline_view
from batchgen.jobs.ops.job_record import JobRecord
from batchgen.jobs.ops.usage import job_usage
from batchgen.jobs.schema.errors import UsageError

PRIORITY_LIMIT = 1000  # classes are -1000 .. 1000
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")


@dataclass(slots=True)
class Schedule:
    tenant: str = ""
    priority: int = 0
    deadline: float = 0.0  # unix s; 0.0: none
    expire: bool = False


def check_tenant(name: str) -> str:
    """A tenant name: letters, digits, ``. _ @ -``, at most 64 (it is part of Redis fields)."""
    if name and not _TENANT.fullmatch(name):
        raise UsageError(
            f"tenant {name!r}: use letters, digits, '.', '_', '@' and '-' (at most 64, "
            "starting with a letter or digit)"
        )
    return name


def default_tenant() -> str:
    """``$BATCHGEN_TENANT``, else the login name made a valid tenant name, else ""."""
    configured = TENANT.get()
    if configured is not None:
        return check_tenant(configured.strip())
    try:
        user = getpass.getuser()
    except (OSError, KeyError):
        return ""
    cleaned = re.sub(r"[^A-Za-z0-9._@-]", "-", user).lstrip("._@-")[:64]
    return cleaned


def check_priority(value: int) -> int:
    if not -PRIORITY_LIMIT <= value <= PRIORITY_LIMIT:
        raise UsageError(
            f"priority {value}: give a class from -{PRIORITY_LIMIT} to {PRIORITY_LIMIT}"
        )
    return value


def parse_deadline(raw: str, now: float | None = None) -> float:
    """``6h``, ``90m``, ``2d`` from now, or an ISO time (``2030-01-31T18:00``, local
    unless it has an offset) -> unix seconds."""
    now = time.time() if now is None else now
    text = raw.strip()
    if text and text[0].isdigit() and not re.fullmatch(r"\d{4}-\d{2}-\d{2}.*", text):
        seconds = retention.duration_s(text, "--deadline")
        if seconds <= 0:
            raise UsageError(f"--deadline {raw!r}: give a time after now")
        return now + seconds
    try:
        when = datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise UsageError(
            f"--deadline {raw!r}: give a duration from now (6h, 90m, 2d) or an ISO time "
            "(2030-01-31T18:00)"
        ) from None
    if when <= now:
        raise UsageError(f"--deadline {raw!r} is not after now")
    return when


def status_fields(record: JobRecord, now: float) -> dict[str, Any]:
    """What ``batchgen status --json`` says of a job's scheduling and usage."""
    return {
        "tenant": record.tenant,
        "priority": record.priority,
        "deadline": deadline_view(record, now),
        "usage": job_usage(record),
    }
