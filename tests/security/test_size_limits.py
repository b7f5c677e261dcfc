"""Size limits on every listener: the router's body and headers, the workers' internal API bodies, the KV
header, the sidecar's OTLP body (plain and gzip), the gRPC message and the Unix-ingest handshake and frame.

Each oversize input gets one clear refusal (413 / 400 / an error frame / RESOURCE_EXHAUSTED / a closed
connection), and the listener keeps serving afterwards.
"""

from __future__ import annotations

import gzip
import re
import socket
import struct
from http.client import HTTPConnection

import grpc

from reference_server.kv_transfer.wire import MAGIC, MAX_HEADER_BYTES, read_frame
from reference_server.serving.router import DEFAULT_MAX_BODY_BYTES as ROUTER_MAX_BODY_BYTES
from reference_server.serving.worker import MAX_BODY_BYTES as WORKER_MAX_BODY_BYTES
from tests.reference_server.server_harness import Server, http
from tests.security.processes import (
    SIDECAR_MAX_BODY_BYTES,
    ServedWorker,
    SidecarProcess,
)
from tracer.sidecar import wire

TIMEOUT_S = 30.0


def _post_streamed(
    port: int,
    path: str,
    body_bytes: int,
    *,
    declared_bytes: int | None = None,
    chunked: bool = False,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    """POST `body_bytes` of filler, declaring `declared_bytes` (default: the real size) or chunked.
    The server may answer and close before it has read it all: that is a refusal, not a client error."""
    connection = HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        connection.putrequest("POST", path)
        for name, value in {"Content-Type": "application/json", **(headers or {})}.items():
            connection.putheader(name, value)
        if chunked:
            connection.putheader("Transfer-Encoding", "chunked")
        else:
            connection.putheader("Content-Length", str(body_bytes if declared_bytes is None else declared_bytes))
        connection.endheaders()
        piece = b" " * 65536
        try:
            for sent in range(0, body_bytes, len(piece)):
                data = piece[: min(len(piece), body_bytes - sent)]
                connection.send(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
            if chunked:
                connection.send(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered early
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_router_refuses_oversized_bodies_declared_or_streamed(server: Server) -> None:
    port = server.port
    declared = _post_streamed(port, "/v1/completions", 1024, declared_bytes=ROUTER_MAX_BODY_BYTES + 1)
    assert declared[0] == 413 and b"body_too_large" in declared[1], declared
    streamed = _post_streamed(port, "/v1/completions", ROUTER_MAX_BODY_BYTES + 65536, chunked=True)
    assert streamed[0] == 413, streamed
    assert server.complete({"prompt": "after the big ones", "max_tokens": 2})[0] == 200


def test_router_refuses_oversized_headers_and_request_lines(server: Server) -> None:
    for request in (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 65536 + b"\r\n\r\n",
        b"GET /" + b"a" * 65536 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(1000)) + b"\r\n",
    ):
        with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT_S) as sock:
            sock.sendall(request)
            status_line = sock.makefile("rb").readline()
        assert re.match(rb"HTTP/1\.[01] 4\d\d ", status_line), status_line
    assert server.health()["status"] == "ok"


def test_worker_internal_api_refuses_oversized_bodies(workers: dict[str, ServedWorker]) -> None:
    for worker, path in ((workers["prefill"], "/prefill"), (workers["decode"], "/generate")):
        port = int(worker.url.rsplit(":", 1)[1])
        status, body = _post_streamed(port, path, WORKER_MAX_BODY_BYTES + 65536)
        assert status == 413, (worker.pool, status, body[:200])
        assert http("GET", worker.url + "/health")[0] == 200


def test_kv_receiver_refuses_an_oversized_header_before_buffering_it(workers: dict[str, ServedWorker]) -> None:
    address = workers["decode"].kv_address
    assert address is not None
    with socket.create_connection(address, timeout=TIMEOUT_S) as sock:
        sock.sendall(MAGIC + struct.pack("!I", MAX_HEADER_BYTES + 1))  # and no body: nothing was buffered
        reply = read_frame(sock)
    assert reply["type"] == "error" and reply["reason"] == "bad_header" and "limit" in reply["detail"], reply


def test_sidecar_refuses_oversized_otlp_bodies(sidecar: SidecarProcess) -> None:
    protobuf = {"Content-Type": "application/x-protobuf"}
    plain = _post_streamed(sidecar.http_port, "/v1/traces", SIDECAR_MAX_BODY_BYTES + 1, headers=protobuf)
    assert plain[0] == 413, plain
    bomb = gzip.compress(b"\0" * (SIDECAR_MAX_BODY_BYTES * 64))  # small on the wire, 64x the limit inflated
    status, body, _ = http(
        "POST", sidecar.url + "/v1/traces", raw=bomb, headers={**protobuf, "Content-Encoding": "gzip"}
    )
    assert status == 413 and b"decompressed body exceeds" in body, (status, body)
    assert sidecar.healthy()


def test_grpc_refuses_a_message_over_its_limit(sidecar: SidecarProcess) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as channel:
        export = channel.unary_unary("/opentelemetry.proto.collector.trace.v1.TraceService/Export")  # raw bytes
        try:
            export(b"\0" * (SIDECAR_MAX_BODY_BYTES + 1), timeout=TIMEOUT_S)
            raise AssertionError("an oversized gRPC message was accepted")
        except grpc.RpcError as refused:
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused
        assert export(b"", timeout=TIMEOUT_S) == b""  # an empty ExportTraceServiceRequest still succeeds


def _bad_frames(sidecar: SidecarProcess) -> float:
    _, body, _ = http("GET", f"http://127.0.0.1:{sidecar.metrics_port}/metrics")
    found = re.search(rb'splitscope_tracer_dropped_records_total\{reason="sidecar_bad_frame"\} (\S+)', body)
    return float(found[1]) if found else 0.0


def test_unix_ingest_refuses_oversized_handshakes_and_frames(sidecar: SidecarProcess) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(TIMEOUT_S)
        sock.connect(str(sidecar.socket_path))
        sock.sendall(b"{" + b" " * wire.HANDSHAKE_MAX_BYTES + b"}\n")  # a line longer than the limit
        assert wire.decode_answer(sock.makefile("rb").readline()) is not None
    before = _bad_frames(sidecar)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(TIMEOUT_S)
        sock.connect(str(sidecar.socket_path))
        sock.sendall(wire.encode_handshake("", {"service.name": "big"}))
        reader = sock.makefile("rb")
        assert wire.decode_answer(reader.readline()) is None
        sock.sendall(wire.FRAME_HEADER.pack(wire.MAX_FRAME_BYTES + 1))  # declared only: never buffered
        assert reader.read(1) == b""  # closed
    assert _bad_frames(sidecar) == before + 1
    assert sidecar.healthy()
