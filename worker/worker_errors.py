"""The worker's errors: an engine setting or checkpoint it cannot run, a request or
constraint it refuses. The user-facing ones are kinds of jobs/schema/errors.py's, so the CLI
shows them as one line."""

from __future__ import annotations

from batchgen.jobs.schema.errors import ModelNotLoadable, UsageError


class GrammarError(ValueError):
    """A constraint that does not compile against this model's tokenizer."""


class RequestRejected(ValueError):
    """A request that can never run here (too long, bad parameters); ``reason`` says why."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id!r} rejected: {reason}")
        self.request_id = request_id
        self.reason = reason


class InvalidEngineConfig(UsageError, ValueError):
    """An engine setting that cannot work; the message names it and what it may be."""


class UnsupportedModelError(ModelNotLoadable, ValueError):
    """The checkpoint is not one batchgen can run (architecture, file or feature); the CLI
    reports it as one line, as every named error."""


class GroupLost(RuntimeError):
    """A rank of the engine's tensor-parallel group died or a collective timed out: the
    engine cannot run another step (the queue loop hands its requests back and exits)."""
