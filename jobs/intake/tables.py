"""Pass 1 of submit for a table (Parquet or CSV files, or a folder of them): every
row made into a queue entry, or an error naming its row and column.

The table is read with pyarrow.dataset in record batches of the columns it needs,
so memory is bounded by a few batches whatever its size. A row's request is
built from its values directly (no JSON text in between) and checked by the
same code as a native JSONL line (``inputs.native_entry``):

- the prompt: ``prompt_column`` (a string), ``messages_column`` (a list of
  {role, content}) or ``template`` (template.py) over columns;
- sampling fields: the columns ``--sampling-columns`` maps to them (table_spec.py;
  other columns are data, whatever their names); a null there means "not given"
  (the job's default);
- the id: ``id_column``, else the row's number (0-based, across the files in
  name order; also what errors call the row).

A text value longer than a JSONL line may be (``MAX_LINE_BYTES``) is an error of
its row and column. CSV is read in blocks of ``csv_limits.BLOCK_BYTES``, so any
row up to that size is read (a longer one may stop the submit, naming it).

Every row has an entry (an invalid one's is its error, so its row keeps its place)
and kept columns (kept.py) are written beside the entries for every row, so the
snapshot's row k is the output's ``index`` k.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from batchgen.jobs.intake import csv_limits, kept, template
from batchgen.jobs.intake.duplicate_ids import IdLog, find_duplicates
from batchgen.jobs.intake.inputs import given_id, native_entry
from batchgen.jobs.intake.lines import MAX_LINE_BYTES, RowError
from batchgen.jobs.intake.sources import Input
from batchgen.jobs.intake.table_spec import TableSpec
from batchgen.jobs.intake.validate import (
    SHOWN_ERRORS,
    Validation,
    gather,
    ids_log,
    procs_for,
    run_ranges,
)
from batchgen.jobs.schema.entry import QueuedRequest
from batchgen.jobs.schema.errors import FieldError, UsageError

BATCH_ROWS = 16_384
BATCH_READAHEAD = 2  # batches decoded ahead of the one being validated


def open_dataset(found: Input) -> ds.Dataset:
    fmt = ds.ParquetFileFormat() if found.format == "parquet" else csv_limits.csv_format()
    try:
        return ds.dataset(found.files, filesystem=found.fs, format=fmt)
    except (OSError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        if found.format == "csv" and csv_limits.is_row_too_long(exc):
            raise csv_limits.row_too_long(found.fs, found.files) from exc
        raise UsageError(f"cannot read the input as {found.format}: {_one_line(exc)}") from exc


def _one_line(exc: Exception) -> str:
    """pyarrow's message on one line (the CLI prints errors as one)."""
    return " ".join(str(exc).split())


@dataclass(slots=True)
class _Plan:
    prompt: tuple[str, str]  # ("prompt" | "messages" | "template", column or template text)
    fields: list[tuple[str, str]]  # (request field, column) read per row, prompt first
    kept: list[str]  # input columns kept, in input order
    kept_names: list[str]  # their names in the result
    columns: list[str]  # every column read, in input order


