"""How a table's rows become requests: the submit flags for Parquet and CSV input.

A table's columns are data. A column sets a sampling field only where
``--sampling-columns`` maps it: ``max_tokens`` (the column of that name) or
``max_tokens=budget`` (the column ``budget``), so a data set with a column called
``n`` or ``seed`` is read as it is. Jobs submitted before the flag existed kept no
mapping in their record: retry reads them as they were read then, every column
named like a sampling field being one (``sampling_columns`` None).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from batchgen.jobs.schema.errors import UsageError
from batchgen.jobs.schema.sampling import CHECKS


@dataclass(frozen=True, slots=True)
class TableSpec:
    """How a table's rows become requests (the submit flags)."""

    prompt_column: str | None = None
    messages_column: str | None = None
    template: str | None = None
    id_column: str | None = None
    keep_columns: tuple[str, ...] = ()  # ("all",): every column
    # "FIELD=COLUMN" each (parse_sampling_columns); None: a job from before the flag
    sampling_columns: tuple[str, ...] | None = ()

    @property
    def given(self) -> bool:
        return any((self.prompt_column, self.messages_column, self.template, self.id_column,
                    self.keep_columns, self.sampling_columns))  # fmt: skip

    def sampling_fields(self, names: list[str]) -> list[tuple[str, str]]:
        """(sampling field, column) of each mapped column; ``names``: the input's columns."""
        if self.sampling_columns is None:
            return [(name, name) for name in names if name in CHECKS]
        return [tuple(item.split("=", 1)) for item in self.sampling_columns]  # type: ignore[misc]

    def to_json(self) -> str:
        """As the job record keeps it (retry reads the table again the same way)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True) if self.given else ""

    @classmethod
    def from_json(cls, raw: str) -> TableSpec:
        data = json.loads(raw) if raw else {}
        mapped = data.get("sampling_columns") if raw else ()
        return cls(**{**data, "keep_columns": tuple(data.get("keep_columns") or ()),
                      "sampling_columns": None if mapped is None else tuple(mapped)})  # fmt: skip


def parse_sampling_columns(value: str | None) -> tuple[str, ...]:
    """``--sampling-columns max_tokens,temperature=temp`` as ("max_tokens=max_tokens",
    "temperature=temp"); a usage error for a name that is no sampling field."""
    if not value:
        return ()
    out: list[str] = []
    for item in value.split(","):
        field, _, column = (part.strip() for part in item.partition("="))
        if field not in CHECKS:
            raise UsageError(
                f"--sampling-columns: {field!r} is not a sampling field (one of "
                f"{', '.join(sorted(CHECKS))})"
            )
        if any(x.split("=", 1)[0] == field for x in out):
            raise UsageError(f"--sampling-columns: {field!r} is mapped twice")
        out.append(f"{field}={column or field}")
    return tuple(out)
