"""In-flight requests and the rows they become."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from batchgen.jobs.queue import Delivery
from batchgen.jobs.rows import FinishReason, Row
from batchgen.jobs.structured import kind_of

_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}


@dataclass(slots=True)
class Flight:
    """A delivery the engine is running."""

    delivery: Delivery
    output: str  # the job's output URI
    prompt_tokens: int = 0


def _metadata(delivery: Delivery) -> str | None:
    md = delivery.request.get("md")
    return json.dumps(md, ensure_ascii=False, separators=(",", ":")) if md else None


def _structured(delivery: Delivery) -> str | None:
    return kind_of(delivery.request.get("s", {}).get("structured_output"))


def now_ms() -> int:
    return int(time.time() * 1000)


def output_row(flight: Flight, out, worker: str) -> Row:
    """The row of a finished engine output (``RequestOutput``)."""
    d = flight.delivery
    reason = _REASONS.get(out.finish_reason)
    token_ids = list(out.token_ids)
    return Row(
        index=d.index,
        id=d.request.get("id"),
        text=out.text if reason else "",
        token_ids=token_ids,
        finish_reason=reason or FinishReason.ERROR,
        error=None if reason else f"the engine ended the request with {out.finish_reason!r}",
        prompt_tokens=int(out.num_prompt_tokens),
        completion_tokens=len(token_ids),
        cached_tokens=int(out.num_cached_tokens),
        attempts=d.attempts,
        preemptions=d.preemptions + int(out.num_preemptions),
        worker=worker,
        queued_at=d.queued_at,
        finished_at=now_ms(),
        metadata=_metadata(d),
        structured=_structured(d),
    )


def error_row(delivery: Delivery, error: str, worker: str, prompt_tokens: int = 0) -> Row:
    """The row of a request that cannot run: it fails alone, never the job or worker."""
    return Row(
        index=delivery.index,
        id=delivery.request.get("id"),
        finish_reason=FinishReason.ERROR,
        error=error,
        prompt_tokens=prompt_tokens,
        attempts=delivery.attempts,
        preemptions=delivery.preemptions,
        worker=worker,
        queued_at=delivery.queued_at,
        finished_at=now_ms(),
        metadata=_metadata(delivery),
        structured=_structured(delivery),
    )
