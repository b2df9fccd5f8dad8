"""Where the input comes from and what it is: a local path, or any URI pyarrow.fs
opens (``s3://bucket/prompts.jsonl?endpoint_override=host:port&scheme=http``,
``gs://``, ...), with credentials from the environment only, as for outputs
(names.py).

Its format is its name's: ``.jsonl`` (also ``.jsonl.gz``, ``.jsonl.zst``),
``.parquet`` or ``.csv``; a folder's is that of the files it holds (all Parquet or
all CSV; names starting with ``.`` or ``_`` are skipped, as Spark's ``_SUCCESS``).
Anything else is a usage error.

A remote or compressed JSONL file is streamed once into the submit's private
spool folder (memory bounded by COPY_CHUNK), decompressed on the way, and
validated there like a local one: validation reads ranges of it in parallel,
which a stream cannot serve. Tables are read where they are (tables.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

from batchgen.jobs.schema.errors import InlineCredentials, UsageError
from batchgen.jobs.storage.names import inline_credentials
from batchgen.jobs.storage.output_store import open_uri

COPY_CHUNK = 8 << 20
SUFFIXES = {".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".jsonl.zst": "jsonl",
            ".parquet": "parquet", ".csv": "csv"}  # fmt: skip
TABLE_FORMATS = ("parquet", "csv")
_COMPRESSED = {".gz": "gzip", ".zst": "zstd"}


@dataclass(slots=True)
class Input:
    format: str  # "jsonl", "parquet" or "csv"
    fs: pafs.FileSystem
    files: list[str]  # paths inside ``fs``, in the order they are read


def locate(source: str, input_format: str | None = None) -> Input:
    """What ``source`` is and the files it holds; a usage error, one line, when it
    cannot be read or its format cannot be told. ``input_format``: given, not told by
    the name (a single file)."""
    if "://" in source:
        reason = inline_credentials(source)
        if reason:
            raise InlineCredentials(f"cannot read the prompts: {reason}")
    try:
        fs, path = open_uri(source) if "://" in source else (pafs.LocalFileSystem(), source)
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.Directory:
            return _folder(source, fs, path)
        if info.type != pafs.FileType.File or (
            "://" not in source and not os.access(path, os.R_OK)
        ):
            raise UsageError(f"cannot read {source}: not a readable file or folder")
    except (OSError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise UsageError(f"cannot read {source}: {exc}") from exc
    return Input(input_format or _format_of(path), fs, [path])


def _format_of(path: str) -> str:
    """The format a file's name says; any other name is read as JSONL lines, as
    submit always did (``prompts.txt``, a name without a suffix)."""
    name = path.rsplit("/", 1)[-1].lower()
    for suffix, kind in SUFFIXES.items():
        if name.endswith(suffix):
            return kind
    return "jsonl"


def _folder(source: str, fs: pafs.FileSystem, path: str) -> Input:
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    files = sorted(
        i.path for i in infos
        if i.type == pafs.FileType.File
        and not any(p.startswith((".", "_")) for p in i.path[len(path):].split("/") if p)
    )  # fmt: skip
    kinds = {_format_of(f) for f in files}
    if not files:
        raise UsageError(f"cannot read {source}: the folder holds no Parquet or CSV files")
    if len(kinds) > 1 or not kinds <= set(TABLE_FORMATS):
        raise UsageError(
            f"{source}: a folder must hold Parquet files or CSV files only, not "
            f"{' and '.join(sorted(kinds))}"
        )
    return Input(kinds.pop(), fs, files)


def local_copy(source: str, found: Input, folder: Path) -> str:
    """A local, uncompressed path holding a JSONL ``source``: ``source`` itself when
    local and plain, else a copy (decompressed) in ``folder``."""
    (path,) = found.files
    compression = next((c for s, c in _COMPRESSED.items() if path.lower().endswith(s)), None)
    if "://" not in source and compression is None:
        return source
    target = folder / "prompts.jsonl"
    try:
        with (
            found.fs.open_input_stream(path, compression=compression) as src,
            open(target, "wb") as out,
        ):
            while chunk := src.read(COPY_CHUNK):
                out.write(chunk)
    except (OSError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise UsageError(f"cannot read {source}: {exc}") from exc
    return str(target)
