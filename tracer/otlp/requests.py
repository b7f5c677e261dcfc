"""OTLP trace export requests (protobuf or JSON) -> SpanData, grouped by resource: the receivers' decode.

Protobuf goes through opentelemetry-proto's generated `ExportTraceServiceRequest`; JSON through the
OpenTelemetry project's own OTLP/JSON codec (opentelemetry-proto-json: hex ids, int64 as strings), so the
two paths share one converter over the same field names. Anything malformed raises `OtlpDecodeError`
with a reason fit for a 400 answer. Values as `tracer.otlp.values.message_value` reads them (bytes kept).

What a SpanData cannot hold is not kept: links, trace state, the instrumentation scope and an OK status.
An ERROR status becomes `error_type` (the span's `error.type` attribute, else the status message).
Pure CPU; runs on the receiver's thread.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto_json.collector.trace.v1.trace_service import (
    ExportTraceServiceRequest as JsonExportTraceServiceRequest,
)

from tracer.otlp.format import SPAN_ID_BYTES, SPAN_KIND_INTERNAL, STATUS_ERROR, TRACE_ID_BYTES
from tracer.otlp.values import message_attributes
from tracer.spans import ATTR_ERROR_TYPE, SpanData

# One resource's spans: its attributes, and the spans it sent (in request order).
ResourceSpans = tuple[dict[str, Any], list[SpanData]]


class OtlpDecodeError(ValueError):
    """The request is not a valid OTLP trace export; the message says why."""


def decode_protobuf(body: bytes) -> list[ResourceSpans]:
    """A binary OTLP/HTTP body or gRPC message. Raises OtlpDecodeError."""
    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    except DecodeError as exc:
        raise OtlpDecodeError(f"not an OTLP ExportTraceServiceRequest protobuf: {exc}") from None
    return spans_from_request(request)


def decode_json(body: bytes) -> list[ResourceSpans]:
    """An OTLP/JSON body. Raises OtlpDecodeError."""
    try:
        request = JsonExportTraceServiceRequest.from_json(body)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise OtlpDecodeError(f"not an OTLP/JSON ExportTraceServiceRequest: {exc}") from None
    return spans_from_request(request)


def spans_from_request(request: Any) -> list[ResourceSpans]:
    """Works on both message families (protobuf and proto_json share field names); resources without
    spans are left out. Raises OtlpDecodeError."""
    out = []
    for resource_spans in request.resource_spans:
        resource = message_attributes(resource_spans.resource.attributes) if resource_spans.resource else {}
        spans = [_span(raw) for scope_spans in resource_spans.scope_spans for raw in scope_spans.spans]
        if spans:
            out.append((resource, spans))
    return out


def _span(raw: Any) -> SpanData:
    trace_id, span_id, parent = bytes(raw.trace_id or b""), bytes(raw.span_id or b""), bytes(raw.parent_span_id or b"")
    name = raw.name or ""
    if len(trace_id) != TRACE_ID_BYTES or not any(trace_id):
        raise OtlpDecodeError(f"span {name!r}: traceId must be {TRACE_ID_BYTES} bytes, not all zero")
    if len(span_id) != SPAN_ID_BYTES or not any(span_id):
        raise OtlpDecodeError(f"span {name!r}: spanId must be {SPAN_ID_BYTES} bytes, not all zero")
    if parent and len(parent) != SPAN_ID_BYTES:
        raise OtlpDecodeError(f"span {name!r}: parentSpanId must be {SPAN_ID_BYTES} bytes or empty")
    start_ns, end_ns = int(raw.start_time_unix_nano or 0), int(raw.end_time_unix_nano or 0)
    if end_ns < start_ns:
        raise OtlpDecodeError(f"span {name!r} ends before it starts")
    attributes = message_attributes(raw.attributes)
    error_type = ""
    status = raw.status
    if status is not None and int(status.code or 0) == STATUS_ERROR:
        error_type = str(attributes.pop(ATTR_ERROR_TYPE, "") or status.message or "error")
    return SpanData(
        name=name,
        kind=int(raw.kind or 0) or SPAN_KIND_INTERNAL,
        trace_id=int.from_bytes(trace_id, "big"),
        span_id=int.from_bytes(span_id, "big"),
        parent_span_id=int.from_bytes(parent, "big") if parent else 0,
        start_ns=start_ns,
        end_ns=end_ns,
        attributes=attributes,
        events=[(e.name or "", int(e.time_unix_nano or 0), message_attributes(e.attributes)) for e in raw.events],
        error_type=error_type,
    )
