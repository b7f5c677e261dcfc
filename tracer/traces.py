"""Reading trace files: the public names of the OTLP codec's readers, under the name importers know.

Everything here is defined in `tracer.otlp` (the one module that owns the format: tracer/otlp/__init__.py
maps it); this module owns nothing and only re-exports, so `from tracer.traces import iter_spans, Span`
keeps working. New code may import either.
"""

from __future__ import annotations

from tracer.otlp import (
    SPAN_KIND_CLIENT,
    SPAN_KIND_INTERNAL,
    SPAN_KIND_SERVER,
    STATUS_ERROR,
    STATUS_OK,
    STATUS_UNSET,
    ReadStats,
    Span,
    SpanEvent,
    SpanLink,
    TraceFileError,
    TraceFormat,
    append_line,
    describe_error,
    iter_counted_records,
    iter_records,
    iter_spans,
    parse_proto,
    record_error,
    span_from_proto,
    spans_from_record,
    spans_from_request,
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
