"""OTLP/JSON trace files: one `ExportTraceServiceRequest` object per line.

This is the format the OpenTelemetry Collector's file exporter writes and its `otlpjsonfile` receiver
reads (ids in lowercase hex, 64-bit integers as decimal strings, enums as integers), so `splitscope
report` reads a collector's output and a collector reads ours.

Writing goes through the OpenTelemetry project's own OTLP JSON encoder (`tracer.otel.encode_line`, on the
SDK side); reading, here, is a small, fast walk over `orjson.loads` output (the report reads a million
spans, and protobuf-object parsing would dominate) and needs no OpenTelemetry package.

Several processes may append to one file: each batch is one line written with a single `write` on a file
opened with O_APPEND under an advisory `flock`, so lines never interleave.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
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
    """A trace file line that is not a valid OTLP/JSON export request; names the file and line."""

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
                )


@dataclass
class ReadStats:
    """What a read skipped; filled in as the iterator advances."""

    lines: int = 0
    spans: int = 0
    skipped_lines: int = 0
    first_error: TraceFileError | None = None


def iter_spans(
    paths: Sequence[str | os.PathLike[str]],
    *,
    skip_bad: bool = False,
    stats: ReadStats | None = None,
    growing: bool = False,
) -> Iterator[Span]:
    """Every span of every line of the given OTLP/JSON files, in file order.

    A bad line (truncated, not JSON, missing fields) raises TraceFileError with its line number, or with
    `skip_bad` is skipped and counted in `stats`. Blank lines are ignored (collectors end files with one).
    `growing`: the files are still being appended to (a running server), so a last line without its newline
    is a write in progress; it is left for the next read instead of being reported as truncated.
    """
    stats = stats if stats is not None else ReadStats()
    for path in paths:
        with open(path, "rb") as handle:
            for line_number, line in enumerate(handle, start=1):
                if growing and not line.endswith(b"\n"):
                    break  # only the last line can lack its newline: another process is writing it
                if not line.strip():
                    continue
                stats.lines += 1
                try:
                    batch = list(spans_from_request(orjson.loads(line)))
                except (ValueError, KeyError, TypeError, AttributeError) as exc:
                    error = TraceFileError(str(path), line_number, _describe(exc))
                    if not skip_bad:
                        raise error from None
                    stats.skipped_lines += 1
                    stats.first_error = stats.first_error or error
                    continue
                stats.spans += len(batch)
                yield from batch


def _describe(exc: Exception) -> str:
    if isinstance(exc, orjson.JSONDecodeError):
        return f"not valid JSON ({exc.msg} at column {exc.colno})"
    if isinstance(exc, KeyError):
        return f"span is missing required field {exc.args[0]!r}"
    return str(exc) or type(exc).__name__
