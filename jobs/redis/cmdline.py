"""Hide a secret this process was given on its command line from ps and /proc/PID/cmdline.

``batchgen worker --redis redis://:PASSWORD@host`` runs for days, and any local
user can read every process's command line. Like the mysql client with ``-p``,
we overwrite the password in the original argv memory (Linux: the kernel shows
the bytes between ``arg_start`` and ``arg_end`` of /proc/self/stat as they are
now). It is visible until then, for a moment at start: prefer
``BATCHGEN_REDIS_URL``, which only this user (and root) can read.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path


def hide(secret: str) -> bool:
    """Overwrite every occurrence of ``secret`` in our argv with '*'; whether it was found."""
    raw = os.fsencode(secret)
    if not raw:
        return False
    try:
        stat = Path("/proc/self/stat").read_text()
        after = stat.rsplit(")", 1)[1].split()  # fields from the 3rd: (comm) may hold spaces
        start, end = int(after[48 - 3]), int(after[49 - 3])  # arg_start, arg_end
    except (OSError, ValueError):
        return False  # not Linux
    found = False
    args = ctypes.string_at(start, end - start)
    at = args.find(raw)
    while at >= 0:
        ctypes.memmove(start + at, b"*" * len(raw), len(raw))
        found = True
        at = args.find(raw, at + len(raw))
    return found
