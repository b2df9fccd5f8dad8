"""How torch's OpenMP threads wait: set before torch loads, when batchgen is imported.

torch's OpenMP threads (libgomp) spin after each parallel region before they
sleep, 300,000 turns by default. With other work on the machine the spinning
threads take the CPUs the work they wait for needs; measured here a tiny model's
decode ran 10x slower. Not spinning at all (``OMP_WAIT_POLICY=PASSIVE``) costs a
wake-up per parallel region instead: on an idle 2-CPU machine two passive threads
decoded no faster than one. So ``quiet_openmp_waits()`` sets a short spin
(``SPIN_ENV``) when ``batchgen`` is imported, if OpenMP is not loaded yet (libgomp
reads it only once, when it loads with torch) and the user set no policy; where
torch was loaded first it is too late: the engine says so in its log.

Standard library only: every batchgen process imports it, the control plane's too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Either one set before OpenMP loads decides how its threads wait; batchgen then leaves both alone
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
# What batchgen sets where neither is: libgomp's spin before a waiting thread sleeps, in
# turns (its default 300,000). Measured (tiny toy model, 2 threads, idle 2-CPU machine):
# 1,000 turns decoded at the passive speed, 3,000-300,000 some 20% faster.
SPIN_ENV = {"GOMP_SPINCOUNT": "10000"}
_OPENMP_LIBRARIES = ("libgomp", "libiomp", "libomp")

# Whether OpenMP was loaded before the first call of quiet_openmp_waits could set a
# policy (None before that call)
_missed: bool | None = None


def quiet_openmp_waits() -> None:
    """Makes OpenMP's threads spin only briefly before they sleep (``SPIN_ENV``)
    if OpenMP has not read its environment yet and nobody set a policy. Once
    per process: the first call decides."""
    global _missed
    if _missed is None:
        _missed = False
        if not any(name in os.environ for name in WAIT_VARIABLES):  # else the user's choice
            if _openmp_loaded():
                _missed = True
            else:
                os.environ.update(SPIN_ENV)


def wait_policy_missed() -> bool:
    """Whether OpenMP was loaded before any wait policy was set: its threads spin long."""
    return bool(_missed)


def _openmp_loaded() -> bool:
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "torch" in sys.modules
    return any(name in maps for name in _OPENMP_LIBRARIES)
