"""A job's output directory, local or on an object store (pyarrow.fs).

Writes are atomic: locally a temp name, fsync, rename, fsync of the directory;
on object stores a single put (the object appears whole or not at all). Local
writes and reads are confined to the directory's real path (names.py).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs

from batchgen.jobs.errors import OutputError, UnsafeName
from batchgen.jobs.names import check_file_name, inline_credentials


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
            fs, path = pafs.FileSystem.from_uri(uri)
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

    def write_atomic(
        self, names: tuple[str, ...], data: bytes, halfway: Callable[[], None] | None = None
    ) -> str:
        """Publish ``data`` at ``names`` whole or not at all; the path written.

        ``halfway`` runs after half the bytes reached the temp file (a crash point).
        """
        final = self.file(*names)
        try:
            if not self.local:
                with self.fs.open_output_stream(final) as out:  # one put
                    out.write(data)
                return final
            parent = os.path.dirname(final)
            os.makedirs(parent, exist_ok=True)
            self._confined(parent)
            tmp = os.path.join(parent, f".tmp-{uuid.uuid4().hex}-{names[-1]}")
            with open(tmp, "wb") as out:
                out.write(data[: len(data) // 2])
                if halfway is not None:
                    out.flush()
                    halfway()
                out.write(data[len(data) // 2 :])
            return self.publish_local(tmp, *names)
        except OSError as exc:
            raise OutputError(f"cannot write {final}: {exc}") from exc

    def publish_local(self, tmp: str, *names: str) -> str:
        """fsync the finished temp file ``tmp``, rename it to ``names``, fsync the dir."""
        final = self.file(*names)
        parent = os.path.dirname(final)
        os.makedirs(parent, exist_ok=True)
        self._confined(parent)
        try:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
            dir_fd = os.open(parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            raise OutputError(f"cannot write {final}: {exc}") from exc
        return final

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

    def delete_dir(self, *names: str) -> None:
        path = self.file(*names)
        if self.fs.get_file_info(path).type == pafs.FileType.Directory:
            self._confined(path)
            self.fs.delete_dir(path)
