"""Property-based fuzzing of the sidecar's OTLP receiver over real HTTP and gRPC (the sidecar process).

Bodies: valid export requests truncated or with bytes flipped, arbitrary bytes, length-delimited fields
declaring huge lengths, OTLP/JSON-shaped and arbitrary JSON, each maybe gzipped, under right and wrong
content types and encodings. Every answer is 200 (a decodable request), 400 (malformed), 413 (too large)
or 415 (content type or encoding), never 5xx; gRPC answers OK or a status, never a handler crash; and a
valid request after each batch is still ingested.
"""

from __future__ import annotations

import gzip
import json

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from tests.reference_server.server_harness import http, wait_for
from tests.security.processes import SidecarProcess
from tests.tracer.test_traces_fuzz import json_values, otlp_like
from tracer.otlp import iter_spans

FUZZ_CASES_HTTP = 300
FUZZ_CASES_GRPC = 200
EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
FUZZ_SETTINGS = {"deadline": None, "database": None, "suppress_health_check": [HealthCheck.too_slow]}


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


@st.composite
def export_requests(draw: st.DrawFn) -> bytes:
    """A well-formed ExportTraceServiceRequest protobuf with a few spans."""
    spans = [
        trace_pb2.Span(
            trace_id=draw(st.binary(min_size=16, max_size=16)),
            span_id=draw(st.binary(min_size=8, max_size=8)),
            name=draw(st.text(max_size=20)),
            start_time_unix_nano=draw(st.integers(0, 2**63)),
            end_time_unix_nano=draw(st.integers(0, 2**63)),
            kind=draw(st.integers(0, 5)),
        )
        for _ in range(draw(st.integers(0, 3)))
    ]
    request = trace_service_pb2.ExportTraceServiceRequest(
        resource_spans=[trace_pb2.ResourceSpans(scope_spans=[trace_pb2.ScopeSpans(spans=spans)])]
    )
    return request.SerializeToString()


@st.composite
def mutated(draw: st.DrawFn, base: st.SearchStrategy[bytes]) -> bytes:
    body = bytearray(draw(base))
    how = draw(st.sampled_from(["truncate", "flip", "huge_length", "as_is"]))
    if how == "truncate" and body:
        return bytes(body[: draw(st.integers(0, len(body) - 1))])
    if how == "flip" and body:
        for _ in range(draw(st.integers(1, 4))):
            body[draw(st.integers(0, len(body) - 1))] ^= draw(st.integers(1, 255))
        return bytes(body)
    if how == "huge_length":
        # Field 1 (resource_spans), length-delimited, declaring far more bytes than follow.
        return b"\x0a" + _varint(draw(st.integers(2**20, 2**63))) + bytes(body[:16])
    return bytes(body)


protobuf_bodies = mutated(export_requests()) | st.binary(max_size=512)
json_bodies = (otlp_like | json_values).map(lambda v: json.dumps(v).encode()) | st.binary(max_size=256)
content_types = st.sampled_from(
    [
        "application/x-protobuf",
        "application/json",
        "text/plain",
        "",
        "application/grpc",
        "application/x-protobuf; charset=utf-8",
        "application/json; charset=utf-8",
    ]
)
encodings = st.sampled_from([None, "gzip", "deflate", "identity"])


def _valid_request(name: str) -> bytes:
    span = trace_pb2.Span(
        trace_id=b"\x07" * 16, span_id=b"\x08" * 8, name=name, start_time_unix_nano=1, end_time_unix_nano=2
    )
    return trace_service_pb2.ExportTraceServiceRequest(
        resource_spans=[trace_pb2.ResourceSpans(scope_spans=[trace_pb2.ScopeSpans(spans=[span])])]
    ).SerializeToString()


def _wait_exported(sidecar: SidecarProcess, name: str) -> None:
    def exported() -> bool:
        return sidecar.traces_file.exists() and any(
            s.name == name for s in iter_spans([sidecar.traces_file], skip_bad=True)
        )

    wait_for(exported, 30, f"span {name!r} in the sidecar's traces file")


def _still_ingests(sidecar: SidecarProcess, name: str) -> None:
    status, _, _ = http(
        "POST", sidecar.url + "/v1/traces", raw=_valid_request(name), headers={"Content-Type": "application/x-protobuf"}
    )
    assert status == 200
    _wait_exported(sidecar, name)


def test_otlp_http_answers_every_fuzzed_request_with_200_or_4xx(sidecar: SidecarProcess) -> None:
    """300 fuzzed requests (FUZZ_CASES_HTTP) over real HTTP, then a valid one still goes through."""
    statuses: list[int] = []

    @settings(max_examples=FUZZ_CASES_HTTP, **FUZZ_SETTINGS)
    @given(body=protobuf_bodies | json_bodies, content_type=content_types, encoding=encodings, compress=st.booleans())
    def case(body: bytes, content_type: str, encoding: str | None, compress: bool) -> None:
        headers = {"Content-Type": content_type}
        if encoding is not None:
            headers["Content-Encoding"] = encoding
            if encoding == "gzip" and compress:
                body = gzip.compress(body)
        status, answer, _ = http("POST", sidecar.url + "/v1/traces", raw=body, headers=headers, timeout_s=30)
        assert status in (200, 400, 413, 415), (status, answer[:300])
        if status != 200:
            assert answer.strip(), "a refusal must say why"
        statuses.append(status)

    case()
    assert len(statuses) >= FUZZ_CASES_HTTP
    assert {200, 400, 415} <= set(statuses)  # the fuzzing reached the decoders, not only the front door
    assert sidecar.healthy()
    _still_ingests(sidecar, "after-http-fuzz")


def test_otlp_grpc_answers_every_fuzzed_message_with_a_status(sidecar: SidecarProcess) -> None:
    """200 fuzzed messages (FUZZ_CASES_GRPC) over gRPC, then a valid one still goes through."""
    codes: list[grpc.StatusCode] = []
    with grpc.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as channel:
        export = channel.unary_unary(EXPORT_METHOD)  # raw bytes in, raw bytes out

        @settings(max_examples=FUZZ_CASES_GRPC, **FUZZ_SETTINGS)
        @given(body=protobuf_bodies)
        def case(body: bytes) -> None:
            try:
                answer = export(body, timeout=30)
            except grpc.RpcError as error:
                # INTERNAL is grpc's own answer to bytes it cannot deserialize; a crash in our handler
                # would be UNKNOWN ("Exception calling application").
                ok = error.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED) or (
                    error.code() == grpc.StatusCode.INTERNAL and "deserializing" in error.details()
                )
                assert ok, (error.code(), error.details())
                codes.append(error.code())
                return
            trace_service_pb2.ExportTraceServiceResponse.FromString(answer)
            codes.append(grpc.StatusCode.OK)

        case()
        assert len(codes) >= FUZZ_CASES_GRPC
        assert {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT} <= set(codes)
        export(_valid_request("after-grpc-fuzz"), timeout=30)
    _wait_exported(sidecar, "after-grpc-fuzz")
    assert sidecar.healthy()
