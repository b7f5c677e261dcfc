"""OTLP trace files: OTLP/JSON lines, or the OpenTelemetry Collector file exporter's protobuf records.

OTLP/JSON: one `ExportTraceServiceRequest` object per line. This is the format the OpenTelemetry
Collector's file exporter writes by default and its `otlpjsonfile` receiver reads (ids in lowercase hex,
64-bit integers as decimal strings, enums as integers), so `splitscope report` reads a collector's output
and a collector reads ours. With `format: proto` the file exporter writes each batch as a 4-byte big-endian
length followed by that many bytes of a serialized `TracesData` message (wire-identical to
`ExportTraceServiceRequest`); `iter_records` tells the two apart by the file's first byte, never by its name.

Writing goes through the OpenTelemetry project's own OTLP JSON encoder (`tracer.export.otel.encode_line`, on the
SDK side); reading JSON, here, is a small, fast walk over `orjson.loads` output and needs no OpenTelemetry
package; reading protobuf records uses the project's generated messages (`opentelemetry-proto`, imported
only when a protobuf file is read).

Several processes may append to one file: each batch is one line written with a single `write` on a file
opened with O_APPEND under an advisory `flock`, so lines never interleave.
"""

from __future__ import annotations

import base64
import fcntl
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson

# OTLP span kinds (trace.proto Span.SpanKind).
SPAN_KIND_INTERNAL = 1
SPAN_KIND_SERVER = 2
SPAN_KIND_CLIENT = 3
# OTLP status codes (trace.proto Status.StatusCode).
STATUS_UNSET = 0
STATUS_OK = 1
STATUS_ERROR = 2


class TraceFileError(ValueError):
    """A trace file record (an OTLP/JSON line, a protobuf record) that is not a valid OTLP export request;
    names the file and the line (record number)."""

    def __init__(self, path: str, line_number: int, reason: str) -> None:
        super().__init__(f"{path}:{line_number}: {reason}")
        self.path = path
        self.line_number = line_number
        self.reason = reason


@dataclass(slots=True)
class SpanEvent:
    name: str
    time_ns: int
    attributes: dict[str, Any]


@dataclass(slots=True)
class SpanLink:
    """A span link as read: the linked span's ids (lowercase hex) and the link's attributes."""

    trace_id: str
    span_id: str
    attributes: dict[str, Any]


@dataclass(slots=True)
class Span:
    """One span as read from a trace file. Ids are lowercase hex; times are Unix nanoseconds."""

    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    events: list[SpanEvent] = field(default_factory=list)
    status_code: int = STATUS_UNSET
    status_message: str = ""
    links: list[SpanLink] = field(default_factory=list)

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


# --------------------------------------------------------------------------------------------- writing


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


# --------------------------------------------------------------------------------------------- reading


def _any_value(value: dict[str, Any]) -> Any:
    # One field is set; int64 arrives as a decimal string (proto3 JSON). Most frequent first.
    if "intValue" in value:
        return int(value["intValue"])
    if "stringValue" in value:
        return value["stringValue"]
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "arrayValue" in value:
        return [_any_value(v) for v in value["arrayValue"].get("values", ())]
    if "kvlistValue" in value:
        return _attributes(value["kvlistValue"].get("values", ()))
    return value.get("bytesValue")


