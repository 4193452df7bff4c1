"""File contents on disk: uploads written as they arrive, batch outputs, downloads.

Contents live in ``<batch_dir>/files/<file id>``; the store (:mod:`.store`) holds their metadata. An upload
(``multipart/form-data`` with ``purpose`` and ``file``, as OpenAI's SDK sends it) is parsed as it streams in
(python-multipart's push parser) and the file part written to a temporary file beside the others, renamed
to its id once whole and synced, so a file is either complete under its id or absent. With router replicas
the directory is one ReadWriteMany volume, so any replica serves any file.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from vllm_stack.errors import RouterError

#: The form fields an upload may have beside ``file`` (OpenAI's ``files.create``); any other is refused.
FORM_FIELDS = frozenset({"purpose", "expires_after[anchor]", "expires_after[seconds]"})
MAX_FIELD_BYTES = 4096  # one such field's value
MAX_PART_HEADER_BYTES = 8192  # one part's header lines together (Content-Disposition, Content-Type)
MAX_BOUNDARY = 70  # characters of a multipart boundary (RFC 2046 5.1.1)
#: What the form costs in memory beside the file's bytes, at most: its fields and one part's headers.
FORM_BYTES = len(FORM_FIELDS) * MAX_FIELD_BYTES + MAX_PART_HEADER_BYTES
MULTIPART_SLACK = 64 * 1024  # what the form adds around the file, at most
READ_CHUNK = 256 * 1024


def file_too_large(limit: int) -> RouterError:
    return RouterError(
        413, f"The file exceeds the limit of {limit} bytes.", param="file", code="file_too_large"
    )


class FileDirectory:
    """The directory of file contents (created when missing)."""

    def __init__(self, root: Path) -> None:
        self.root = root / "files"
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        if not file_id or "/" in file_id or file_id.startswith("."):
            raise RouterError(404, f"No such File object: {file_id}", param="file_id", code="not_found")
        return self.root / file_id

    def temporary(self) -> Path:
        return self.root / f".part-{secrets.token_hex(8)}"

    def publish(self, temporary: Path, file_id: str) -> None:
        """A complete file takes its id (synced first: a file under its id is whole)."""
        with open(temporary, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, self.path(file_id))

    def remove(self, file_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(file_id).unlink()

    def size(self, file_id: str) -> int | None:
        try:
            return self.path(file_id).stat().st_size
        except FileNotFoundError:
            return None

    async def chunks(self, file_id: str) -> AsyncIterator[bytes]:
        """A file's contents in pieces (local disk reads of page-cached data: fast enough for the loop)."""
        with open(self.path(file_id), "rb") as handle:  # noqa: ASYNC230 - see above
            while True:
                data = handle.read(READ_CHUNK)
                if not data:
                    return
                yield data

    def read_range(self, file_id: str, start: int, length: int) -> bytes:
        with open(self.path(file_id), "rb") as handle:
            handle.seek(start)
            return handle.read(length)


