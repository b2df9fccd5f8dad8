"""Where a prompts file comes from: a local path, or any URI pyarrow.fs opens
(``s3://bucket/prompts.jsonl?endpoint_override=host:port&scheme=http``, ``gs://``,
...), with credentials from the environment only, as for outputs (names.py).

A remote file is streamed once into the submit's private spool folder (memory
bounded by COPY_CHUNK), and validated there like a local one: validation reads
ranges of it in parallel, which a stream cannot serve.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa

from batchgen.jobs.errors import InlineCredentials, UsageError
from batchgen.jobs.names import inline_credentials
from batchgen.jobs.storage import open_uri

COPY_CHUNK = 8 << 20


def local_copy(source: str, folder: Path) -> str:
    """A local path holding ``source``'s bytes: ``source`` itself when local, else a
    copy in ``folder``. A missing or unreadable source is a one-line usage error."""
    if "://" not in source:
        if not os.path.isfile(source) or not os.access(source, os.R_OK):
            raise UsageError(f"cannot read {source}: not a readable file")
        return source
    reason = inline_credentials(source)
    if reason:
        raise InlineCredentials(f"cannot read the prompts: {reason}")
    target = folder / "prompts.jsonl"
    try:
        fs, path = open_uri(source)
        with fs.open_input_stream(path) as src, open(target, "wb") as out:
            while chunk := src.read(COPY_CHUNK):
                out.write(chunk)
    except (OSError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise UsageError(f"cannot read {source}: {exc}") from exc
    return str(target)
