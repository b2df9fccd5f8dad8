"""The environment that puts the test-only hooks of ``sitecustomize`` (this folder)
into the worker processes a test starts."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.hooks.sitecustomize import POISON_ENV, STEP_ENV

HOOKS = Path(__file__).parent


def hook_env(
    *, poison: dict[str, str] | None = None, step_s: float | None = None
) -> dict[str, str]:
    """Variables to add to a worker's environment: ``poison`` requests (marker ->
    "kill" | "raise" | "oom") and/or ``step_s``, the least seconds of an engine step.
    Neither given: none (the worker runs without the hooks)."""
    if not poison and not step_s:
        return {}
    env = {"PYTHONPATH": os.pathsep.join(filter(None, (str(HOOKS), os.environ.get("PYTHONPATH"))))}
    if poison:
        env[POISON_ENV] = json.dumps(poison)
    if step_s:
        env[STEP_ENV] = str(step_s)
    return env
