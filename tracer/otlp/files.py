"""Trace files: their framing, told apart by content, and appending to them. Blocking file I/O.

OTLP/JSON: one `ExportTraceServiceRequest` object per line. This is the format the OpenTelemetry
Collector's file exporter writes by default and its `otlpjsonfile` receiver reads, so `splitscope report`
reads a collector's output and a collector reads ours. With `format: proto` the file exporter writes each
batch as a 4-byte big-endian length followed by that many bytes of a serialized `TracesData` message
(wire-identical to `ExportTraceServiceRequest`); `iter_records` tells the two apart by the file's first
byte, never by its name.

Several processes may append to one file: each batch is one line written with a single `write` on a file
opened with O_APPEND under an advisory `flock`, so lines never interleave.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson

from tracer.otlp.format import TraceFileError


def append_line(path: str | os.PathLike[str], line: bytes) -> None:
    """Append one whole line; safe against concurrent appends from other processes. Blocks on disk I/O."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        view = memoryview(line)
        while view:  # a regular-file write is whole in practice; loop only to be correct on short writes
            written = os.write(fd, view)
            view = view[written:]
    finally:
        os.close(fd)  # closing releases the lock


class TraceFormat(StrEnum):
    """How a trace file frames its records, told by its first byte (never by its name)."""

    OTLP_JSON = "otlp-json"  # one ExportTraceServiceRequest object per line
    # The collector file exporter's `format: proto`: a 4-byte big-endian length, then a TracesData message.
    OTLP_PROTO = "otlp-proto"


# A JSON object starts with "{", possibly after whitespace. A protobuf file starts with its first record's
# length, big-endian: its first byte is 0 below 16 MiB and could only be "{" or whitespace for records of
# 150 MB or more, which no exporter batches.
_JSON_FIRST_BYTES = frozenset(b"{ \t\r\n")
_PROTO_LENGTH_BYTES = 4
_READ_BUFFER_BYTES = 1 << 20  # lines of a few hundred KB: the default 8 KiB buffer reads them 2-3x slower
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # the file exporter's `compression: zstd` compresses each record


def iter_records(path: str | os.PathLike[str], *, growing: bool = False) -> Iterator[tuple[TraceFormat, int, bytes]]:
    """(format, record number, record bytes) for every record of a trace file, in file order. Blocking I/O.

    Record numbers are line numbers in an OTLP/JSON file (blank lines are skipped, not renumbered) and
    1-based record indices in a protobuf file. A protobuf file whose framing breaks (a length that runs past
    the end of the file, a compressed record) cannot be read past that point: TraceFileError.
    `growing`: the file is still being appended to, so an incomplete last record is a write in progress and
    ends the iteration quietly. Raises FileNotFoundError for a missing file.
    """
    with open(path, "rb", buffering=_READ_BUFFER_BYTES) as handle:
        head = handle.read(1)
        handle.seek(0)
        if not head:
            return
        if head[0] in _JSON_FIRST_BYTES:
            for line_number, line in enumerate(handle, start=1):
                if growing and not line.endswith(b"\n"):
                    break  # only the last line can lack its newline: another process is writing it
                if line.strip():
                    yield TraceFormat.OTLP_JSON, line_number, line
            return
        yield from _proto_records(handle, str(path), growing)


def _proto_records(handle: Any, path: str, growing: bool) -> Iterator[tuple[TraceFormat, int, bytes]]:
    size_bytes = os.fstat(handle.fileno()).st_size
    offset = 0
    number = 0
    while True:
        prefix = handle.read(_PROTO_LENGTH_BYTES)
        if not prefix:
            return
        number += 1
        length = int.from_bytes(prefix, "big") if len(prefix) == _PROTO_LENGTH_BYTES else -1
        left = size_bytes - offset - len(prefix)
        if length < 0 or length > left:
            if growing:
                return  # the writer has not finished this record
            raise TraceFileError(path, number, _framing_error(number, offset, prefix, length, left))
        record = handle.read(length)  # no larger than what the file holds: checked above
        if record.startswith(_ZSTD_MAGIC):
            raise TraceFileError(path, number, "zstd-compressed protobuf record: decompress the file first")
        yield TraceFormat.OTLP_PROTO, number, record
        offset += _PROTO_LENGTH_BYTES + length


def _framing_error(number: int, offset: int, prefix: bytes, length: int, left: int) -> str:
    where = "a length prefix" if length < 0 else f"{length} bytes"
    framing = f"record {number} at byte {offset} declares {where} but {left} follow"
    if number == 1:
        return (
            f"not a trace file: not OTLP/JSON lines (it starts with {prefix[:1]!r}, not '{{') and not "
            f"length-prefixed OTLP protobuf ({framing})"
        )
    return f"truncated OTLP protobuf file: {framing}"


@dataclass
class ReadStats:
    """What a read took in and skipped; filled in as the iterator advances. `record` is the number of the
    record being read (its line in an OTLP/JSON file), for messages that point into the file."""

    lines: int = 0  # records read: lines of OTLP/JSON or protobuf records
    spans: int = 0
    skipped_lines: int = 0
    first_error: TraceFileError | None = None
    record: int = 0


def iter_counted_records(
    path: str | os.PathLike[str], *, skip_bad: bool, stats: ReadStats, growing: bool = False
) -> Iterator[tuple[TraceFormat, int, bytes]]:
    """`iter_records`, counting records in `stats`; a broken framing raises TraceFileError, or with
    `skip_bad` counts as one skipped record and ends the file. A protobuf file read without
    `opentelemetry-proto` installed is one TraceFileError that says what to install, skip_bad or not."""
    records = iter_records(path, growing=growing)
    while True:
        try:
            trace_format, number, record = next(records)
        except StopIteration:
            return
        except TraceFileError as error:
            record_error(error, skip_bad, stats)
            return
        if trace_format is TraceFormat.OTLP_PROTO and number == 1:
            require_proto(str(path))
        stats.lines += 1
        stats.record = number
        yield trace_format, number, record


def record_error(error: TraceFileError, skip_bad: bool, stats: ReadStats) -> None:
    """Raise `error`, or with `skip_bad` count it as a skipped record."""
    if not skip_bad:
        raise error from None
    stats.skipped_lines += 1
    stats.first_error = stats.first_error or error


def require_proto(path: str) -> None:
    """Raise TraceFileError (record 1 of `path`) saying what to install when opentelemetry-proto is missing."""
    try:
        import opentelemetry.proto.trace.v1.trace_pb2  # noqa: F401
    except ImportError:
        raise TraceFileError(
            path,
            1,
            "an OTLP protobuf trace file needs the opentelemetry-proto package (pip install 'splitscope[report]')",
        ) from None


def describe_error(exc: Exception) -> str:
    """The reason a TraceFileError gives for a record that failed to decode with `exc`."""
    if isinstance(exc, orjson.JSONDecodeError):
        return f"not valid JSON ({exc.msg} at column {exc.colno})"
    if isinstance(exc, KeyError):
        return f"span is missing required field {exc.args[0]!r}"
    return str(exc) or type(exc).__name__
