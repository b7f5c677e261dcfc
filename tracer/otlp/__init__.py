"""The OTLP trace codec: the one place that reads and writes our trace files and OTLP requests.

    format.py    the format's constants (span kinds, status codes, id sizes), `Span` (a span as read from a
                 file), TraceFileError, id conversions
    values.py    AnyValue / attribute conversions in every direction, and the rule for bytes values
    files.py     trace files: OTLP/JSON lines or the collector's length-prefixed protobuf records, told
                 apart by content; appending lines safely from several processes; ReadStats
    decode.py    records -> `Span`s, the generic way (every field); `iter_spans` over files
    typed.py     the fast path: msgspec structs for OTLP/JSON lines, which the report's reader
                 (tracer.report.read) specialises on for its step columns
    requests.py  OTLP export requests (protobuf or JSON) -> SpanData per resource (the sidecar's receivers)
    http_body.py the OTLP/HTTP body rules every receiver of ours applies (content types, bounded gzip)
    encode.py    writing OTLP/JSON lines: SpanData -> line (the sidecar's fast path), SDK spans -> line
                 (the OpenTelemetry encoder, the reference the fast path is byte-identical to)

A shared layer: it imports the tracer core (tracer.spans) and nothing of any application. `requests.py`
needs opentelemetry-proto and `encode_sdk_line` the OpenTelemetry SDK's exporter; the rest needs only
orjson and msgspec. The names below are the readers' public API.
"""

from __future__ import annotations

from tracer.otlp.decode import iter_spans, parse_proto, span_from_proto, spans_from_record, spans_from_request
from tracer.otlp.files import (
    ReadStats,
    TraceFormat,
    append_line,
    describe_error,
    iter_counted_records,
    iter_records,
    record_error,
)
from tracer.otlp.format import (
    SPAN_KIND_CLIENT,
    SPAN_KIND_INTERNAL,
    SPAN_KIND_SERVER,
    STATUS_ERROR,
    STATUS_OK,
    STATUS_UNSET,
    Span,
    SpanEvent,
    SpanLink,
    TraceFileError,
)

__all__ = [
    "SPAN_KIND_CLIENT",
    "SPAN_KIND_INTERNAL",
    "SPAN_KIND_SERVER",
    "STATUS_ERROR",
    "STATUS_OK",
    "STATUS_UNSET",
    "ReadStats",
    "Span",
    "SpanEvent",
    "SpanLink",
    "TraceFileError",
    "TraceFormat",
    "append_line",
    "describe_error",
    "iter_counted_records",
    "iter_records",
    "iter_spans",
    "parse_proto",
    "record_error",
    "span_from_proto",
    "spans_from_record",
    "spans_from_request",
]
