"""In-flight requests and the rows they become."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from batchgen.jobs.schema import tools
from batchgen.jobs.schema.constraints import kind_of
from batchgen.jobs.schema.reasoning import ReasoningParser, Split
from batchgen.jobs.schema.rows import FinishReason, Row
from batchgen.jobs.schema.tool_parsers import Call, ToolParser
from batchgen.worker.consumer.queue import Delivery
from batchgen.worker.loop.engine_api import EngineOutput

_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}


@dataclass(frozen=True, slots=True)
class Reasoning:
    """How a request's output splits into reasoning and answer."""

    parser: ReasoningParser
    closed: bool  # its prompt already closed the reasoning: the output is all answer

    @property
    def unclosed(self) -> ReasoningParser | None:
        """The parser of an output that reasons first (None: the prompt closed it)."""
        return None if self.closed else self.parser


@dataclass(slots=True)
class Flight:
    """A delivery the engine is running."""

    delivery: Delivery
    output: str  # the job's output URI
    prompt_tokens: int = 0
    engine_us: int = 0  # its share of the engine steps it was in (usage)
    # its output tokens counted in the worker's progress so far (resumed ones from the start)
    counted: int = 0
    reasoning: Reasoning | None = None  # the job's reasoning parser, when it has one
    # the job's tool-call parser, for a request whose tool_choice is auto
    tool_parser: ToolParser | None = None


class Decode(Protocol):
    """Generated tokens' text, as the output's (or with special tokens kept)."""

    def __call__(self, token_ids: list[int], keep_special: bool = False) -> str: ...


def _metadata(delivery: Delivery) -> str | None:
    md = delivery.request.metadata
    return json.dumps(md, ensure_ascii=False, separators=(",", ":")) if md else None


def _structured(delivery: Delivery) -> str | None:
    return kind_of(delivery.request.param("structured_output"))


def resumable(delivery: Delivery, tokens: list[int]) -> list[int]:
    """The tokens a hand-back carries: n > 1 samples restart (one token list cannot
    resume them all)."""
    return tokens if delivery.request.param("n", 1) == 1 else []


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True, slots=True)
class Answer:
    """One sample's output as columns: its answer, reasoning and tool calls."""

    text: str
    reasoning: str | None
    reasoning_tokens: int | None
    calls: list[Call]
    reason: FinishReason | None  # None: the engine ended it otherwise (an error)


def answer(
    flight: Flight, text: str, token_ids: list[int], finish_reason: str, decode: Decode
) -> Answer:
    """A sample split by the job's reasoning parser, its calls read under its tool_choice."""
    reason = _REASONS.get(finish_reason)
    if not reason:
        return Answer("", None, None, [], None)
    reasoning, reasoning_count = None, None
    if flight.reasoning is not None:
        parser = flight.reasoning.parser
        keep = parser.keeps_special  # its markers are special tokens, which the text drops
        source = decode(token_ids, True) if keep else text
        split = parser.split(source, flight.reasoning.closed)
        reasoning_count = reasoning_tokens(
            token_ids, source, split, parser.end, lambda ids: decode(ids, keep)
        )
        text, reasoning = split.text, split.reasoning
    calls: list[Call] = []
    if flight.delivery.request.tools is not None:
        text, calls = tool_calls(flight, text, token_ids, decode)
        if calls and reason is FinishReason.STOP:
            reason = FinishReason.TOOL_CALLS
    return Answer(text, reasoning, reasoning_count, calls, reason)


def output_row(
    flight: Flight, out: EngineOutput, worker: str, token_text: Callable[[int], str],
    decode: Decode,
) -> Row:  # fmt: skip
    """The row of a finished engine output (``RequestOutput``); ``token_text``: a token
    id's text alone, for the logprobs columns; ``decode``: tokens' text as the output's.
    With n > 1 each sample is split as the first one is, into ``choices``, and the
    token counts are of every sample."""
    d = flight.delivery
    token_ids = list(out.token_ids)
    first = answer(flight, out.text, token_ids, out.finish_reason, decode)
    text, reasoning, reasoning_count, calls, reason = (first.text, first.reasoning,
        first.reasoning_tokens, first.calls, first.reason)  # fmt: skip
    top_k = d.request.param("logprobs")
    choices: list[dict[str, Any]] = []
    for i, s in enumerate(out.samples if len(out.samples) > 1 else []):
        got = first if i == 0 else answer(flight, s.text, list(s.token_ids), s.finish_reason,
                                          decode)  # fmt: skip
        if i and got.reasoning_tokens is not None:  # of every sample, as completion_tokens
            reasoning_count = (reasoning_count or 0) + got.reasoning_tokens
        choices.append({
            "index": i, "text": got.text, "token_ids": list(s.token_ids),
            "finish_reason": got.reason.value if got.reason else s.finish_reason,
            "logprobs": _logprobs(s.token_ids, s.logprobs, top_k, token_text),
            "reasoning": got.reasoning,
            "tool_calls": [tools.call_record(c, d.job_id, d.index, k, i)
                           for k, c in enumerate(got.calls)] or None,
        })  # fmt: skip
    return Row(
        index=d.index,
        id=d.request.id,
        text=text,
        reasoning=reasoning,
        reasoning_tokens=reasoning_count,
        token_ids=token_ids,
        finish_reason=reason or FinishReason.ERROR,
        error=None if reason else f"the engine ended the request with {out.finish_reason!r}",
        prompt_tokens=int(out.num_prompt_tokens),
        completion_tokens=sum(len(c["token_ids"]) for c in choices) or len(token_ids),
        cached_tokens=int(out.num_cached_tokens),
        attempts=d.attempts,
        preemptions=d.preemptions + int(out.num_preemptions),
        worker=worker,
        queued_at=d.queued_at,
        finished_at=now_ms(),
        metadata=_metadata(d),
        structured=_structured(d),
        logprobs=_logprobs(token_ids, out.logprobs, top_k, token_text),
        choices=choices or None,
        embedding=list(out.embedding) if out.embedding is not None else None,
        tool_calls=[tools.call_record(c, d.job_id, d.index, i) for i, c in enumerate(calls)]
        or None,
    )


