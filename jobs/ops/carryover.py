"""A retry's kept rows: the previous result's rows that are not retried, as committed parts.

``retried_mask`` reads only the ``index`` and ``finish_reason`` columns of the
job's ``result.parquet`` and says which inputs a retry runs again, and
``attempts_before`` its ``attempts`` column: the deliveries a retried row had, which
its requests carry to the workers so that the new rows count them too.
``carry_over`` then writes every other row back under ``parts/JOB/`` as parts
of at most ``PART_ROWS`` rows each (the SCHEMA columns only: columns finalize
joins on are joined again), with the commit records a worker's commit would
give them, so finalize reads them like any part, window by window. The result
is read in record batches: memory holds one part's rows at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchgen.jobs.ops.finalize.result import RESULT
from batchgen.jobs.schema.errors import OutputError
from batchgen.jobs.schema.rows import ADDED_LATER, SCHEMA, SUCCEEDED, FinishReason, default_column
from batchgen.jobs.storage.output_store import OutputDir

PART_ROWS = 1 << 16  # rows in one carried part (finalize's windows stay bounded)
_BATCH_ROWS = 8192
_OK = pa.array(SUCCEEDED)
_TOKENS = ("prompt_tokens", "completion_tokens", "cached_tokens", "reasoning_tokens")


@dataclass(slots=True)
class Carried:
    """What a retry keeps: the parts written, and the kept rows' counters."""

    parts: list[tuple[str, str]] = field(default_factory=list)  # (name, commit record JSON)
    rows: int = 0
    done: int = 0  # kept rows that finished (stop, length)
    failed: int = 0  # kept rows that did not (error, cancelled)
    cancelled: int = 0  # of those, the cancelled ones
    # the finished kept rows' tokens (billed), and the failed ones' input apart (usage.py)
    tokens: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys((*_TOKENS, "failed_prompt_tokens"), 0)
    )


def retried_mask(out: OutputDir, total: int, reasons: frozenset[str]) -> np.ndarray:
    """True for each input whose result row's finish_reason is in ``reasons``."""
    mask = np.zeros(total, dtype=bool)
    wanted = pa.array(sorted(reasons), type=pa.string())
    for first, batch in _per_input(out, total, "finish_reason"):
        reasons_in = pc.is_in(batch.column("finish_reason"), value_set=wanted)
        mask[first : first + batch.num_rows] = reasons_in.to_numpy(zero_copy_only=False)
    return mask


def attempts_before(out: OutputDir, total: int) -> np.ndarray:
    """Each input's ``attempts`` in the result (0 where null)."""
    attempts = np.zeros(total, dtype=np.int64)
    for first, batch in _per_input(out, total, "attempts"):
        column = pc.fill_null(batch.column("attempts"), 0)
        attempts[first : first + batch.num_rows] = column.to_numpy(zero_copy_only=False)
    return attempts


def _per_input(out: OutputDir, total: int, column: str) -> Iterator[tuple[int, pa.RecordBatch]]:
    """The result's ``index`` and ``column`` batch by batch, each with its first index.

    The result must hold one row per input, in order (finalize writes it so);
    anything else is refused, never guessed at.
    """
    seen = 0
    for batch in _batches(out, ["index", column]):
        index = batch.column("index").to_numpy(zero_copy_only=False)
        if seen + len(index) > total or not np.array_equal(
            index, np.arange(seen, seen + len(index))
        ):
            raise _not_one_per_input(out, total)
        yield seen, batch
        seen += len(index)
    if seen != total:
        raise _not_one_per_input(out, total)


def carry_over(
    out: OutputDir, job_id: str, round_: int, retried: np.ndarray, part_rows: int = PART_ROWS
) -> Carried:
    """Write the rows not ``retried`` as parts ``parts/JOB/retry-ROUND-N.parquet``.

    The names depend only on the round and the order, so a retry killed halfway
    and run again rewrites the same files (each write is whole or absent).
    """
    carried = Carried()
    pending: list[pa.Table] = []
    held = 0
    for batch in _batches(out, SCHEMA.names, ADDED_LATER):
        table = pa.Table.from_batches([batch])
        for name in set(SCHEMA.names) - set(table.column_names):  # a result written before
            table = table.append_column(name, default_column(name, len(table)))
        table = table.select(SCHEMA.names).cast(SCHEMA)
        index = table.column("index").to_numpy()
        kept = table.filter(pa.array(~retried[index]))
        if kept.num_rows:
            pending.append(kept)
            held += kept.num_rows
        while held >= part_rows:
            merged = pa.concat_tables(pending)
            _write_part(out, job_id, round_, merged.slice(0, part_rows), carried)
            rest = merged.slice(part_rows)
            pending, held = ([rest] if rest.num_rows else []), rest.num_rows
    if held:
        _write_part(out, job_id, round_, pa.concat_tables(pending), carried)
    return carried


def _write_part(out: OutputDir, job_id: str, round_: int, table: pa.Table, c: Carried) -> None:
    table = table.combine_chunks()
    name = f"retry-{round_}-{len(c.parts):06d}.parquet"
    with out.writing("parts", job_id, name) as sink:
        pq.write_table(table, sink, compression="zstd")
    index = table.column("index")
    meta = {"rows": table.num_rows, "lo": pc.min(index).as_py(), "hi": pc.max(index).as_py(),
            "bytes": table.nbytes, "lost": []}  # fmt: skip
    c.parts.append((f"parts/{job_id}/{name}", json.dumps(meta)))
    finished = pc.is_in(table.column("finish_reason"), value_set=_OK)
    ok = int(pc.sum(finished).as_py() or 0)
    c.rows += table.num_rows
    c.done += ok
    c.failed += table.num_rows - ok
    reasons = table.column("finish_reason")
    c.cancelled += int(pc.sum(pc.equal(reasons, FinishReason.CANCELLED.value)).as_py() or 0)
    for column in _TOKENS:
        c.tokens[column] += int(pc.sum(table.filter(finished).column(column)).as_py() or 0)
    failed_in = table.filter(pc.invert(finished)).column("prompt_tokens")
    c.tokens["failed_prompt_tokens"] += int(pc.sum(failed_in).as_py() or 0)


def _batches(
    out: OutputDir, columns: list[str], optional: frozenset[str] = frozenset()
) -> Iterator[pa.RecordBatch]:
    """The result's ``columns`` in batches; of ``optional`` ones, those it has."""
    try:
        with out.open_input(RESULT) as src:
            result = pq.ParquetFile(src)
            names = result.schema_arrow.names
            missing = [c for c in columns if c not in names and c not in optional]
            if missing:  # pyarrow would leave them out silently
                raise OutputError(
                    f"{out.uri}/{RESULT} has no column {', '.join(missing)} (written by another "
                    "batchgen version?); nothing was retried"
                )
            present = [c for c in columns if c in names]
            yield from result.iter_batches(batch_size=_BATCH_ROWS, columns=present)
    except (OSError, pa.ArrowInvalid) as exc:
        raise OutputError(f"cannot read the job's {RESULT} in {out.uri}: {exc}") from exc


def _not_one_per_input(out: OutputDir, total: int) -> OutputError:
    return OutputError(
        f"{out.uri}/{RESULT} does not hold one row per input in order ({total} inputs): it is "
        "not the job's final output (was it replaced?); nothing was retried"
    )
