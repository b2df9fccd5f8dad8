"""The finalize function under its old dotted name, for tasks already queued.

rq stores a task's function as a dotted name in Redis. Finalize tasks queued by a
release before the package tree moved name ``batchgen.jobs.tasks.finalize_task``;
this module keeps that name importable, so they still run after an upgrade (the
runner accepts only this name and the current one: ``ops/finalize_tasks.py``).
"""

from batchgen.jobs.ops.finalize_tasks import finalize_task

__all__ = ["finalize_task"]
