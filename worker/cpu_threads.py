"""The CPU threads an engine process runs: how many, and how they wait.

How many: no more than the CPUs this process may really use, the fewer of
its affinity mask (``os.sched_getaffinity``: taskset, a cpuset) and its
cgroup's CPU quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` over
``cpu.cfs_period_us``, the tightest of the process's cgroup and its
ancestors), rounded down. ``os.cpu_count()`` and torch's default count the
host's cores: in a container with a 2-CPU quota on a 64-core host they start
64 threads, and every parallel region then waits for threads the quota has
stopped. Rounded down for the same reason: of 2 threads under a 1.5-CPU
quota, one is stopped for part of every period and the region waits for it.

How they wait: OpenMP's threads spin only briefly before they sleep
(``batchgen/openmp_waits.py``, set when batchgen is imported). And
``ContentionWatch`` takes the engine down to one thread, which neither
spins nor waits for another, while its main thread waits for a CPU (other
processes want them), and back once they are gone.

Torch-free: the worker supervisor uses it to size its children.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Collection
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")  # this process's cgroup in each hierarchy
SCHEDSTAT = Path("/proc/thread-self/schedstat")  # run time, runqueue wait (ns), timeslices


def usable_cpus(
    affinity: Collection[int] | None = None,
    cgroup_root: Path | None = None,
    membership: Path | None = None,
) -> int:
    """The CPUs this process may really use: the fewer of its affinity mask and
    its cgroup quota (rounded down), at least 1. ``cgroup_root`` and
    ``membership`` (``/proc/self/cgroup``'s form) default to this process's."""
    if affinity is None:
        affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else ()
    cpus = len(affinity) or os.cpu_count() or 1
    quota = cpu_quota(cgroup_root or CGROUP_ROOT, membership or SELF_CGROUP)
    if quota is not None:
        cpus = min(cpus, math.floor(quota))
    return max(cpus, 1)


def cpu_quota(cgroup_root: Path, membership: Path) -> float | None:
    """CPUs' worth of time per period the process's cgroups allow (the tightest
    of its cgroup and their ancestors), or None where none sets a quota."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            bases = [cgroup_root]
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own mount
            bases = [cgroup_root / controllers, cgroup_root / "cpu"]
        else:
            continue
        for base in bases:
            folder = base / path.lstrip("/")
            for level in (folder, *folder.parents):
                if level == base.parent:
                    break
                quota = _quota_in(level)
                if quota is not None:
                    quotas.append(quota)
    return min(quotas, default=None)


def _quota_in(folder: Path) -> float | None:
    try:
        if (folder / "cpu.max").is_file():  # v2: "QUOTA PERIOD" or "max PERIOD"
            quota, period = (folder / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        if (folder / "cpu.cfs_quota_us").is_file():  # v1: -1 for none
            micros = int((folder / "cpu.cfs_quota_us").read_text())
            per = int((folder / "cpu.cfs_period_us").read_text())
            return None if micros < 0 else micros / per
    except (OSError, ValueError):
        pass
    return None


def choose_threads(asked: int | None, current: int, usable: int) -> int:
    """The engine's thread count: ``asked`` (``EngineConfig.threads``) when given,
    else no more than torch is set to use (``current``: OMP_NUM_THREADS, or
    a count the caller set) and no more than the usable CPUs."""
    if asked is not None:
        return asked
    return max(1, min(current, usable))


def runqueue_wait_s(path: Path = SCHEDSTAT) -> float | None:
    """Seconds the calling thread has spent runnable but waiting for a CPU (the
    kernel's schedstat), or None where the kernel does not say."""
    try:
        return int(path.read_text().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


class ContentionWatch:
    """Drops the engine to one thread while other processes compete for its CPUs.

    ``check()`` is called at every step by the thread that runs them. Every ``window_s``
    it compares how long that thread waited for a CPU with the time passed:
    at ``BUSY`` or more the engine goes down to one thread (measured here:
    idle, two threads waited under 1% of the time; beside two busy
    processes on 2 CPUs, 30-45%); once down, at ``QUIET`` or less and not
    before ``hold_s`` passed, back up to ``threads``. Each drop doubles the
    hold (up to ``MAX_HOLD_S``) so that a neighbour that takes one CPU of
    two does not make it swing every second; a minute at full count resets it.
    """

    BUSY = 0.15
    QUIET = 0.05
    FIRST_HOLD_S = 2.0
    MAX_HOLD_S = 64.0

    def __init__(
        self,
        threads: int,
        set_threads: Callable[[int], None],
        window_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        waited: Callable[[], float | None] = runqueue_wait_s,
    ) -> None:
        self.threads = threads
        self.current = threads
        self._set_threads = set_threads
        self._window_s = window_s
        self._clock = clock
        self._waited = waited
        self._hold_s = self.FIRST_HOLD_S
        self._hold_until = 0.0
        self._raised_at = clock()
        self._start = 0.0
        self._start_wait: float | None = None  # the window's start; None before the first check
        self._off = False  # no schedstat here: the count stays as set

    def check(self) -> None:
        if self._off:
            return
        now = self._clock()
        if self._start_wait is not None and now - self._start < self._window_s:
            return
        wait = self._waited()
        if wait is None:
            self._off = True
            return
        if self._start_wait is None:  # the first step: the stepping thread's own counter
            self._start, self._start_wait = now, wait
            return
        elapsed = now - self._start
        share = (wait - self._start_wait) / elapsed
        self._start, self._start_wait = now, wait
        if self.current > 1 and share >= self.BUSY:
            if now - self._raised_at >= 60.0:
                self._hold_s = self.FIRST_HOLD_S
            self._switch(1, elapsed, share)
            self._hold_until = now + self._hold_s
            self._hold_s = min(2 * self._hold_s, self.MAX_HOLD_S)
        elif self.current == 1 < self.threads and share <= self.QUIET and now >= self._hold_until:
            self._switch(self.threads, elapsed, share)
            self._raised_at = now

    def _switch(self, threads: int, elapsed: float, share: float) -> None:
        log.info(
            "the engine's thread waited for a CPU %.0f%% of the last %.1f s: %d CPU thread(s)",
            100 * share, elapsed, threads,
        )  # fmt: skip
        self.current = threads
        self._set_threads(threads)
