"""The body of ``POST /v1/batches``, OpenAI's create-batch request, as a pydantic model.

FastAPI checks a request against it before the route runs; a body it refuses is
400 in OpenAI's error shape, naming the first wrong parameter
(openai_errors.on_validation_error). Fields OpenAI defines that are not here are
ignored, as OpenAI ignores unknown ones. What needs the server's state (the input
file exists and is the tenant's, with purpose ``batch``) is checked by
Batches.create.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, StrictInt, StringConstraints, field_validator
from pydantic_core import PydanticCustomError

from batchgen.jobs.ops.fair_share.schedule import PRIORITY_LIMIT, check_priority
from batchgen.jobs.schema.errors import UsageError

WINDOW_S = {"24h": 24 * 3600}  # each completion_window OpenAI offers, in seconds
EXPIRES_AFTER_S = (3600, 30 * 86400)  # OpenAI's bounds for expires_after.seconds

Endpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
# OpenAI's metadata: at most 16 pairs, keys of up to 64 chars, values of up to 512
MetadataKey = Annotated[str, StringConstraints(max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]


class ExpiresAfter(BaseModel):
    """OpenAI's ``{"anchor": "created_at", "seconds": N}``, N from an hour to 30 days."""

    anchor: Literal["created_at"]
    seconds: Annotated[StrictInt, Field(ge=EXPIRES_AFTER_S[0], le=EXPIRES_AFTER_S[1])]


class CreateBatch(BaseModel):
    input_file_id: Annotated[str, StringConstraints(min_length=1)]
    endpoint: Endpoint
    completion_window: Literal["24h"]
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)] | None = None
    output_expires_after: ExpiresAfter | None = None

    @field_validator("metadata")
    @classmethod
    def _known_priority(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        """Refused here, not once the batch's validation submits its job."""
        try:
            priority_of(metadata)
        except (ValueError, UsageError):
            raise PydanticCustomError(
                "invalid_priority",
                f"priority must be a whole number from -{PRIORITY_LIMIT} to {PRIORITY_LIMIT}",
            ) from None
        return metadata


def priority_of(metadata: dict[str, str] | None) -> int:
    """The job's priority class from the batch's metadata ``priority`` (0 without one)."""
    raw = (metadata or {}).get("priority")
    return 0 if raw is None else check_priority(int(raw))
