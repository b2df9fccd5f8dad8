"""Crash points for fault tests: die (or freeze) at a chosen spot of the production path.

``BATCHGEN_TEST_CRASH_AT=NAME`` (or ``NAME:N``, the N-th time the point is
reached, 1-based) makes the process ``os._exit(CRASH_EXIT_CODE)`` there: no
cleanup, no flush, like a SIGKILL. ``NAME:N:stop`` instead freezes the process
there with SIGSTOP (a worker stalled past the claim timeout at that exact
spot); a SIGCONT lets it go on from there. Only the fault tests set it. Points:

- ``before_part_write``: rows are finished, nothing written
- ``mid_part_write``: half of a part's bytes are in its temp file
- ``after_publish``: the part file is renamed into place, Redis not told
- ``after_commit``: the atomic commit step (done-marks, counters, XACK, XDEL)
  succeeded, the worker has not moved on (the commit and the ack are one
  step, so there is no point between them)
- ``before_hand_back``: SIGTERM drain has the in-flight outputs, Redis not told
- ``before_finalize_commit``: the final file is written, the job not marked
- ``after_finalize_commit``: the job is marked finished, its clean-up not done
- ``after_retry_parts``: a retry wrote the kept rows' parts, the job is untouched
- ``after_retry_reopen``: a retry re-opened the job, none of its rows is queued
- ``after_output_claim``: a submit claimed the job's output directory, nothing of
  the job is in Redis
- ``after_retry_chunk``: a chunk of a retry's rows is queued (``:N``: the N-th)

With ``BATCHGEN_TEST_CRASH_ONCE=PATH`` the crash happens once across all the
processes that share the setting: in the one that creates PATH first (a fault
test that wants one finalizer of many killed).
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass

from batchgen.jobs.environment import TEST_CRASH_AT, TEST_CRASH_ONCE

CRASH_EXIT_CODE = 77


@dataclass(slots=True)
class CrashPlan:
    point: str | None
    on_hit: int = 1
    hits: int = 0
    stop: bool = False  # SIGSTOP ourselves instead of exiting
    once: str = ""  # a file only the first process to reach the point may create

    @classmethod
    def from_env(cls) -> CrashPlan:
        raw = TEST_CRASH_AT.get()
        if not raw:
            return cls(None)
        name, _, rest = raw.partition(":")
        count, _, action = rest.partition(":")
        if action not in ("", "stop", "exit"):
            raise TEST_CRASH_AT.bad(raw, "the action after NAME:N must be 'stop' or 'exit'")
        if not (count or "1").isdigit():
            raise TEST_CRASH_AT.bad(raw, "N in NAME:N must be a whole number (the N-th hit)")
        return cls(name, int(count or 1), stop=action == "stop",
                   once=TEST_CRASH_ONCE.get() or "")  # fmt: skip

    def reached(self, point: str) -> None:
        if self.point != point:
            return
        self.hits += 1
        if self.hits != self.on_hit or not self._first():
            return
        verb = "stopping (SIGSTOP)" if self.stop else "exiting"
        sys.stderr.write(f"batchgen: crash point {point} reached ({TEST_CRASH_AT.name}); {verb}\n")
        sys.stderr.flush()
        if self.stop:
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen here until SIGCONT
            return
        os._exit(CRASH_EXIT_CODE)

    def _first(self) -> bool:
        if not self.once:
            return True
        try:
            os.close(os.open(self.once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True
