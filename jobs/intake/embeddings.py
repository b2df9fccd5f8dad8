"""Embedding lines: OpenAI's ``/v1/embeddings`` bodies and native ``"task": "embed"`` lines.

One input per line (a row per line, always): a string, a list of token ids, or a
list holding exactly one of those. ``dimensions`` truncates the vector
(Matryoshka style; the worker refuses more than the model's hidden size).
An embedding request (jobs/schema/entry.py) holds the input and the dimensions, and no
sampling parameters.
"""

from __future__ import annotations

from typing import Any

from batchgen.jobs.schema.entry import QueuedRequest
from batchgen.jobs.schema.errors import EmbeddingError
from batchgen.jobs.schema.sampling import show

MAX_DIMENSIONS = 1 << 16
BODY_FIELDS = frozenset({"model", "input", "dimensions", "encoding_format", "user"})


def embedding_input(value: Any, field: str = "input") -> str | list[int]:
    """The one input of a line; EmbeddingError if it is not exactly one."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a one-item batch, as clients often send
    if isinstance(value, str):
        if not value:
            raise EmbeddingError(field, f"{field} is empty")
        return value
    if isinstance(value, list) and value and all(_token(t) for t in value):
        return list(value)
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        raise EmbeddingError(field, f"{field} holds {len(value)} inputs; batchgen takes one per "
                             "line (one row per line): give each its own line")  # fmt: skip
    raise EmbeddingError(
        field, f"{field} must be a string or a list of token ids, got {show(value)}"
    )


def dimensions(value: Any, field: str = "dimensions") -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_DIMENSIONS:
        raise EmbeddingError(field, f"{field} must be an integer from 1 to {MAX_DIMENSIONS}, "
                             f"got {show(value)}")  # fmt: skip
    return value


def body_request(body: dict[str, Any]) -> QueuedRequest:
    """The request of a ``/v1/embeddings`` body (its keys already known)."""
    if "input" not in body:
        raise EmbeddingError("input", "/v1/embeddings needs body.input")
    for key in ("model", "user"):
        if key in body and not isinstance(body[key], str):
            raise EmbeddingError(key, f"body.{key} must be a string, got {show(body[key])}")
    if body.get("encoding_format", "float") != "float":
        raise EmbeddingError("encoding_format", f"body.encoding_format = "
                             f"{show(body['encoding_format'])} is not supported by batchgen "
                             '(only "float")')  # fmt: skip
    request = QueuedRequest(embed=embedding_input(body["input"], "input"))
    if "dimensions" in body:
        request.dimensions = dimensions(body["dimensions"])
    return request


def _token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 31