class Upload:
    """One ``multipart/form-data`` upload, fed as it arrives: ``purpose`` kept, ``file`` written to
    ``target``; the file part may have at most ``limit`` bytes. Beside the piece being fed, an upload holds
    at most :data:`FORM_BYTES` in memory whatever its form: only the known fields are kept (others are
    refused), each bounded, and one part's headers at a time, bounded."""

    def __init__(self, content_type: bytes, target: Path, limit: int) -> None:
        kind, options = parse_options_header(content_type)
        boundary = options.get(b"boundary")
        if kind != b"multipart/form-data" or not boundary:
            raise RouterError(
                400,
                "Uploads take multipart/form-data with the fields 'purpose' and 'file'.",
                code="invalid_content_type",
            )
        if len(boundary) > MAX_BOUNDARY:
            raise RouterError(
                400,
                f"The multipart boundary is longer than {MAX_BOUNDARY} characters (RFC 2046).",
                code="invalid_content_type",
            )
        self.target = target
        self.limit = limit
        self.fields: dict[str, bytes] = {}
        self.filename: str | None = None
        self.size = 0
        self._handle: IO[bytes] | None = None
        self._part_name: str | None = None
        self._part_filename: str | None = None
        self._field: list[bytes] = []
        self._field_size = 0
        self._header_name = b""
        self._header_value = b""
        self._header_bytes = 0  # of the current part's header lines
        self._headers: dict[bytes, bytes] = {}
        self._error: RouterError | None = None
        self._parser = MultipartParser(
            boundary,
            {
                "on_part_begin": self._part_begin,
                "on_header_field": self._header_field,
                "on_header_value": self._header_value_part,
                "on_header_end": self._header_end,
                "on_headers_finished": self._headers_finished,
                "on_part_data": self._part_data,
                "on_part_end": self._part_end,
            },
        )

    # ---- feeding -------------------------------------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        try:
            self._parser.write(data)
        except FormParserError as exc:
            raise RouterError(400, f"Malformed multipart body: {exc}", code="invalid_multipart") from None
        if self._error is not None:
            raise self._error

    def finish(self) -> None:
        """The body ended: the file is whole on disk (not yet published), or this raises."""
        try:
            self._parser.finalize()
        except FormParserError as exc:
            raise RouterError(400, f"Malformed multipart body: {exc}", code="invalid_multipart") from None
        if self._handle is not None:  # the body ended inside the file part
            self.discard()
            raise RouterError(400, "The multipart body ended inside a part.", code="invalid_multipart")
        if self.filename is None:
            raise RouterError(400, "The upload has no 'file' part.", param="file", code="missing_file")

    def discard(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        with contextlib.suppress(FileNotFoundError):
            self.target.unlink()

    # ---- parser callbacks --------------------------------------------------------------------------------------
    def _part_begin(self) -> None:
        self._headers = {}
        self._header_bytes = 0
        self._part_name = None
        self._part_filename = None
        self._field = []
        self._field_size = 0

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        if self._header_room(end - start):
            self._header_name += data[start:end]

    def _header_value_part(self, data: bytes, start: int, end: int) -> None:
        if self._header_room(end - start):
            self._header_value += data[start:end]

    def _header_room(self, size: int) -> bool:
        self._header_bytes += size
        if self._header_bytes > MAX_PART_HEADER_BYTES and self._error is None:
            self._error = RouterError(
                400,
                f"A multipart part's headers are longer than {MAX_PART_HEADER_BYTES} bytes.",
                code="invalid_multipart",
            )
        return self._error is None

    def _header_end(self) -> None:
        self._headers[self._header_name.strip().lower()] = self._header_value.strip()
        self._header_name = self._header_value = b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        name = options.get(b"name")
        self._part_name = name.decode("utf-8", "replace") if name is not None else None
        filename = options.get(b"filename")
        if self._part_name != "file" and self._part_name not in FORM_FIELDS and self._error is None:
            self._error = RouterError(
                400,
                f"Unknown form field {self._part_name!s:.64}; an upload takes 'file', 'purpose' and"
                " 'expires_after'.",
                param=self._part_name[:64] if self._part_name else None,
                code="invalid_field",
            )
            return
        if self._part_name == "file":
            if self.filename is not None:
                self._error = RouterError(400, "The upload has two 'file' parts.", param="file")
                return
            self._part_filename = (filename or b"upload.jsonl").decode("utf-8", "replace")
            self._handle = open(self.target, "wb")  # noqa: SIM115 - closed in _part_end or discard

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._error is not None:
            return
        size = end - start
        if self._handle is not None:
            self.size += size
            if self.size > self.limit:
                self._error = file_too_large(self.limit)
                self.discard()
                return
            self._handle.write(data[start:end])
            return
        self._field_size += size
        if self._field_size > MAX_FIELD_BYTES:
            self._error = RouterError(
                400,
                f"Form field '{self._part_name}' is longer than {MAX_FIELD_BYTES} bytes.",
                param=self._part_name,
                code="invalid_field",
            )
            return
        self._field.append(data[start:end])

    def _part_end(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
            self.filename = self._part_filename
        elif self._part_name is not None and self._error is None:
            self.fields[self._part_name] = b"".join(self._field)
