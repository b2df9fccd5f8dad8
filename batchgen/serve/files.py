"""Files: metadata in Redis (``P:file:ID``, indexed in ``P:files``), bytes in the files store.

The store is a directory, local or on an object store (``jobs.storage.OutputDir``);
a file's bytes are at ``FILES_DIR/ID`` and appear whole or not at all.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import pyarrow as pa
import redis

from batchgen.jobs.redis import hash_codec
from batchgen.jobs.redis.keys import Keys, text
from batchgen.jobs.schema.errors import UsageError
from batchgen.jobs.storage.output_store import OutputDir
from batchgen.serve.openai_errors import not_found

PURPOSES = ("batch", "batch_output")  # uploads are "batch"; result files "batch_output"


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


@dataclass(slots=True)
class FileObject:
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes,
                "created_at": self.created_at, "filename": self.filename,
                "purpose": self.purpose, "status": "processed", "status_details": None,
                "expires_at": None}  # fmt: skip


class FileStore:
    def __init__(self, conn: redis.Redis, keys: Keys, files_dir: str) -> None:
        self.conn, self.keys = conn, keys
        self.dir = OutputDir.open(files_dir)
        if self.dir.local:
            try:
                os.makedirs(self.dir.path, exist_ok=True)
            except OSError as exc:  # a path through a regular file, no permission, ...
                raise UsageError(f"--files-dir {files_dir}: cannot use it as a folder "
                                 f"({exc.strerror or exc})") from None  # fmt: skip

    @contextlib.contextmanager
    def writing(self, file_id: str) -> Iterator[IO[bytes]]:
        """Bytes for ``file_id``; they appear when the block ends, not at all if it raises."""
        with self.dir.writing(file_id) as out:
            yield out

    def register(self, file_id: str, filename: str, purpose: str, nbytes: int) -> FileObject:
        """Make a written file visible to the API."""
        obj = FileObject(file_id, nbytes, int(time.time()), filename, purpose)
        pipe = self.conn.pipeline(transaction=True)
        pipe.hset(self.keys.file(file_id), mapping=dict[Any, Any](hash_codec.to_hash(obj)))
        pipe.zadd(self.keys.files, {file_id: time.time()})
        pipe.execute()
        return obj

    def get(self, file_id: str) -> FileObject:
        raw = self.conn.hgetall(self.keys.file(file_id))
        if not raw:
            raise not_found("file", file_id)
        return hash_codec.from_hash(FileObject, raw, id=file_id)

    def page(
        self, purpose: str | None, after: str | None, limit: int
    ) -> tuple[list[FileObject], bool]:
        """Newest first, after the file ``after``; (page, has_more)."""
        start = 0
        if after:
            rank = self.conn.zrevrank(self.keys.files, after)
            if rank is None:
                raise not_found("file", after)
            start = int(rank) + 1  # type: ignore[arg-type]
        out: list[FileObject] = []
        while len(out) <= limit:
            ids = [text(i) for i in self.conn.zrevrange(self.keys.files, start, start + 99)]
            if not ids:
                break
            start += len(ids)
            for file_id in ids:
                with contextlib.suppress(Exception):
                    obj = self.get(file_id)
                    if purpose is None or obj.purpose == purpose:
                        out.append(obj)
        return out[:limit], len(out) > limit

    def delete(self, file_id: str) -> None:
        self.get(file_id)
        pipe = self.conn.pipeline(transaction=True)
        pipe.delete(self.keys.file(file_id))
        pipe.zrem(self.keys.files, file_id)
        pipe.execute()
        self.dir.delete_file(file_id)

    def open(self, file_id: str) -> pa.NativeFile:
        self.get(file_id)
        return self.dir.open_input(file_id)

    def local_path(self, file_id: str) -> str | None:
        """The file's path when the store is local (no copy needed)."""
        return self.dir.file(file_id) if self.dir.local else None

    @contextlib.contextmanager
    def as_local_file(self, file_id: str) -> Iterator[str]:
        """A local path holding the file's bytes: the file itself, or a temp copy."""
        local = self.local_path(file_id)
        if local is not None:
            yield local
            return
        tmp = tempfile.mkdtemp(prefix="batchgen-serve-")
        try:
            path = os.path.join(tmp, "input.jsonl")
            with self.open(file_id) as src, open(path, "wb") as dst:
                shutil.copyfileobj(src, dst, 8 << 20)
            yield path
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