def _plan(spec: TableSpec, schema: pa.Schema) -> tuple[_Plan, template.Template | None]:
    names = schema.names
    sources = [x for x in (spec.prompt_column, spec.messages_column, spec.template) if x]
    if len(sources) != 1:
        raise UsageError(
            "a table input needs exactly one of --prompt-column, --messages-column or --template"
        )

    def need(column: str, flag: str) -> str:
        if column not in names:
            close = difflib.get_close_matches(column, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            shown = ", ".join(names[:50]) + (", ..." if len(names) > 50 else "")
            raise UsageError(
                f"{flag}: no column {column!r} in the input{hint} (its columns: {shown})"
            )
        return column

    fields: list[tuple[str, str]] = []
    parsed = None
    if spec.template:
        parsed = template.parse(spec.template)
        for column in parsed.columns:
            need(column, "--template")
        prompt = ("template", spec.template)
    elif spec.prompt_column:
        prompt = ("prompt", need(spec.prompt_column, "--prompt-column"))
        fields.append(prompt)
    else:
        prompt = ("messages", need(str(spec.messages_column), "--messages-column"))
        fields.append(prompt)
    if spec.id_column:
        fields.append(("id", need(spec.id_column, "--id-column")))
    fields += [(name, need(column, "--sampling-columns"))
               for name, column in spec.sampling_fields(names)]  # fmt: skip
    if spec.keep_columns == ("all",):
        keep = list(names)
    else:
        wanted = {need(c, "--keep-columns") for c in spec.keep_columns}
        keep = [c for c in names if c in wanted]
    used = {c for _, c in fields} | set(parsed.columns if parsed else ()) | set(keep)
    plan = _Plan(prompt, fields, keep, kept.result_names(keep), [c for c in names if c in used])
    return plan, parsed


def validate_table(
    found: Input, spec: TableSpec, defaults: dict[str, Any], spool_dir: Path,
    vocab_size: int | None = None, procs: int | None = None,
) -> tuple[Validation[RowError], list[str]]:  # fmt: skip
    """Every row checked, entries spooled (and the kept columns' snapshot, when
    asked, as ``spool_dir/kept.KEPT``); (the validation, the kept columns' result
    names). A big Parquet input is cut at row groups into ranges checked by
    parallel processes (``BATCHGEN_SUBMIT_PROCS``, as for JSONL); the result does not
    depend on the cut."""
    dataset = open_dataset(found)
    plan, _ = _plan(spec, dataset.schema)
    ranges = _ranges(dataset, found.format, procs)
    spools = [spool_dir / f"entries-{i:04d}" for i in range(len(ranges))]
    parts = [spool_dir / f"kept-{i:04d}.parquet" for i in range(len(ranges))]
    jobs = [(found, plan, spec.template, defaults, vocab_size, str(spool), str(part), first, pieces)
            for (first, pieces), spool, part in zip(ranges, spools, parts)]  # fmt: skip
    results = run_ranges(_validate_range, jobs)
    result = Validation[RowError](spools=spools)
    digest = gather(result, results)
    # which columns are kept is part of what the job is (their values: the snapshot's)
    digest.update(json.dumps(plan.kept_names).encode())
    result.sha256 = digest.hexdigest()
    result.duplicates = find_duplicates([ids_log(s) for s in spools], spool_dir)
    if plan.kept:
        kept.join_parts(parts, spool_dir / kept.KEPT)
    return result, plan.kept_names


# (first row, [(fragment number, row group ids)] or None for the whole dataset)
_Range = tuple[int, list[tuple[int, list[int]]] | None]


def _ranges(dataset: ds.Dataset, fmt: str, procs: int | None) -> list[_Range]:
    """Contiguous ranges of whole row groups, about equal in rows, one a process. CSV
    (no row counts without a pass over it) and small inputs: one range."""
    if fmt != "parquet" or procs == 1:
        return [(0, None)]
    groups: list[tuple[int, int, int]] = []  # (fragment, row group, rows)
    size = 0
    try:
        for number, fragment in enumerate(dataset.get_fragments()):
            meta = fragment.metadata
            for g in range(meta.num_row_groups):
                groups.append((number, g, meta.row_group(g).num_rows))
                size += meta.row_group(g).total_byte_size
    except (OSError, pa.ArrowInvalid) as exc:
        raise UsageError(f"cannot read the input as parquet: {_one_line(exc)}") from exc
    procs = min(procs or procs_for(size), len(groups))
    if procs <= 1:
        return [(0, None)]
    total = sum(rows for _, _, rows in groups)
    out: list[_Range] = []
    first = seen = 0
    pieces: list[tuple[int, list[int]]] = []
    for number, g, rows in groups:
        if pieces and pieces[-1][0] == number:
            pieces[-1][1].append(g)
        else:
            pieces.append((number, [g]))
        seen += rows
        if seen >= total * (len(out) + 1) / procs and len(out) < procs - 1:
            out.append((first, pieces))
            first, pieces = seen, []
    if pieces:
        out.append((first, pieces))
    return out


def _validate_range(
    found: Input, plan: _Plan, template_text: str | None, defaults: dict[str, Any],
    vocab_size: int | None, spool: str, kept_part: str, first_row: int,
    pieces: list[tuple[int, list[int]]] | None,
) -> tuple[int, int, list[RowError]]:  # fmt: skip
    """(rows, invalid, first errors) of one range; entries written to ``spool`` (an
    invalid row's as its error, ``QueuedRequest.rejected``), the kept columns to ``kept_part``."""
    dataset = open_dataset(found)
    parsed = template.parse(template_text) if template_text else None
    error_count = 0
    errors: list[RowError] = []
    row = first_row
    numbered = not any(name == "id" for name, _ in plan.fields)  # the row number is the id
    ids = IdLog(ids_log(Path(spool)))  # row numbers never repeat: only an id column's ids
    snapshot = kept.SnapshotWriter(Path(kept_part), plan.kept, plan.kept_names, dataset.schema)
    with open(spool, "wb") as out, snapshot:
        for batch in _batches(dataset, plan.columns, found.format, pieces):
            for k, entry in enumerate(_entries(batch, plan, parsed, defaults, vocab_size, row)):
                if isinstance(entry, RowError):
                    error_count += 1
                    if len(errors) < SHOWN_ERRORS:
                        errors.append(entry)
                    row_id = str(entry.row) if numbered else entry.row_id
                    rejected = QueuedRequest.rejected(str(entry), row_id)
                    out.write(rejected.encode() + b"\n")
                    continue
                if not numbered:
                    ids.add(entry, row + k)
                out.write(entry + b"\n")
            snapshot.write(batch)
            row += batch.num_rows
    ids.close()
    return row - first_row, error_count, errors


def _batches(
    dataset: ds.Dataset, columns: list[str], fmt: str,
    pieces: list[tuple[int, list[int]]] | None,
) -> Iterator[pa.RecordBatch]:  # fmt: skip
    options: dict[str, Any] = {"columns": columns, "batch_size": BATCH_ROWS,
                               "batch_readahead": BATCH_READAHEAD}  # fmt: skip
    try:
        if pieces is None:
            yield from dataset.to_batches(fragment_readahead=1, **options)
            return
        fragments = list(dataset.get_fragments())
        for number, groups in pieces:
            part = fragments[number].subset(row_group_ids=groups)
            yield from part.to_batches(schema=dataset.schema, **options)
    except (OSError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        if fmt == "csv" and csv_limits.is_row_too_long(exc):
            raise csv_limits.row_too_long(dataset.filesystem, dataset.files) from exc
        raise UsageError(f"cannot read the input as {fmt}: {_one_line(exc)}") from exc


def _oversized(batch: pa.RecordBatch, columns: list[str]) -> dict[int, tuple[str, int]]:
    """Rows of ``batch`` holding a text value over MAX_LINE_BYTES: row -> (column, bytes)."""
    out: dict[int, tuple[str, int]] = {}
    for column in columns:
        array = batch.column(column)
        kind = array.type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                or pa.types.is_binary(kind) or pa.types.is_large_binary(kind)):  # fmt: skip
            continue
        sizes = pc.binary_length(array)
        if (pc.max(sizes).as_py() or 0) <= MAX_LINE_BYTES:
            continue
        for k in pc.indices_nonzero(pc.greater(sizes, MAX_LINE_BYTES)).to_pylist():
            out.setdefault(k, (column, sizes[k].as_py()))
    return out


def _entries(
    batch: pa.RecordBatch, plan: _Plan, parsed: template.Template | None,
    defaults: dict[str, Any], vocab_size: int | None, first_row: int,
) -> Iterator[bytes | RowError]:  # fmt: skip
    """Each row's entry or error, in order."""
    read = [c for _, c in plan.fields] + list(parsed.columns if parsed is not None else ())
    oversized = _oversized(batch, list(dict.fromkeys(read)))
    columns = [(name, column, _values(batch.column(column))) for name, column in plan.fields]
    texts = [(c, _texts(batch.column(c))) for c in parsed.columns] if parsed is not None else []
    has_id = any(name == "id" for name, _, _ in columns)
    for k in range(batch.num_rows):
        row = first_row + k
        if k in oversized:
            column, size = oversized[k]
            yield RowError(row, column, f"the value is {size:,} bytes, over the limit of "
                           f"{MAX_LINE_BYTES:,} bytes")  # fmt: skip
            continue
        value: dict[str, Any] = {} if has_id else {"id": str(row)}
        for name, _, values in columns:
            if values[k] is not None or name in ("prompt", "messages", "id"):
                value[name] = values[k]
        if parsed is not None:
            filled: dict[str, str] = {}
            for column, strings in texts:
                text = strings[k]
                if text is None:
                    yield RowError(row, column, "null value where --template needs one",
                                   given_id(value, "id"))  # fmt: skip
                    break
                filled[column] = text
            else:
                value["prompt"] = parsed.render(filled)
            if "prompt" not in value:
                continue
        try:
            yield native_entry(value, defaults, vocab_size)
        except FieldError as exc:
            yield RowError(row, _column(exc.path, plan), exc.message, given_id(value, "id"))


def _column(path: tuple[str | int, ...], plan: _Plan) -> str | None:
    """The column a request field's error is in (``chat[0].role`` inside messages)."""
    if not path:
        return None
    if path[0] == "prompt" and plan.prompt[0] == "template":
        return None
    column = dict(plan.fields).get(str(path[0]), str(path[0]))
    return column + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path[1:])


def _values(array: pa.Array) -> list[Any]:
    """Python values of a column; maps as dicts, structs without their null fields."""
    values = array.to_pylist()
    kind = array.type
    if pa.types.is_map(kind):
        return [dict(v) if v is not None else None for v in values]
    if (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and pa.types.is_struct(
        kind.value_type
    ):  # messages: {role, content, name?}
        return [_drop_nulls(v) for v in values]
    return values


def _drop_nulls(items: list[Any] | None) -> list[Any] | None:
    if items is None:
        return None
    return [
        {k: v for k, v in item.items() if v is not None} if isinstance(item, dict) else item
        for item in items
    ]


def _texts(array: pa.Array) -> list[str | None]:
    """A column's values as the text a template inserts: strings as they are, other
    values as their JSON (numbers, lists) or ISO form (dates)."""
    if pa.types.is_string(array.type) or pa.types.is_large_string(array.type):
        return array.to_pylist()
    out: list[str | None] = []
    for value in array.to_pylist():
        if value is None or isinstance(value, str):
            out.append(value)
        elif hasattr(value, "isoformat"):
            out.append(value.isoformat())
        else:
            out.append(json.dumps(value, ensure_ascii=False, default=str))
    return out
