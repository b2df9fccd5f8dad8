"""The jobs part's errors: named errors for user mistakes and unavailable services, and
the errors of reading a request (a line, a body, a stream entry) and of Redis.

The CLI prints ``str(error)`` on one line and exits with ``exit_code``; a user
mistake is never a traceback. Messages say what is wrong and what to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchgen.jobs.intake.lines import LineError


class BatchgenError(Exception):
    """Base of every error the CLI reports as a one-line message."""

    exit_code = 1


class UsageError(BatchgenError):
    """A flag or argument the user gave is not acceptable."""

    exit_code = 2


class InvalidInput(BatchgenError):
    """The prompts file has invalid lines; nothing was enqueued."""

    exit_code = 2

    def __init__(self, message: str, line_errors: Sequence[LineError] = ()) -> None:
        super().__init__(message)
        self.line_errors = list(line_errors)  # the first invalid lines, for callers that list them


class ModelNotLoadable(UsageError):
    """``--model`` names no checkpoint directory batchgen could load (model_files.py);
    the model code's own refusals (architecture, config switch) are a kind of it."""


class UnsafeName(UsageError):
    """A job id or output path that could escape where batchgen writes."""


class InlineCredentials(UsageError):
    """An output URI carries credentials; they come from the environment instead."""


class JobNotFound(BatchgenError):
    """No job with that id in this Redis."""


class JobConflict(BatchgenError):
    """A job id is reused for a different model, file or settings."""


class JobNotReady(BatchgenError):
    """The job has no final output yet (download before completion)."""


class QueueFull(BatchgenError):
    """Redis refused writes: out of memory under ``noeviction``."""


class RedisUnavailable(BatchgenError):
    """Redis could not be reached or refused our credentials."""

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient  # unreachable (may come back), not refused


class UnsafeRedis(BatchgenError):
    """The Redis server would evict keys, which silently loses work."""


class UntrustedRedis(BatchgenError):
    """The embedded Redis socket, its directory or the server behind it is not this user's own."""


class UnsafeRedisURL(UsageError):
    """A Redis URL whose parameters could weaken TLS verification, or that batchgen does not
    accept (redis-py would hand them to the connection, overriding batchgen's settings)."""


class OutputError(BatchgenError):
    """The output location could not be written or read."""


class QuotaExceeded(BatchgenError):
    """Submitting the job would take its tenant past a quota; nothing was queued."""

    exit_code = 3

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code  # OpenAI's error code for it (serve fails the batch with it)


class ParamError(ValueError):
    """``str(error)`` says what is wrong with the value; the caller adds where."""


class ParserError(ValueError):
    """A reasoning or tool-call parser name that is not one (``str``: what is wrong, for the user)."""


class EntryError(ValueError):
    """A stream entry this release cannot read."""


class RedisServerError(RuntimeError):
    """The private redis-server could not be found or started."""


class LeaseHeld(Exception):
    """Someone else holds the lease (``holder`` says who)."""

    def __init__(self, key: str, holder: str) -> None:
        super().__init__(f"{key} is held by {holder}")
        self.holder = holder


class BodyError(Exception):
    """A field of an OpenAI request body batchgen refuses or cannot read."""

    def __init__(self, field: str, message: str, at_key: bool = False) -> None:
        super().__init__(message)
        self.field = field  # the body field at fault
        self.message = message
        self.at_key = at_key  # point at the field's name (refused fields), not its value


class EmbeddingError(Exception):
    """An embedding line's input that is not exactly one text or token list."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


class FieldError(Exception):
    """What is wrong with a request's field; ``path`` leads to it (keys and list
    positions), which a line turns into a column and a table row into a column name."""

    def __init__(self, path: tuple[str | int, ...], message: str, at_key: bool = False) -> None:
        super().__init__(message)
        self.path = path
        self.message = message
        self.at_key = at_key  # point at the key (unknown fields), not its value


class JSONLineError(ValueError):
    """A line that is not strict JSON; ``column`` says where."""

    def __init__(self, column: int, message: str) -> None:
        super().__init__(message)
        self.column = column
        self.message = message


class JSONValueRejected(Exception):
    """Raised inside strictjson's json hooks (duplicate key, NaN, a number too big);
    strictjson turns it into a JSONLineError at its column."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail
