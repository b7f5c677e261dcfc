"""Sidecar test helpers: a running sidecar on free ports, waiting on conditions with deadlines."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.conftest import wait_for
from tracer.otlp import Span, iter_spans
from tracer.sidecar.client import SidecarSink
from tracer.sidecar.server import Sidecar, SidecarConfig
from tracer.spans import SpanData

FIXTURES = Path(__file__).parent / "fixtures"
OVERLAP_HOLD_S = 0.05


def read_spans(path: Path) -> list[Span]:
    # skip_bad: a line being appended right now may be read half-written; the caller waits for more.
    return list(iter_spans([path], skip_bad=True)) if path.exists() else []


def spans_when(path: Path, count: int, timeout_s: float = 10.0) -> list[Span]:
    """The spans of `path` once it holds at least `count` of them."""

    def enough() -> list[Span] | None:
        spans = read_spans(path)
        return spans if len(spans) >= count else None

    return wait_for(enough, timeout_s, f"{count} spans in {path.name}")


def http_get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status, response.read()


def assert_grpc_export_needs_token(port: int, request: trace_service_pb2.ExportTraceServiceRequest, token: str) -> None:
    """An OTLP/gRPC export without credentials is UNAUTHENTICATED; with `Bearer <token>` it is accepted."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Export(request, timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stub.Export(request, metadata=[("authorization", f"Bearer {token}")], timeout=10)


def assert_unix_handshake_refused(socket_path: Path, token: str) -> None:
    """A SidecarSink presenting `token` (wrong or empty) is refused at the handshake and stays unconnected."""
    sink = SidecarSink(socket_path, token=token, resource={"service.name": "w"})
    try:
        sink.emit([SpanData("splitscope.step", 1, 1, 1, 0, 0, 1, {})])
        wait_for(lambda: "bad token" in sink.last_error, 10, "the Unix handshake refusal")
        assert not sink.connected
    finally:
        sink.shutdown(0.5)


@pytest.fixture
def make_sidecar(tmp_path):
    """Start sidecars on OS-chosen ports with a traces file in tmp_path; all stopped at teardown."""
    started: list[Sidecar] = []

    def start(**overrides) -> Sidecar:
        settings = dict(http_port=0, grpc_port=0, traces_file=str(tmp_path / "traces.jsonl"), gpu=False, environ={})
        # An engine's decode span leaves once the prefills that could overlap it are in (the overlap hold,
        # tracer/sidecar/overlap.py): these tests send all their spans at once, so a short hold is enough.
        settings["overlap_hold_s"] = OVERLAP_HOLD_S
        settings.update(overrides)
        sidecar = Sidecar(SidecarConfig(**settings)).start()
        started.append(sidecar)
        return sidecar

    yield start
    for sidecar in started:
        sidecar.stop(2.0)
