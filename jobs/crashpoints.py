"""Crash points for fault tests: die at a chosen spot of the production path.

``BATCHGEN_TEST_CRASH_AT=NAME`` (or ``NAME:N``, the N-th time the point is
reached, 1-based) makes the process ``os._exit(CRASH_EXIT_CODE)`` there: no
cleanup, no flush, like a SIGKILL. Only the fault tests set it. Points:

- ``before_part_write``: rows are finished, nothing written
- ``mid_part_write``: half of a part's bytes are in its temp file
- ``after_publish``: the part file is renamed into place, Redis not told
- ``after_commit``: the atomic commit step (done-marks, counters, XACK, XDEL)
  succeeded, the worker has not moved on. ``after_commit_before_ack`` is the
  same point: the commit and the ack are one step, so there is no gap between
- ``before_hand_back``: SIGTERM drain has the in-flight outputs, Redis not told
- ``before_finalize_commit``: the final file is written, the job not marked
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

CRASH_EXIT_CODE = 77
ENV = "BATCHGEN_TEST_CRASH_AT"
_ALIASES = {"after_commit_before_ack": "after_commit"}


@dataclass(slots=True)
class CrashPlan:
    point: str | None
    on_hit: int = 1
    hits: int = 0

    @classmethod
    def from_env(cls) -> CrashPlan:
        raw = os.environ.get(ENV, "")
        if not raw:
            return cls(None)
        name, _, count = raw.partition(":")
        return cls(_ALIASES.get(name, name), int(count or 1))

    def reached(self, point: str) -> None:
        if self.point != point:
            return
        self.hits += 1
        if self.hits >= self.on_hit:
            sys.stderr.write(f"batchgen: crash point {point} reached ({ENV}); exiting\n")
            sys.stderr.flush()
            os._exit(CRASH_EXIT_CODE)
