"""OTLP trace export requests (protobuf or JSON) -> `Batch`es of SpanData, one per resource.

Protobuf goes through opentelemetry-proto's generated `ExportTraceServiceRequest`; JSON through the
OpenTelemetry project's own OTLP/JSON codec (opentelemetry-proto-json: hex ids, int64 as strings), so the
two paths share one converter over the same field names. Anything malformed raises `OtlpDecodeError`
with a reason fit for a 400 answer.

What a SpanData cannot hold is not kept: links, trace state, the instrumentation scope and an OK status.
An ERROR status becomes `error_type` (the span's `error.type` attribute, else the status message).
"""

from __future__ import annotations

from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto_json.collector.trace.v1.trace_service import (
    ExportTraceServiceRequest as JsonExportTraceServiceRequest,
)

from tracer.sidecar.ingest_queue import Batch, resource_key
from tracer.spans import ATTR_ERROR_TYPE, SpanData

STATUS_ERROR = 2
_ANY_VALUE_FIELDS = (
    "string_value",
    "bool_value",
    "int_value",
    "double_value",
    "array_value",
    "kvlist_value",
    "bytes_value",
)


class OtlpDecodeError(ValueError):
    """The request is not a valid OTLP trace export; the message says why."""


def decode_protobuf(body: bytes) -> list[Batch]:
    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    except DecodeError as exc:
        raise OtlpDecodeError(f"not an OTLP ExportTraceServiceRequest protobuf: {exc}") from None
    return batches_from_request(request)


def decode_json(body: bytes) -> list[Batch]:
    try:
        request = JsonExportTraceServiceRequest.from_json(body)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise OtlpDecodeError(f"not an OTLP/JSON ExportTraceServiceRequest: {exc}") from None
    return batches_from_request(request)


def batches_from_request(request: Any) -> list[Batch]:
    """Works on both message families (protobuf and proto_json share field names)."""
    out = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes) if resource_spans.resource else {}
        spans = [_span(raw) for scope_spans in resource_spans.scope_spans for raw in scope_spans.spans]
        if spans:
            out.append(Batch(resource_key(resource), spans))
    return out


def _span(raw: Any) -> SpanData:
    trace_id, span_id, parent = bytes(raw.trace_id or b""), bytes(raw.span_id or b""), bytes(raw.parent_span_id or b"")
    name = raw.name or ""
    if len(trace_id) != 16 or not any(trace_id):
        raise OtlpDecodeError(f"span {name!r}: traceId must be 16 bytes, not all zero")
    if len(span_id) != 8 or not any(span_id):
        raise OtlpDecodeError(f"span {name!r}: spanId must be 8 bytes, not all zero")
    if parent and len(parent) != 8:
        raise OtlpDecodeError(f"span {name!r}: parentSpanId must be 8 bytes or empty")
    start_ns, end_ns = int(raw.start_time_unix_nano or 0), int(raw.end_time_unix_nano or 0)
    if end_ns < start_ns:
        raise OtlpDecodeError(f"span {name!r} ends before it starts")
    attributes = _attributes(raw.attributes)
    error_type = ""
    status = raw.status
    if status is not None and int(status.code or 0) == STATUS_ERROR:
        error_type = str(attributes.pop(ATTR_ERROR_TYPE, "") or status.message or "error")
    return SpanData(
        name=name,
        kind=int(raw.kind or 0) or 1,
        trace_id=int.from_bytes(trace_id, "big"),
        span_id=int.from_bytes(span_id, "big"),
        parent_span_id=int.from_bytes(parent, "big") if parent else 0,
        start_ns=start_ns,
        end_ns=end_ns,
        attributes=attributes,
        events=[(e.name or "", int(e.time_unix_nano or 0), _attributes(e.attributes)) for e in raw.events],
        error_type=error_type,
    )


def _attributes(key_values: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in key_values}


def _value(value: Any) -> Any:
    if value is None:
        return None
    which = value.WhichOneof("value") if hasattr(value, "WhichOneof") else _json_which(value)
    if which is None:
        return None
    if which == "array_value":
        return [_value(v) for v in getattr(value, which).values]
    if which == "kvlist_value":
        return _attributes(getattr(value, which).values)
    if which == "bytes_value":
        return bytes(getattr(value, which))
    return getattr(value, which)


def _json_which(value: Any) -> str | None:
    for field in _ANY_VALUE_FIELDS:
        if getattr(value, field) is not None:
            return field
    return None
