"""OTLP/gRPC receiver: the generated TraceServiceServicer over grpcio.

`max_receive_message_length` bounds a request (grpc answers RESOURCE_EXHAUSTED past it); a malformed
request gets INVALID_ARGUMENT with the reason, a missing or wrong bearer token UNAUTHENTICATED. When the
ingest queue is full the answer is OK with `partial_success.rejected_spans` (OTLP: do not retry). Runs on
grpc's thread pool; never waits on export.
"""

from __future__ import annotations

from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tracer.auth import bearer_ok
from tracer.sidecar.ingest_queue import IngestQueue
from tracer.sidecar.otlp_decode import OtlpDecodeError, batches_from_request


class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, queue: IngestQueue, token: str = "") -> None:
        self.queue = queue
        self.token = token

    def Export(self, request, context):  # noqa: N802 (the generated interface's name)
        if self.token:
            metadata = dict(context.invocation_metadata())
            if not bearer_ok(self.token, metadata.get("authorization")):
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        try:
            batches = batches_from_request(request)
        except OtlpDecodeError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        rejected = sum(len(b.spans) for b in batches if not self.queue.offer(b))
        response = trace_service_pb2.ExportTraceServiceResponse()
        if rejected:
            response.partial_success.rejected_spans = rejected
            response.partial_success.error_message = "sidecar ingest queue full"
        return response


def start_grpc_server(
    queue: IngestQueue, host: str, port: int, *, token: str = "", max_message_bytes: int = 4 * 1024 * 1024
) -> tuple[grpc.Server, int]:
    """Start serving; returns (server, bound port). Raises RuntimeError when the port cannot be bound."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="splitscope-sidecar-grpc"),
        options=[("grpc.max_receive_message_length", max_message_bytes), ("grpc.so_reuseport", 0)],
    )
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(queue, token), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise RuntimeError(f"cannot listen for OTLP/gRPC on {address}: {exc}") from None
    if bound == 0:
        raise RuntimeError(f"cannot listen for OTLP/gRPC on {address}")
    server.start()
    return server, bound