def _attributes(key_values: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for kv in key_values:
        value = kv.get("value") or {}
        # The two common cases inline: a million spans' attributes go through here.
        if "intValue" in value:
            out[kv["key"]] = int(value["intValue"])
        elif "stringValue" in value:
            out[kv["key"]] = value["stringValue"]
        else:
            out[kv["key"]] = _any_value(value)
    return out


def _hex_id(value: Any, length: int, what: str) -> str:
    if not isinstance(value, str) or len(value) != length:
        raise ValueError(f"{what} must be {length} hex characters, got {value!r}")
    try:
        int(value, 16)
    except ValueError:
        raise ValueError(f"{what} is not hex: {value!r}") from None
    return value.lower()


def _span_name(raw: dict[str, Any]) -> str:
    name = raw["name"]
    if not isinstance(name, str):
        raise ValueError(f"span name must be a string, got {name!r}")
    return name


def spans_from_request(request: dict[str, Any]) -> Iterator[Span]:
    """Spans of one decoded ExportTraceServiceRequest object. Raises ValueError/KeyError/TypeError."""
    if not isinstance(request, dict) or "resourceSpans" not in request:
        raise ValueError("not an ExportTraceServiceRequest (no resourceSpans)")
    for resource_spans in request["resourceSpans"]:
        resource = _attributes(resource_spans.get("resource", {}).get("attributes", ()))
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for raw in scope_spans.get("spans", ()):
                status = raw.get("status") or {}
                parent = raw.get("parentSpanId") or ""

                yield Span(
                    trace_id=_hex_id(raw.get("traceId"), 32, "traceId"),
                    span_id=_hex_id(raw.get("spanId"), 16, "spanId"),
                    parent_span_id=_hex_id(parent, 16, "parentSpanId") if parent else "",
                    name=_span_name(raw),
                    kind=int(raw.get("kind", 0)),
                    start_ns=int(raw["startTimeUnixNano"]),
                    end_ns=int(raw["endTimeUnixNano"]),
                    attributes=_attributes(raw.get("attributes", ())),
                    resource=resource,
                    events=[
                        SpanEvent(
                            e.get("name", ""), int(e.get("timeUnixNano", 0)), _attributes(e.get("attributes", ()))
                        )
                        for e in raw.get("events", ())
                    ],
                    status_code=int(status.get("code", 0)),
                    status_message=status.get("message", ""),
                    links=[
                        SpanLink(
                            _hex_id(link.get("traceId"), 32, "link traceId"),
                            _hex_id(link.get("spanId"), 16, "link spanId"),
                            _attributes(link.get("attributes", ())),
                        )
                        for link in raw.get("links", ())
                    ],
                )


# OTLP protobuf (the collector file exporter's `format: proto`): the generated messages, loaded on first use.


def _proto_value(value: Any) -> Any:
    # The JSON reader's values for the same data: bytes as base64 text (proto3 JSON), arrays as lists.
    which = value.WhichOneof("value")
    if which == "int_value":
        return value.int_value
    if which == "string_value":
        return value.string_value
    if which == "double_value":
        return value.double_value
    if which == "bool_value":
        return value.bool_value
    if which == "array_value":
        return [_proto_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return _proto_attributes(value.kvlist_value.values)
    if which == "bytes_value":
        return base64.b64encode(value.bytes_value).decode("ascii")
    return None


def _proto_attributes(key_values: Any) -> dict[str, Any]:
    return {kv.key: _proto_value(kv.value) for kv in key_values}


def _proto_id(value: bytes, length: int, what: str) -> str:
    if len(value) != length:
        raise ValueError(f"{what} must be {length} bytes, got {len(value)}")
    return value.hex()


def parse_proto(record: bytes) -> Any:
    """One serialized OTLP `TracesData` (or `ExportTraceServiceRequest`: the same wire format) as the
    opentelemetry-proto message. Raises ValueError for bytes that are not one, ImportError without the
    `opentelemetry-proto` package."""
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.trace.v1.trace_pb2 import TracesData

    try:
        return TracesData.FromString(record)
    except DecodeError as exc:
        raise ValueError(f"not an OTLP protobuf TracesData message ({exc})") from None


def span_from_proto(raw: Any, resource: dict[str, Any], *, events: bool = True) -> Span:
    """One opentelemetry-proto `Span` as the JSON reader reads the same span. Raises ValueError (bad ids)."""
    return Span(
        trace_id=_proto_id(raw.trace_id, 16, "traceId"),
        span_id=_proto_id(raw.span_id, 8, "spanId"),
        parent_span_id=_proto_id(raw.parent_span_id, 8, "parentSpanId") if raw.parent_span_id else "",
        name=raw.name,
        kind=raw.kind,
        start_ns=raw.start_time_unix_nano,
        end_ns=raw.end_time_unix_nano,
        attributes=_proto_attributes(raw.attributes),
        resource=resource,
        events=[SpanEvent(e.name, e.time_unix_nano, _proto_attributes(e.attributes)) for e in raw.events]
        if events
        else [],
        status_code=raw.status.code,
        status_message=raw.status.message,
        links=[
            SpanLink(
                _proto_id(link.trace_id, 16, "link traceId"),
                _proto_id(link.span_id, 8, "link spanId"),
                _proto_attributes(link.attributes),
            )
            for link in raw.links
        ]
        if events
        else [],
    )


def spans_from_proto(record: bytes) -> Iterator[Span]:
    """Spans of one serialized OTLP `TracesData` record. Raises ValueError, ImportError (see parse_proto)."""
    for resource_spans in parse_proto(record).resource_spans:
        resource = _proto_attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for raw in scope_spans.spans:
                yield span_from_proto(raw, resource)


# --------------------------------------------------------------------------------------------- records


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


# --------------------------------------------------------------------------------------------- reading


@dataclass
class ReadStats:
    """What a read took in and skipped; filled in as the iterator advances. `record` is the number of the
    record being read (its line in an OTLP/JSON file), for messages that point into the file."""

    lines: int = 0  # records read: lines of OTLP/JSON or protobuf records
    spans: int = 0
    skipped_lines: int = 0
    first_error: TraceFileError | None = None
    record: int = 0


def spans_from_record(trace_format: TraceFormat, record: bytes) -> list[Span]:
    """Every span of one record. Raises ValueError/KeyError/TypeError/AttributeError for a bad record."""
    if trace_format is TraceFormat.OTLP_JSON:
        return list(spans_from_request(orjson.loads(record)))
    return list(spans_from_proto(record))


def iter_spans(
    paths: Sequence[str | os.PathLike[str]],
    *,
    skip_bad: bool = False,
    stats: ReadStats | None = None,
    growing: bool = False,
) -> Iterator[Span]:
    """Every span of every record of the given trace files (OTLP/JSON lines or protobuf), in file order.

    A bad record (truncated, not JSON, missing fields) raises TraceFileError with its line (record) number,
    or with `skip_bad` is skipped and counted in `stats`; a protobuf file whose framing breaks is skipped
    from there on. Blank lines are ignored (collectors end files with one). `growing`: the files are still
    being appended to (a running server), so an incomplete last record is a write in progress; it is left
    for the next read instead of being reported as truncated.
    """
    stats = stats if stats is not None else ReadStats()
    for path in paths:
        for trace_format, number, record in iter_counted_records(path, skip_bad=skip_bad, stats=stats, growing=growing):
            try:
                batch = spans_from_record(trace_format, record)
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                record_error(TraceFileError(str(path), number, _describe(exc)), skip_bad, stats)
                continue
            stats.spans += len(batch)
            yield from batch


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
            _require_proto(str(path))
        stats.lines += 1
        stats.record = number
        yield trace_format, number, record


def record_error(error: TraceFileError, skip_bad: bool, stats: ReadStats) -> None:
    """Raise `error`, or with `skip_bad` count it as a skipped record."""
    if not skip_bad:
        raise error from None
    stats.skipped_lines += 1
    stats.first_error = stats.first_error or error


def _require_proto(path: str) -> None:
    try:
        import opentelemetry.proto.trace.v1.trace_pb2  # noqa: F401
    except ImportError:
        raise TraceFileError(
            path,
            1,
            "an OTLP protobuf trace file needs the opentelemetry-proto package (pip install 'splitscope[report]')",
        ) from None


def _describe(exc: Exception) -> str:
    if isinstance(exc, orjson.JSONDecodeError):
        return f"not valid JSON ({exc.msg} at column {exc.colno})"
    if isinstance(exc, KeyError):
        return f"span is missing required field {exc.args[0]!r}"
    return str(exc) or type(exc).__name__
