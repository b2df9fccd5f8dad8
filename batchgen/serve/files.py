"""Files: metadata in Redis (``P:file:ID``, indexed in ``P:files`` and its tenant's
``P:tenant:T:files``), bytes in the files store.

The store is a directory, local or on an object store (``jobs.storage.OutputDir``);
a file's bytes are at ``FILES_DIR/ID`` and appear whole or not at all. A file
belongs to one store (its record says which): a server with another
``--files-dir`` does not serve it, and its sweep never touches it.

A file expires at ``expires_at`` (0: never): its record and bytes go. A file that
an open batch reads is only hidden when deleted or expired (404 from then on) and
goes once no open batch reads it, so a running batch never loses its input.
Local uploads are written to a temp file tagged with the server's instance id
(a lease in Redis while the server lives): a temp file whose server is gone (a
kill -9 mid-upload) is removed by the sweep of any server on that store.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import pyarrow as pa
import pyarrow.fs as pafs
import redis

from batchgen.interface_errors import APIError
from batchgen.jobs.redis import hash_codec
from batchgen.jobs.redis.hash_codec import OMIT_EMPTY
from batchgen.jobs.redis.keys import Keys, text
from batchgen.jobs.schema.errors import UsageError
from batchgen.jobs.storage.output_store import TEMP_PREFIX, OutputDir
from batchgen.serve.api_keys import Principal
from batchgen.serve.openai_errors import not_found

PURPOSES = ("batch", "batch_output")  # uploads are "batch"; result files "batch_output"
TEMP_TAG = "serve_"  # .tmp-serve_INSTANCE_... : an upload of a live server, or a dead one's
HIDDEN_RETRY_S = 60  # a hidden file still read by a batch is looked at again after this


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


@dataclass(slots=True)
class FileObject:
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    tenant: str = field(default="", metadata=OMIT_EMPTY)  # api_keys.py; "" without keys
    store: str = ""  # the files dir holding its bytes ("": before stores were recorded)
    expires_at: int = 0  # unix s; 0: never
    hidden: bool = False  # deleted or expired while an open batch reads it: goes after

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes,
                "created_at": self.created_at, "filename": self.filename,
                "purpose": self.purpose, "status": "processed", "status_details": None,
                "expires_at": self.expires_at or None}  # fmt: skip


class FileStore:
    def __init__(self, conn: redis.Redis, keys: Keys, files_dir: str, instance: str = "") -> None:
        self.conn, self.keys, self.instance = conn, keys, instance
        self.dir = OutputDir.open(files_dir)
        self.uri = self.dir.uri
        if self.dir.local:
            try:
                os.makedirs(self.dir.path, exist_ok=True)
            except OSError as exc:  # a path through a regular file, no permission, ...
                raise UsageError(f"--files-dir {files_dir}: cannot use it as a folder "
                                 f"({exc.strerror or exc})") from None  # fmt: skip

    @contextlib.contextmanager
    def writing(self, file_id: str) -> Iterator[IO[bytes]]:
        """Bytes for ``file_id``; they appear when the block ends, not at all if it raises."""
        tag = f"{TEMP_TAG}{self.instance}_" if self.instance else ""
        with self.dir.writing(file_id, temp_tag=tag) as out:
            yield out

    def register(self, file_id: str, filename: str, purpose: str, nbytes: int, tenant: str,
                 expires_at: int = 0) -> FileObject:  # fmt: skip
        """Make a written file visible to the API (to ``tenant`` and admins)."""
        obj = FileObject(file_id, nbytes, int(time.time()), filename, purpose, tenant, self.uri,
                         expires_at)  # fmt: skip
        now = time.time()
        pipe = self.conn.pipeline(transaction=True)
        pipe.hset(self.keys.file(file_id), mapping=dict[Any, Any](hash_codec.to_hash(obj)))
        pipe.zadd(self.keys.files, {file_id: now})
        if tenant:
            pipe.zadd(self.keys.tenant_files(tenant), {file_id: now})
        if expires_at:
            pipe.zadd(self.keys.expiring_files(self.uri), {file_id: expires_at})
        pipe.execute()
        return obj

    def record(self, file_id: str) -> FileObject | None:
        """The stored record, whoever's and wherever its bytes are; None: none."""
        raw = self.conn.hgetall(self.keys.file(file_id))
        return hash_codec.from_hash(FileObject, raw, id=file_id) if raw else None

    def get(self, file_id: str, who: Principal) -> FileObject:
        """The file as ``who`` may see it: 404 for another tenant's, a hidden one or one kept
        in another server's files dir."""
        obj = self.record(file_id)
        if obj is None or obj.hidden or not who.sees(obj.tenant):
            raise not_found("file", file_id)
        if obj.store and obj.store != self.uri:
            raise APIError(404, f"file {file_id!r} is kept in another files dir than this "
                           "server's (--files-dir): ask the batchgen serve that uses it",
                           code="file_elsewhere")  # fmt: skip
        return obj

    def page(
        self, who: Principal, purpose: str | None, after: str | None, limit: int
    ) -> tuple[list[FileObject], bool]:
        """Newest first, after the file ``after``; (page, has_more)."""
        index = self.keys.files if who.admin else self.keys.tenant_files(who.tenant)
        start = 0
        if after:
            rank = self.conn.zrevrank(index, after)
            if rank is None:
                raise not_found("file", after)
            start = int(rank) + 1  # type: ignore[arg-type]
        out: list[FileObject] = []
        while len(out) <= limit:
            ids = [text(i) for i in self.conn.zrevrange(index, start, start + 99)]
            if not ids:
                break
            start += len(ids)
            for file_id in ids:
                with contextlib.suppress(APIError):
                    obj = self.get(file_id, who)
                    if purpose is None or obj.purpose == purpose:
                        out.append(obj)
        return out[:limit], len(out) > limit

    def delete(self, obj: FileObject, in_use: bool) -> None:
        """Delete ``obj``: at once, or hidden until no open batch reads it (``in_use``)."""
        if not in_use:
            self.remove(obj)
            return
        pipe = self.conn.pipeline(transaction=True)
        pipe.hset(self.keys.file(obj.id), "hidden", "1")
        pipe.zrem(self.keys.files, obj.id)
        pipe.zrem(self.keys.tenant_files(obj.tenant), obj.id)
        pipe.zadd(self.keys.expiring_files(self.uri), {obj.id: time.time() + HIDDEN_RETRY_S})
        pipe.execute()

    def remove(self, obj: FileObject) -> None:
        """Its record, its places in the indexes, then its bytes."""
        pipe = self.conn.pipeline(transaction=True)
        pipe.delete(self.keys.file(obj.id))
        pipe.zrem(self.keys.files, obj.id)
        pipe.zrem(self.keys.tenant_files(obj.tenant), obj.id)
        pipe.zrem(self.keys.expiring_files(self.uri), obj.id)
        pipe.execute()
        self.dir.delete_file(obj.id)

    def sweep(self, in_use: Callable[[str], bool], now: float | None = None) -> int:
        """Remove this store's files past their expiry (hidden ones too) that no open batch
        reads, and the temp files of servers that died mid-upload; how many files went."""
        now = time.time() if now is None else now
        index = self.keys.expiring_files(self.uri)
        removed = 0
        for file_id in [text(i) for i in self.conn.zrangebyscore(index, 0, now, 0, 100)]:
            obj = self.record(file_id)
            if obj is None:
                self.conn.zrem(index, file_id)
            elif in_use(file_id):
                self.conn.zadd(index, {file_id: now + HIDDEN_RETRY_S})
            else:
                self.remove(obj)
                removed += 1
        self.sweep_temp_files()
        return removed

    def sweep_temp_files(self) -> None:
        if not self.dir.local:
            return  # an object store's upload that never completed left no object
        with contextlib.suppress(FileNotFoundError), os.scandir(self.dir.path) as entries:
            for entry in entries:
                if not entry.name.startswith(TEMP_PREFIX) or not entry.is_file():
                    continue
                rest = entry.name.removeprefix(TEMP_PREFIX)
                if not rest.startswith(TEMP_TAG):
                    continue  # not a server's upload
                owner = rest.removeprefix(TEMP_TAG).split("_", 1)[0]
                if not self.conn.exists(self.keys.serve_instance(owner)):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)

    def exists(self, file_id: str) -> bool:
        """Whether the file's bytes are in the store."""
        return self.dir.fs.get_file_info(self.dir.file(file_id)).type == pafs.FileType.File

    def open(self, file_id: str) -> pa.NativeFile:
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
