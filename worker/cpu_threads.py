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

How they wait: torch's OpenMP threads (libgomp) spin for about 3 ms after
each parallel region before they sleep. With other work on the machine the
spinning threads take the CPUs the work they wait for needs; measured here a
tiny model's decode ran 10x slower. ``OMP_WAIT_POLICY=PASSIVE`` makes them
sleep at once, but libgomp reads it only once, when it loads (with torch), so
``quiet_openmp_waits()`` sets it when ``batchgen.worker`` is imported, if
OpenMP is not loaded yet and neither it nor ``GOMP_SPINCOUNT`` is set. Where
torch was loaded first it is too late: the engine says so in its log.

Torch-free: the worker supervisor uses it to size its children.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Collection
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")  # this process's cgroup in each hierarchy
# Either one set before OpenMP loads decides how its threads wait; batchgen then leaves both alone
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
_OPENMP_LIBRARIES = ("libgomp", "libiomp", "libomp")

# Whether OpenMP was loaded before the first call of quiet_openmp_waits could set a
# policy (None before that call)
_missed: bool | None = None


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


def quiet_openmp_waits() -> None:
    """Makes OpenMP's threads sleep while they wait (``OMP_WAIT_POLICY=PASSIVE``)
    if OpenMP has not read its environment yet and nobody set a policy. Once
    per process: the first call decides."""
    global _missed
    if _missed is None:
        _missed = False
        if not any(name in os.environ for name in WAIT_VARIABLES):  # else the user's choice
            if _openmp_loaded():
                _missed = True
            else:
                os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def wait_policy_missed() -> bool:
    """Whether OpenMP was loaded before any wait policy was set: its threads spin."""
    return bool(_missed)


def _openmp_loaded() -> bool:
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "torch" in sys.modules
    return any(name in maps for name in _OPENMP_LIBRARIES)
