"""Test-only hooks in the engine processes the tests start.

Python imports ``sitecustomize`` at start-up from ``sys.path``; a test puts this
folder on ``PYTHONPATH`` of the worker processes it starts (``tests.hooks.hook_env``;
a ``batchgen worker`` supervisor passes its environment on to its engine
processes), so nothing in the product reads a test switch for these.

``BATCHGEN_CHAOS_POISON='{"MARKER": "kill" | "raise" | "oom"}'``: a request
whose prompt contains MARKER breaks every engine step that computes it, from
inside ``ModelRunner.run`` (the scheduler has planned the step and allocated
its blocks, nothing has been updated): ``kill`` sends SIGKILL to its own
process, ``raise`` raises RuntimeError, ``oom`` raises torch.OutOfMemoryError
as a CUDA allocation failure would.

``BATCHGEN_TEST_STEP_S=SECONDS``: every ``ModelRunner.run`` (one engine step's
forward) takes at least SECONDS. A test that must act while a job is under way
(kill, cancel, SIGTERM, a Redis crash) paces the engine with it, so that a row
takes a known least time however fast the machine: sized in tokens alone, each
faster engine or machine finished the job before the test acted. The tokens
are unchanged; a step is only slower.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import signal
import sys
import time
from typing import Any

POISON_ENV = "BATCHGEN_CHAOS_POISON"
STEP_ENV = "BATCHGEN_TEST_STEP_S"
_TARGET = "batchgen.worker.engine.engine"


def _pace(step_s: float) -> None:
    from batchgen.worker.engine.runner.model_runner import ModelRunner

    run = ModelRunner.run

    def paced_run(self, plan):
        start = time.monotonic()
        out = run(self, plan)
        time.sleep(max(0.0, step_s - (time.monotonic() - start)))
        return out

    setattr(ModelRunner, "run", paced_run)  # noqa: B010 (mypy: no method assignment)


def _poison(engine_module: Any, poison: dict[str, str]) -> None:
    from batchgen.worker.engine.runner.model_runner import ModelRunner

    marked: dict[str, str] = {}  # engine request id -> action
    add_request, run = engine_module.Engine.add_request, ModelRunner.run

    def poisoned_add_request(self, request_id, prompt, params=None, **kwargs):
        add_request(self, request_id, prompt, params, **kwargs)
        ids = list(prompt) if prompt and isinstance(prompt[0], int) else self.encode(prompt)
        text = self.tokenizer.decode(ids)
        for marker, action in poison.items():
            if marker in text:
                marked[request_id] = action

    def poisoned_run(self, plan):
        for req in [*plan.decodes, *plan.prefills]:
            action = marked.get(req.request_id.split("#")[0])
            if action == "kill":
                sys.stderr.write(f"chaos: poison request {req.request_id}: SIGKILL\n")
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            if action == "raise":
                raise RuntimeError(f"chaos: poison request {req.request_id} broke the step")
            if action == "oom":
                import torch

                raise torch.OutOfMemoryError(
                    f"CUDA out of memory (chaos: poison request {req.request_id})"
                )
        return run(self, plan)

    engine_module.Engine.add_request = poisoned_add_request
    setattr(ModelRunner, "run", poisoned_run)  # noqa: B010 (mypy: no method assignment)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches the engine right after its module is first imported."""

    def __init__(self, patch: Any) -> None:
        self.patch = patch

    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader, patch = spec.loader, self.patch
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def _patch(engine_module: Any) -> None:
    if os.environ.get(POISON_ENV):
        _poison(engine_module, json.loads(os.environ[POISON_ENV]))
    if os.environ.get(STEP_ENV):
        _pace(float(os.environ[STEP_ENV]))


if os.environ.get(POISON_ENV) or os.environ.get(STEP_ENV):
    sys.meta_path.insert(0, _PatchOnImport(_patch))
