"""The OTLP trace format's constants, the span a trace file is read into, and the id conversions.

Ids: a trace id is 16 bytes, a span id 8 (trace.proto). OTLP/JSON writes them as lowercase hex (32 and
16 characters; the OTLP spec's exception to proto3 JSON's base64), protobuf as bytes; a read `Span` holds
lowercase hex, a `tracer.spans.SpanData` integers. An empty parent id means a root span. Pure; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# OTLP span kinds (trace.proto Span.SpanKind).
SPAN_KIND_INTERNAL = 1
SPAN_KIND_SERVER = 2
SPAN_KIND_CLIENT = 3
# OTLP status codes (trace.proto Status.StatusCode).
STATUS_UNSET = 0
STATUS_OK = 1
STATUS_ERROR = 2
TRACE_ID_BYTES = 16
SPAN_ID_BYTES = 8


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
    """One span as read from a trace file. Ids are lowercase hex; times are Unix nanoseconds; attribute
    values as `tracer.otlp.values` reads them (bytes as base64 text)."""

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


def hex_id(value: Any, length: int, what: str) -> str:
    """An OTLP/JSON id (`length` hex characters) in lowercase. Raises ValueError naming `what`."""
    if not isinstance(value, str) or len(value) != length:
        raise ValueError(f"{what} must be {length} hex characters, got {value!r}")
    try:
        int(value, 16)
    except ValueError:
        raise ValueError(f"{what} is not hex: {value!r}") from None
    return value.lower()


def hex_from_bytes(value: bytes, length: int, what: str) -> str:
    """A protobuf id (`length` bytes) as lowercase hex. Raises ValueError naming `what`."""
    if len(value) != length:
        raise ValueError(f"{what} must be {length} bytes, got {len(value)}")
    return value.hex()


def span_name(value: Any) -> str:
    """A span's name, which must be a string. Raises ValueError."""
    if not isinstance(value, str):
        raise ValueError(f"span name must be a string, got {value!r}")
    return value
