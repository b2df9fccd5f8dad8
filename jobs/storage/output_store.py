"""A job's output directory, local or on an object store (pyarrow.fs).

Writes are whole or absent (``writing``): locally a temp name, fsync, rename,
fsync of the directory; on object stores a streamed upload that completes at
the end. A failed write leaves nothing behind. Local
writes and reads are confined to the directory's real path (names.py).
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, cast

import pyarrow as pa
import pyarrow.fs as pafs

from batchgen.jobs.schema.errors import OutputError, UnsafeName
from batchgen.jobs.storage.names import check_file_name, inline_credentials

TEMP_PREFIX = ".tmp-"
# S3 requests give up when no byte moves this long (pyarrow's own retries follow); without
# them a store that accepts connections and never answers held a worker's write > 60 s.
S3_CONNECT_TIMEOUT_S = 5.0
S3_REQUEST_TIMEOUT_S = 10.0


@dataclass(slots=True)
class OutputDir:
    uri: str
    fs: pafs.FileSystem
    path: str  # the directory inside ``fs``
    local: bool

    @classmethod
    def open(cls, uri: str) -> OutputDir:
        if "://" not in uri:
            return cls(uri, pafs.LocalFileSystem(), uri, local=True)
        reason = inline_credentials(uri)  # a job recorded before submit refused them
        if reason:
            raise OutputError(f"cannot open output: {reason}")
        try:
            fs, path = open_uri(uri)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as exc:
            raise OutputError(f"cannot open output {uri!r}: {exc}") from exc
        return cls(uri, fs, path.rstrip("/"), local=isinstance(fs, pafs.LocalFileSystem))

    def file(self, *names: str) -> str:
        """The path of ``names`` (plain names, each checked) inside this directory."""
        return "/".join([self.path, *(check_file_name(n) for n in names)])

    def _confined(self, path: str) -> str:
        """``path`` unless a symlink takes it outside the directory's real path."""
        if not self.local:
            return path
        root = os.path.realpath(self.path)
        real = os.path.realpath(path)
        if real != root and not real.startswith(root + os.sep):
            raise UnsafeName(
                f"{path} resolves to {real}, outside the job's output directory {self.path} "
                "(a symlink?); remove the link"
            )
        return path

    @contextlib.contextmanager
    def writing(self, *names: str, temp_tag: str = "") -> Iterator[IO[bytes]]:
        """A binary stream whose bytes appear at ``names`` whole when the block ends, or
        not at all if it raises (nothing is left behind either way).

        Locally: a temp file beside the target, fsync, rename, fsync of the directory.
        On object stores: streamed to the key (a multipart upload for big objects, so
        memory stays bounded), which appears when the upload completes at the end of
        the block; if the block raises, what was uploaded is deleted. (pyarrow cannot
        abort an upload, and a copy into place would be limited to 5 GB.) Readers never
        look at an object before Redis or a manifest says it is complete.
        ``temp_tag`` starts the local temp file's name (after TEMP_PREFIX): who writes it.
        """
        final = self.file(*names)
        parent = final.rsplit("/", 1)[0]
        tmp = f"{parent}/{TEMP_PREFIX}{temp_tag}{uuid.uuid4().hex}-{names[-1]}"
        try:
            if self.local:
                os.makedirs(parent, exist_ok=True)
                self._confined(parent)
                with _removed_on_error(lambda: os.unlink(tmp)):
                    with open(tmp, "wb") as out:
                        yield out
                        out.flush()
                        os.fsync(out.fileno())
                    os.replace(tmp, final)
                _fsync_dir(parent)
            else:
                with (
                    _removed_on_error(lambda: self.fs.delete_file(final)),
                    self.fs.open_output_stream(final) as stream,
                ):
                    yield cast(IO[bytes], stream)
        except OSError as exc:
            raise OutputError(f"cannot write {final}: {exc}") from exc

    def write_atomic(
        self, names: tuple[str, ...], data: bytes, halfway: Callable[[], None] | None = None
    ) -> str:
        """Publish ``data`` at ``names`` whole or not at all; the path written.

        ``halfway`` runs after half the bytes reached the temp file (a crash point).
        """
        with self.writing(*names) as out:
            out.write(data[: len(data) // 2])
            if halfway is not None:
                out.flush()
                halfway()
            out.write(data[len(data) // 2 :])
        return self.file(*names)

    def read_bytes(self, *names: str) -> bytes:
        path = self._confined(self.file(*names))
        try:
            with self.fs.open_input_stream(path) as src:
                return bytes(src.read())
        except (OSError, pa.ArrowInvalid) as exc:
            raise OutputError(f"cannot read {path}: {exc}") from exc

    def open_input(self, *names: str) -> pa.NativeFile:
        path = self._confined(self.file(*names))
        try:
            return self.fs.open_input_file(path)
        except (OSError, pa.ArrowInvalid) as exc:
            raise OutputError(f"cannot read {path}: {exc}") from exc

    def exists(self, *names: str) -> bool:
        info = self.fs.get_file_info(self.file(*names))
        return info.type != pafs.FileType.NotFound

    def delete_temp_files(self) -> int:
        """Remove temp files of writes that were killed halfway; how many."""
        if self.fs.get_file_info(self.path).type != pafs.FileType.Directory:
            return 0
        removed = 0
        for info in self.fs.get_file_info(pafs.FileSelector(self.path)):
            name = info.base_name
            if info.type == pafs.FileType.File and name.startswith(TEMP_PREFIX):
                check_file_name(name.removeprefix(TEMP_PREFIX))  # one of ours
                self.fs.delete_file(self._confined(f"{self.path}/{name}"))
                removed += 1
        return removed

    def delete_file(self, *names: str) -> None:
        """Remove a file if it is there."""
        path = self._confined(self.file(*names))
        try:
            self.fs.delete_file(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if self.fs.get_file_info(path).type != pafs.FileType.NotFound:
                raise OutputError(f"cannot delete {path}: {exc}") from exc

    def delete_dir(self, *names: str) -> None:
        """Remove a directory and what it holds, if it is there."""
        path = self.file(*names)
        if self.fs.get_file_info(path).type == pafs.FileType.Directory:
            self._confined(path)
            self.fs.delete_dir(path)

    def delete_empty_dir(self, *names: str) -> None:
        """Remove a directory only if nothing is left in it (another job may use it).

        Locally atomically (rmdir). On object stores a directory is an empty marker
        object (pyarrow leaves one behind when it deletes the last file under it)."""
        path = self._confined(self.file(*names))
        if not self.local:
            info = self.fs.get_file_info(path)
            if info.type == pafs.FileType.Directory and not self.fs.get_file_info(
                pafs.FileSelector(path)
            ):
                self.fs.delete_dir(path)
            return
        try:
            os.rmdir(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno != errno.ENOTEMPTY:
                raise OutputError(f"cannot remove {path}: {exc}") from exc


def open_uri(uri: str) -> tuple[pafs.FileSystem, str]:
    """``pafs.FileSystem.from_uri``, with timeouts on S3 requests (the URI cannot carry
    them: pyarrow rebuilds the filesystem from its own options, as when unpickling)."""
    fs, path = pafs.FileSystem.from_uri(uri)
    if isinstance(fs, pafs.S3FileSystem):
        rebuild, (options,) = fs.__reduce__()
        fs = rebuild({**options, "connect_timeout": S3_CONNECT_TIMEOUT_S,
                      "request_timeout": S3_REQUEST_TIMEOUT_S})  # fmt: skip
    return fs, path


@contextlib.contextmanager
def _removed_on_error(remove: Callable[[], None]) -> Iterator[None]:
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            remove()
        raise


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
