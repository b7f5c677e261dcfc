"""Malformed, oversized or unauthenticated input gets one clear 4xx answer and never hurts the sidecar."""

from __future__ import annotations

import gzip
import json
import urllib.error
import urllib.request

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from tests.sidecar.conftest import assert_grpc_export_needs_token, assert_unix_handshake_refused, http_get, spans_when
from tracer.sidecar.auth import TOKEN_ENV

LIMIT = 64 * 1024


def _post(port: int, body: bytes, content_type: str = "application/x-protobuf", **headers: str) -> tuple[int, str]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/traces", data=body, headers={"Content-Type": content_type, **headers}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def _request(n_spans: int = 1, trace_id: bytes = b"\x01" * 16, start: int = 10, end: int = 20) -> bytes:
    spans = [
        trace_pb2.Span(
            trace_id=trace_id,
            span_id=(i + 1).to_bytes(8, "big"),
            name=f"s{i}",
            start_time_unix_nano=start,
            end_time_unix_nano=end,
        )
        for i in range(n_spans)
    ]
    request = trace_service_pb2.ExportTraceServiceRequest(
        resource_spans=[trace_pb2.ResourceSpans(scope_spans=[trace_pb2.ScopeSpans(spans=spans)])]
    )
    return request.SerializeToString()


@pytest.mark.parametrize(
    "body, content_type, encoding, status, reason",
    [
        (b"\xff\xff\xff not protobuf", "application/x-protobuf", None, 400, "not an OTLP ExportTraceServiceRequest"),
        (b"{not json", "application/json", None, 400, "not an OTLP/JSON"),
        (
            json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz", "spanId": "00"}]}]}]}).encode(),
            "application/json",
            None,
            400,
            "Invalid hex",
        ),
        (_request(trace_id=b"\x00" * 16), "application/x-protobuf", None, 400, "traceId must be 16 bytes"),
        (_request(start=20, end=10), "application/x-protobuf", None, 400, "ends before it starts"),
        (b"x" * (LIMIT + 1), "application/x-protobuf", None, 413, "Maximum request body size"),
        (gzip.compress(b"\0" * (4 * LIMIT)), "application/x-protobuf", "gzip", 413, "decompressed body exceeds"),
        (b"not gzip at all", "application/x-protobuf", "gzip", 400, "not valid gzip"),
        (_request(), "text/plain", None, 415, "unsupported content type"),
    ],
    ids=[
        "garbage-protobuf",
        "garbage-json",
        "json-bad-hex",
        "zero-trace-id",
        "end-before-start",
        "oversized",
        "gzip-bomb",
        "bad-gzip",
        "content-type",
    ],
)
def test_http_rejects_with_a_reason_and_keeps_serving(
    make_sidecar, tmp_path, body, content_type, encoding, status, reason
):
    sidecar = make_sidecar(grpc_port=None, max_body_bytes=LIMIT)
    headers = {"Content-Encoding": encoding} if encoding else {}
    code, text = _post(sidecar.http_port, body, content_type, **headers)
    assert code == status and reason in text, (code, text)
    assert http_get(f"http://127.0.0.1:{sidecar.http_port}/health") == (200, b"ok")
    assert _post(sidecar.http_port, _request(2))[0] == 200  # still ingesting and exporting
    assert {span.name for span in spans_when(tmp_path / "traces.jsonl", 2)} == {"s0", "s1"}


def test_grpc_rejects_malformed_and_oversized_requests(make_sidecar):
    sidecar = make_sidecar(http_port=None, max_body_bytes=LIMIT)
    with grpc.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as channel:
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)
        bad = trace_service_pb2.ExportTraceServiceRequest.FromString(_request(trace_id=b"\x01\x02"))
        with pytest.raises(grpc.RpcError) as error:
            stub.Export(bad, timeout=10)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "traceId" in error.value.details()
        huge = trace_service_pb2.ExportTraceServiceRequest.FromString(_request(2000))
        with pytest.raises(grpc.RpcError) as error:
            stub.Export(huge, timeout=10)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        ok = stub.Export(trace_service_pb2.ExportTraceServiceRequest.FromString(_request(1)), timeout=10)
        assert not ok.partial_success.rejected_spans


def test_a_token_guards_every_path_when_set(make_sidecar, tmp_path):
    sidecar = make_sidecar(unix_socket=str(tmp_path / "s.sock"), environ={TOKEN_ENV: "s3cret"})
    assert _post(sidecar.http_port, _request())[0] == 401
    assert _post(sidecar.http_port, _request(), Authorization="Bearer wrong")[0] == 401
    assert _post(sidecar.http_port, _request(), Authorization="Bearer s3cret")[0] == 200
    request = trace_service_pb2.ExportTraceServiceRequest.FromString(_request())
    assert_grpc_export_needs_token(sidecar.grpc_port, request, "s3cret")
    assert_unix_handshake_refused(tmp_path / "s.sock", "wrong")


def test_binding_beyond_loopback_needs_a_token(make_sidecar):
    with pytest.raises(ValueError, match=TOKEN_ENV):
        make_sidecar(host="0.0.0.0", environ={})
