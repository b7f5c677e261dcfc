"""OTLP/HTTP receiver (POST /v1/traces) and the sidecar's /metrics and /health, on one aiohttp app.

POST /v1/traces accepts `application/x-protobuf` and `application/json` (OTLP/JSON, hex ids), optionally
`Content-Encoding: gzip`, and answers an ExportTraceServiceResponse in the request's encoding:
- 200, with `partialSuccess.rejectedSpans` when the ingest queue was full (OTLP: do not retry those);
- 400 with the reason for a malformed body, 413 for a body over `max_body_bytes` (before or after
  decompression; gzip is inflated in bounded steps, so a gzip bomb costs at most that much memory),
  415 for another content type, 401 without the bearer token when one is required.
Handlers run on the event loop thread and never wait on export; /metrics renders on a worker thread
because collecting may scrape an engine (scrape.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from prometheus_client import CollectorRegistry

from tracer.auth import bearer_ok
from tracer.export.exposition import Exposition
from tracer.otlp.http_body import (
    DEFAULT_MAX_BODY_BYTES,
    JSON,
    PROTOBUF,
    BodyTooLarge,
    UnsupportedMedia,
    check_content_type,
    export_body,
)
from tracer.sidecar.ingest_queue import IngestQueue
from tracer.sidecar.otlp_decode import OtlpDecodeError, decode_json, decode_protobuf


def make_app(
    queue: IngestQueue,
    registry: CollectorRegistry,
    *,
    token: str = "",
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    on_request: Callable[[int, int], None] | None = None,
) -> web.Application:
    """`on_request(accepted_spans, rejected_spans)` is called after each decoded export (tests, benches)."""

    async def traces(request: web.Request) -> web.Response:
        if not bearer_ok(token, request.headers.get("Authorization")):
            return web.Response(status=401, text="missing or wrong bearer token")
        content_type = request.content_type
        try:
            check_content_type(content_type)
        except UnsupportedMedia as exc:
            return web.Response(status=415, text=str(exc))
        body = await request.read()  # aiohttp answers 413 itself past client_max_size
        try:
            body = export_body(content_type, request.headers.get("Content-Encoding", ""), body, max_body_bytes)
            batches = decode_protobuf(body) if content_type == PROTOBUF else decode_json(body)
        except UnsupportedMedia as exc:
            return web.Response(status=415, text=str(exc))
        except BodyTooLarge as exc:
            return web.Response(status=413, text=str(exc))
        except (OtlpDecodeError, ValueError) as exc:
            return web.Response(status=400, text=str(exc))
        accepted = rejected = 0
        for batch in batches:
            if queue.offer(batch):
                accepted += len(batch.spans)
            else:
                rejected += len(batch.spans)
        if on_request is not None:
            on_request(accepted, rejected)
        return _export_answer(content_type, rejected, "sidecar ingest queue full" if rejected else "")

    metrics_exposition = Exposition(registry)

    async def metrics(request: web.Request) -> web.Response:
        body, content_type = await asyncio.to_thread(metrics_exposition.render, request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=max_body_bytes)
    app.router.add_post("/v1/traces", traces)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    return app


def _export_answer(content_type: str, rejected: int, message: str = "", status: int = 200) -> web.Response:
    """An OTLP ExportTraceServiceResponse in the request's encoding; partial_success only when something was
    rejected or there is a message."""
    response = ExportTraceServiceResponse()
    if rejected or message:
        response.partial_success.rejected_spans = rejected
        response.partial_success.error_message = message
    if content_type == JSON:
        body = (
            "{}"
            if not (rejected or message)
            else ('{"partialSuccess":{"rejectedSpans":"%d","errorMessage":%s}}' % (rejected, _json_str(message)))
        )
        return web.Response(status=status, text=body, content_type=JSON)
    return web.Response(status=status, body=response.SerializeToString(), content_type=PROTOBUF)


def _json_str(text: str) -> str:
    import json

    return json.dumps(text)
