"""Test-only fault hook: poison requests that break the real engine step.

Python imports ``sitecustomize`` at start-up from ``sys.path``; the fault tests
put this folder on ``PYTHONPATH`` of the worker processes they start (a
``batchgen worker`` supervisor passes its environment on to its engine
processes), so nothing in the product reads a test switch for this.

``BATCHGEN_CHAOS_POISON='{"MARKER": "kill" | "raise" | "oom"}'``: a request
whose prompt contains MARKER breaks every engine step that computes it, from
inside ``ModelRunner.run`` (the scheduler has planned the step and allocated
its blocks, nothing has been updated): ``kill`` sends SIGKILL to its own
process, ``raise`` raises RuntimeError, ``oom`` raises torch.OutOfMemoryError
as a CUDA allocation failure would.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import signal
import sys
from typing import Any

ENV = "BATCHGEN_CHAOS_POISON"
_TARGET = "batchgen.worker.engine.engine"


def _install(engine_module: Any, poison: dict[str, str]) -> None:
    from batchgen.worker.engine.model_runner import ModelRunner

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

    def __init__(self, poison: dict[str, str]) -> None:
        self.poison = poison

    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader, poison = spec.loader, self.poison
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _install(module, poison)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


if os.environ.get(ENV):
    sys.meta_path.insert(0, _PatchOnImport(json.loads(os.environ[ENV])))
