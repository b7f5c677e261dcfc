"""One value, every path through the codec: OTLP request in, JSON line out, file records read back.

The ground truth is opentelemetry-proto's own messages (built here, serialized by protobuf) and base64 as
Python's standard library writes it; each reading path must agree on the values, bytes included.
"""

from __future__ import annotations

import base64

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from tracer.otlp import TraceFormat, spans_from_record
from tracer.otlp.encode import LineEncoder, resource_prefix
from tracer.otlp.requests import decode_protobuf
from tracer.otlp.typed import decode_request, struct_attributes

RAW = b"\x00\xffsplit\n"
VALUES = {"blob": RAW, "n": 7, "ratio": 0.25, "flag": True, "name": "w0", "list": [1, "a"], "map": {"k": 2}}


def _any(value: object) -> AnyValue:
    if isinstance(value, bytes):
        return AnyValue(bytes_value=value)
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, str):
        return AnyValue(string_value=value)
    if isinstance(value, list):
        out = AnyValue()
        out.array_value.values.extend(_any(v) for v in value)
        return out
    out = AnyValue()
    out.kvlist_value.values.extend(KeyValue(key=k, value=_any(v)) for k, v in value.items())
    return out


def _request() -> bytes:
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    resource_spans.resource.attributes.add(key="service.name", value=AnyValue(string_value="svc"))
    span = resource_spans.scope_spans.add().spans.add()
    span.trace_id, span.span_id, span.name = bytes(range(1, 17)), bytes(range(1, 9)), "s"
    span.start_time_unix_nano, span.end_time_unix_nano = 10, 20
    span.attributes.extend(KeyValue(key=k, value=_any(v)) for k, v in VALUES.items())
    return request.SerializeToString()


def test_bytes_are_bytes_in_span_data_and_base64_text_in_every_read_span():
    ((resource, (data,)),) = decode_protobuf(_request())
    assert data.attributes == VALUES  # SpanData keeps bytes as bytes (they are encoded again)
    read_back = {**VALUES, "blob": base64.b64encode(RAW).decode("ascii")}

    line = LineEncoder().line(resource_prefix(resource), [data])
    (from_json,) = spans_from_record(TraceFormat.OTLP_JSON, line)
    (from_proto,) = spans_from_record(TraceFormat.OTLP_PROTO, _request())
    typed = decode_request(line).resourceSpans[0].scopeSpans[0].spans[0]
    assert from_json.attributes == read_back
    assert from_proto.attributes == read_back
    assert struct_attributes(typed.attributes) == read_back
    assert from_json.trace_id == from_proto.trace_id == bytes(range(1, 17)).hex()
