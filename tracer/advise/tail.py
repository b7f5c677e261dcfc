"""Incremental reading of growing trace files: each poll returns only the records appended since the last.

What the sidecar and the OpenTelemetry Collector's file exporter write: OTLP/JSON lines, or the exporter's
length-prefixed protobuf (told apart by the first byte, as tracer.otlp does). Per file the tail keeps an
open handle, the file's identity (device, inode) and the byte offset just past the last complete record,
so a poll reads only the bytes appended since the one before. The rules:

- a partial last record (a line without its newline, a protobuf record shorter than its length prefix says)
  is a write in progress: it is left unread, and read whole at a later poll;
- a file that does not exist yet is looked for again at every poll (it may appear later);
- rotation (the path now names another file, a new inode): the old handle is read to its end first, then
  the new file is read from its start;
- truncation (the same file, now shorter than the offset: `copytruncate`): it is read again from its start.
  A file truncated and then grown past the old offset between two polls cannot be told from one that only
  grew (as with `tail -F`); poll more often than the writer can do that.

Spans already read are kept in every case (the tail never forgets what it returned). Blocking file I/O;
one thread (not thread-safe).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

from tracer.otlp import TraceFileError, TraceFormat

_JSON_FIRST_BYTES = frozenset(b"{ \t\r\n")
_PROTO_LENGTH_BYTES = 4
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# Bytes read per call: a poll after a long pause reads a large backlog in slices of this size.
READ_CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class Record:
    trace_format: TraceFormat
    number: int  # line number (OTLP/JSON) or 1-based record index (protobuf), counted from the file's start
    data: bytes


class FileTail:
    """One trace file, read incrementally (the module's rules). `poll()` returns the new complete records."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        self._handle: IO[bytes] | None = None
        self._identity: tuple[int, int] | None = None
        self._format: TraceFormat | None = None
        self.offset_bytes = 0  # just past the last complete record returned
        self._number = 0  # records (lines) consumed so far in the current file
        self.rotations = 0  # times the path named a new file
        self.truncations = 0  # times the file was found shorter than the offset

    def poll(self) -> list[Record]:
        """The complete records appended since the last poll, in file order. Blocking; never waits."""
        records: list[Record] = []
        if self._handle is not None:
            if os.fstat(self._handle.fileno()).st_size < self.offset_bytes:
                self.truncations += 1
                self._restart()
            records += self._drain()
        identity = _identity(self.path)
        if identity is None or identity == self._identity:
            return records
        if self._handle is not None:  # rotated: the old file was read to its end above
            self.rotations += 1
            self._handle.close()
        try:
            self._handle = open(self.path, "rb")  # noqa: SIM115  (kept open across polls)
        except FileNotFoundError:  # gone again between the stat and the open
            self._handle, self._identity = None, None
            return records
        self._identity = (os.fstat(self._handle.fileno()).st_dev, os.fstat(self._handle.fileno()).st_ino)
        self._restart()
        return records + self._drain()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def _restart(self) -> None:
        self.offset_bytes, self._number, self._format = 0, 0, None

    def _drain(self) -> list[Record]:
        assert self._handle is not None
        records: list[Record] = []
        while True:
            self._handle.seek(self.offset_bytes)
            chunk = self._handle.read(READ_CHUNK_BYTES)
            if not chunk:
                return records
            if self._format is None:
                self._format = TraceFormat.OTLP_JSON if chunk[0] in _JSON_FIRST_BYTES else TraceFormat.OTLP_PROTO
            before = self.offset_bytes
            parse = self._json if self._format is TraceFormat.OTLP_JSON else self._proto
            records += parse(chunk)
            if self.offset_bytes == before:  # only a partial record left: wait for the writer
                if len(chunk) == READ_CHUNK_BYTES and self._format is TraceFormat.OTLP_JSON:
                    raise TraceFileError(self.path, self._number + 1, f"a line longer than {READ_CHUNK_BYTES} bytes")
                return records

    def _json(self, chunk: bytes) -> Iterator[Record]:
        end = chunk.rfind(b"\n") + 1  # only whole lines: the rest is a write in progress
        self.offset_bytes += end
        for line in chunk[:end].splitlines():
            self._number += 1
            if line.strip():
                yield Record(TraceFormat.OTLP_JSON, self._number, line)

    def _proto(self, chunk: bytes) -> Iterator[Record]:
        position = 0
        while len(chunk) - position >= _PROTO_LENGTH_BYTES:
            length = int.from_bytes(chunk[position : position + _PROTO_LENGTH_BYTES], "big")
            start = position + _PROTO_LENGTH_BYTES
            if start + length > len(chunk):
                if length > READ_CHUNK_BYTES:
                    raise TraceFileError(self.path, self._number + 1, f"a {length}-byte protobuf record")
                break  # the writer has not finished this record
            record = chunk[start : start + length]
            self._number += 1
            if record.startswith(_ZSTD_MAGIC):
                raise TraceFileError(self.path, self._number, "zstd-compressed protobuf record: decompress it first")
            position = start + length
            self.offset_bytes += _PROTO_LENGTH_BYTES + length
            yield Record(TraceFormat.OTLP_PROTO, self._number, record)


def _identity(path: str) -> tuple[int, int] | None:
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_dev, stat.st_ino
