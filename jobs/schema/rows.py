"""Output rows: one per input line, the same columns in parts and the final file."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import pyarrow as pa
import pyarrow.compute as pc


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop string / token
    LENGTH = "length"  # max_tokens reached
    TOOL_CALLS = "tool_calls"  # stopped after writing tool calls (the tool_calls column)
    ERROR = "error"  # could not run; see the error column
    CANCELLED = "cancelled"  # the job was cancelled before this row was made


# the reasons of a row that ran and succeeded
SUCCEEDED = (FinishReason.STOP.value, FinishReason.LENGTH.value, FinishReason.TOOL_CALLS.value)

_TS = pa.timestamp("ms", tz="UTC")
_TOP = pa.struct([("token_id", pa.int32()), ("token", pa.string()), ("logprob", pa.float32())])
# per generated token: its id, text and logprob, and the top alternatives
LOGPROBS = pa.list_(
    pa.struct([("token_id", pa.int32()), ("token", pa.string()), ("logprob", pa.float32()),
               ("top", pa.list_(_TOP))])
)  # fmt: skip
# OpenAI's tool call: {id, type "function", function {name, arguments (JSON text)}}
TOOL_CALLS = pa.list_(
    pa.struct([("id", pa.string()), ("type", pa.string()),
               ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())]))])
)  # fmt: skip
CHOICES = pa.list_(
    pa.struct([("index", pa.int32()), ("text", pa.string()), ("token_ids", pa.list_(pa.int32())),
               ("finish_reason", pa.string()), ("logprobs", LOGPROBS),
               ("reasoning", pa.string()), ("tool_calls", TOOL_CALLS)])  # split as the row
)  # fmt: skip
SCHEMA = pa.schema(
    [
        pa.field("index", pa.int64(), nullable=False),  # 0-based input order (valid lines)
        pa.field("id", pa.string()),  # the line's id / custom_id
        pa.field("text", pa.string()),  # the answer (after the reasoning, with a parser)
        pa.field("token_ids", pa.list_(pa.int32())),  # generated tokens
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("error", pa.string()),
        pa.field("prompt_tokens", pa.int32()),
        pa.field("completion_tokens", pa.int32()),  # of every sample, as OpenAI counts
        pa.field("cached_tokens", pa.int32()),
        pa.field("attempts", pa.int32()),  # deliveries that ran it, hand-backs included
        pa.field("preemptions", pa.int32()),
        pa.field("worker", pa.string()),
        pa.field("queued_at", _TS),
        pa.field("finished_at", _TS),
        pa.field("metadata", pa.string()),  # the line's metadata object, as JSON
        # the output constraint's kind (json, json_object, regex, choice, grammar), or null
        pa.field("structured", pa.string()),
        pa.field("logprobs", LOGPROBS),  # the first sample's, when asked; else null
        pa.field("choices", CHOICES),  # every sample when n > 1; else null
        pa.field("embedding", pa.list_(pa.float32())),  # embedding lines only; else null
        pa.field("cached", pa.bool_(), nullable=False),  # from the result cache (result_cache.py)
        pa.field("cache_source", pa.string()),  # the job a cached row was first generated for
        # with a reasoning parser (reasoning.py): the reasoning, and the generated tokens
        # that wrote it (its end tag included); else null
        pa.field("reasoning", pa.string()),
        pa.field("reasoning_tokens", pa.int32()),
        pa.field("tool_calls", TOOL_CALLS),  # the calls the output wrote (tools.py); else null
    ]
)


@dataclass(slots=True)
class Row:
    index: int
    id: str | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.ERROR
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    attempts: int = 0
    preemptions: int = 0
    worker: str | None = None
    queued_at: int | None = None  # unix ms
    finished_at: int | None = None  # unix ms
    metadata: str | None = None
    structured: str | None = None
    logprobs: list[dict] | None = None
    choices: list[dict] | None = None
    embedding: list[float] | None = None
    cached: bool = False
    cache_source: str | None = None
    reasoning: str | None = None
    reasoning_tokens: int | None = None
    tool_calls: list[dict] | None = None

    @property
    def failed(self) -> bool:
        return self.finish_reason in (FinishReason.ERROR, FinishReason.CANCELLED)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["finish_reason"] = self.finish_reason.value
        return out


def cached_input_tokens(row: Row) -> int:
    """Input tokens the row did not compute: its prefix cache hits, or all of them when
    the result cache served it (usage counts these as cached input)."""
    return row.prompt_tokens if row.cached else row.cached_tokens


_NAMES = [f.name for f in SCHEMA]


def to_table(rows: Sequence[Row]) -> pa.Table:
    columns: dict[str, list] = {name: [] for name in _NAMES}
    for row in rows:
        columns["index"].append(row.index)
        columns["id"].append(row.id)
        columns["text"].append(row.text)
        columns["token_ids"].append(row.token_ids)
        columns["finish_reason"].append(row.finish_reason.value)
        columns["error"].append(row.error)
        columns["prompt_tokens"].append(row.prompt_tokens)
        columns["completion_tokens"].append(row.completion_tokens)
        columns["cached_tokens"].append(row.cached_tokens)
        columns["attempts"].append(row.attempts)
        columns["preemptions"].append(row.preemptions)
        columns["worker"].append(row.worker)
        columns["queued_at"].append(row.queued_at)
        columns["finished_at"].append(row.finished_at)
        columns["metadata"].append(row.metadata)
        columns["structured"].append(row.structured)
        columns["logprobs"].append(row.logprobs)
        columns["choices"].append(row.choices)
        columns["embedding"].append(row.embedding)
        columns["cached"].append(row.cached)
        columns["cache_source"].append(row.cache_source)
        columns["reasoning"].append(row.reasoning)
        columns["reasoning_tokens"].append(row.reasoning_tokens)
        columns["tool_calls"].append(row.tool_calls)
    return pa.Table.from_pydict(columns, schema=SCHEMA)


# Columns later versions added: a file written before one of them means its default
# (no constraint, no logprobs, one sample, no embedding, not cached, no reasoning parser,
# no tool calls: null, cached false).
ADDED_LATER = frozenset({"structured", "logprobs", "choices", "embedding", "cached",
                         "cache_source", "reasoning", "reasoning_tokens", "tool_calls"})  # fmt: skip


def default_column(name: str, length: int) -> pa.Array:
    """An ``ADDED_LATER`` column for ``length`` rows written before it existed."""
    field = SCHEMA.field(name)
    if name == "cached":
        return pa.array([False] * length, field.type)
    return pa.nulls(length, field.type)


def conform(table: pa.Table) -> pa.Table:
    """A part read with ``schema=SCHEMA``: one written before the ``cached`` column existed
    has it null, which a non-null column cannot be written with; such rows were generated."""
    cached = table.column("cached")
    if cached.null_count == 0:
        return table
    filled = pc.fill_null(cached, False)
    return table.set_column(table.schema.get_field_index("cached"), SCHEMA.field("cached"), filled)


def from_dict(data: dict) -> Row:
    """A Row from ``to_dict`` output (error rows kept in Redis use this)."""
    data = dict(data)
    data["finish_reason"] = FinishReason(data["finish_reason"])
    return Row(**data)
