"""A multipart/form-data upload parsed as it streams in: the file part's bytes come out
chunk by chunk (to be written to the files store), never held whole. Everything
else is bounded: at most ``MAX_FIELDS`` other fields of ``MAX_FIELD_BYTES`` each (and
python-multipart's own bounds on a part's headers: 8 of 4 KB), so no body makes the
server hold more than a few tens of KB besides the chunk in hand. A malformed body is
a 400. An upload is complete only once its closing
boundary arrived: a body cut short (however its Content-Length reads) is refused."""

from __future__ import annotations

from typing import Any

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from batchgen.interface_errors import APIError

MAX_FIELD_BYTES = 4096
MAX_FIELDS = 16  # parts other than the file


class MultipartUpload:
    def __init__(self, content_type: str) -> None:
        kind, params = parse_options_header(content_type)
        boundary = params.get(b"boundary")
        if kind != b"multipart/form-data" or not boundary:
            raise APIError(400, "POST /v1/files takes multipart/form-data (fields file, purpose)",
                           code="invalid_request")  # fmt: skip
        self.fields: dict[str, str] = {}
        self.filename: str | None = None  # of the part named "file"
        self.file_bytes = 0
        self._pending: list[bytes] = []
        self._part_name = ""
        self._is_file = False
        self._field = bytearray()
        self._header_name = bytearray()
        self._header_value = bytearray()
        self._headers: dict[bytes, bytes] = {}
        self._parts = 0
        self.complete = False  # the closing boundary arrived
        callbacks: Any = {
            "on_part_begin": self._part_begin,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
            "on_header_field": lambda d, s, e: self._header_name.extend(d[s:e]),
            "on_header_value": lambda d, s, e: self._header_value.extend(d[s:e]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_end": self._end,
        }
        self.parser = MultipartParser(boundary, callbacks)

    def feed(self, chunk: bytes) -> list[bytes]:
        """Parse ``chunk``; the file data it completed (write it out, in order)."""
        try:
            self.parser.write(chunk)
        except MultipartParseError as exc:
            raise APIError(400, f"the multipart body is malformed: {exc}",
                           code="invalid_request") from None  # fmt: skip
        out, self._pending = self._pending, []
        return out

    def finish(self) -> None:
        """The body ended: refused unless its closing boundary arrived."""
        self.parser.finalize()
        if not self.complete:
            raise APIError(400, "the upload ended before its closing boundary (the body was "
                           "cut short); nothing was stored", code="incomplete_upload")  # fmt: skip

    def _end(self) -> None:
        self.complete = True

    def _part_begin(self) -> None:
        self._parts += 1
        if self._parts > MAX_FIELDS + 1:
            raise APIError(400, f"an upload takes the file and at most {MAX_FIELDS} other "
                           "form fields", code="invalid_request")  # fmt: skip
        self._headers, self._part_name, self._is_file = {}, "", False
        self._field.clear()

    def _header_end(self) -> None:
        self._headers[bytes(self._header_name).lower()] = bytes(self._header_value)
        self._header_name.clear()
        self._header_value.clear()

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        self._part_name = options.get(b"name", b"").decode("utf-8", "replace")
        filename = options.get(b"filename")
        self._is_file = self._part_name == "file" and filename is not None
        if self._is_file:
            if self.filename is not None:
                raise APIError(400, "give one file per upload", code="invalid_request",
                               param="file")  # fmt: skip
            self.filename = filename.decode("utf-8", "replace")[:255] if filename else ""

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._is_file:
            self._pending.append(bytes(data[start:end]))
            self.file_bytes += end - start
        elif len(self._field) + end - start <= MAX_FIELD_BYTES:
            self._field.extend(data[start:end])
        else:
            raise APIError(400, f"form field {self._part_name!r} is too long",
                           code="invalid_request", param=self._part_name)  # fmt: skip

    def _part_end(self) -> None:
        if not self._is_file and self._part_name:
            self.fields[self._part_name] = self._field.decode("utf-8", "replace")