def tool_calls(
    flight: Flight, answer: str, token_ids: list[int], decode: Decode
) -> tuple[str, list[Call]]:
    """A tool request's answer as (its text, the calls it wrote): under ``required`` or a
    named function the constrained output read back, under ``auto`` what the job's
    parser finds; an output whose calls do not parse stays all text."""
    request = flight.delivery.request
    kind = tools.kind(request.tool_choice)
    if kind in tools.FORCING:
        assert request.tool_choice is not None
        forced = tools.forced_calls(answer, request.tool_choice)
        return ("", forced) if forced else (answer, [])
    parser = flight.tool_parser
    if kind == "none" or parser is None:
        return answer, []
    source = answer
    if parser.keeps_special:  # its markers are special tokens, which the answer drops
        source = decode(token_ids, True)
        if flight.reasoning is not None:
            source = flight.reasoning.parser.split(source, flight.reasoning.closed).text
    found = parser.extract(source)
    return (found.text, found.calls) if found.calls else (answer, [])


def reasoning_tokens(
    token_ids: list[int], output: str, split: Split, end_tag: str,
    decode: Callable[[list[int]], str],
) -> int:  # fmt: skip
    """How many generated tokens wrote the reasoning ``split`` found in ``output``, its
    end tag included: none when the prompt closed it, all when the tag never came, else
    the fewest whose text holds the tag (the token that completes it counts)."""
    if split.reasoning is None:
        return 0
    if end_tag not in output:
        return len(token_ids)
    low, high = 1, len(token_ids)
    while low < high:  # once a prefix holds the tag, every longer one does
        mid = (low + high) // 2
        if end_tag in decode(token_ids[:mid]):
            high = mid
        else:
            low = mid + 1
    return high


def _logprobs(
    token_ids: Sequence[int], entries: list[dict[int, float]] | None, top_k: int | None,
    token_text: Callable[[int], str],
) -> list[dict] | None:  # fmt: skip
    """The logprobs column: per token {token_id, token, logprob, top: the top_k best}."""
    if entries is None or top_k is None:
        return None
    out = []
    for token, entry in zip(token_ids, entries):
        best = sorted(entry.items(), key=lambda item: -item[1])[:top_k]
        top = [{"token_id": t, "token": token_text(t), "logprob": lp} for t, lp in best]
        out.append({"token_id": token, "token": token_text(token), "logprob": entry[token],
                    "top": top})  # fmt: skip
    return out


def error_row(delivery: Delivery, error: str, worker: str, prompt_tokens: int = 0) -> Row:
    """The row of a request that cannot run: it fails alone, never the job or worker."""
    return Row(
        index=delivery.index,
        id=delivery.request.id,
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


def cached_row(delivery: Delivery, values: dict, source_job: str, worker: str) -> Row:
    """The row of a request served by the result cache: the generated values (and token
    counts) of the original row, this request's own id, index, metadata, timing and tool
    call ids."""
    return Row(
        index=delivery.index,
        id=delivery.request.id,
        text=values["text"],
        token_ids=list(values["token_ids"]),
        finish_reason=FinishReason(values["finish_reason"]),
        prompt_tokens=values["prompt_tokens"],
        completion_tokens=values["completion_tokens"],
        cached_tokens=values["cached_tokens"],
        attempts=delivery.attempts,
        preemptions=delivery.preemptions,
        worker=worker,
        queued_at=delivery.queued_at,
        finished_at=now_ms(),
        metadata=_metadata(delivery),
        structured=values["structured"],
        logprobs=values["logprobs"],
        choices=_own_choices(delivery, values["choices"]),
        reasoning=values["reasoning"],
        reasoning_tokens=values["reasoning_tokens"],
        tool_calls=_own_calls(delivery, values["tool_calls"]),
        cached=True,
        cache_source=source_job,
    )


def _own_choices(delivery: Delivery, choices: list[dict] | None) -> list[dict] | None:
    """Cached samples, each with its tool calls under this row's ids."""
    if not choices:
        return None
    return [{**c, "tool_calls": _own_calls(delivery, c.get("tool_calls"), c["index"])}
            for c in choices]  # fmt: skip


def _own_calls(delivery: Delivery, calls: list[dict] | None, sample: int = 0) -> list[dict] | None:
    """Cached tool calls with this row's ids."""
    return [tools.call_record(Call(c["function"]["name"], c["function"]["arguments"]),
                              delivery.job_id, delivery.index, i, sample)
            for i, c in enumerate(calls or ())] or None  # fmt: skip
