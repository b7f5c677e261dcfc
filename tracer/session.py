"""Wires one process's tracing: clock, ring, pipeline thread, exporters and metrics.

Exporters follow the OpenTelemetry environment: `OTEL_EXPORTER_OTLP_ENDPOINT` (or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) turns on OTLP export, over gRPC when
`OTEL_EXPORTER_OTLP_PROTOCOL` (or `..._TRACES_PROTOCOL`) is `grpc`, else HTTP/protobuf (the spec's
default). `traces_file` adds an OTLP/JSON file. `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES` shape
the resource. Each exporter sits behind its own BatchSpanProcessor (a bounded queue that drops when full),
so a dead collector costs spans, never serving time.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from prometheus_client import CollectorRegistry

from tracer.api import NoopTracer, Tracer
from tracer.metrics import Catalogue
from tracer.pipeline import LocalSink, MetricsRecorder, Pipeline, Sink, Summariser
from tracer.records import RecordRing
from tracer.timing import default_clock
from tracer.traces import OtlpJsonFileExporter

log = logging.getLogger(__name__)


def otlp_exporter_from_env(environ: dict[str, str] | None = None) -> SpanExporter | None:
    """The OTLP span exporter the OTEL_* variables ask for, or None when no endpoint is set."""
    env = os.environ if environ is None else environ
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint:
        return None
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()  # reads endpoint, headers, timeout, insecure from the environment
    if protocol in ("http/protobuf", "http/json"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter()  # appends /v1/traces to a generic endpoint itself
    raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not one of grpc, http/protobuf")


def span_processors(traces_file: str | None, environ: dict[str, str] | None = None) -> list[SpanProcessor]:
    exporters: list[SpanExporter] = []
    otlp = otlp_exporter_from_env(environ)
    if otlp is not None:
        exporters.append(otlp)
    if traces_file:
        exporters.append(OtlpJsonFileExporter(traces_file))
    # Large batches keep per-span export cost low; the queue bound keeps memory bounded when export stalls.
    return [
        BatchSpanProcessor(e, max_queue_size=8192, max_export_batch_size=512, schedule_delay_millis=500)
        for e in exporters
    ]


def make_resource(service_name: str | None = None, attributes: dict[str, Any] | None = None) -> Resource:
    """Our defaults, overridden by OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES where set."""
    defaults = {
        "service.name": service_name or "splitscope",
        "service.instance.id": f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}",
        "host.name": socket.gethostname(),
        **(attributes or {}),
    }
    return Resource.create(defaults).merge(OTELResourceDetector().detect())


@dataclass
class TracingSession:
    """Everything one process's tracing owns. `tracer` is what the engine calls."""

    tracer: Tracer | NoopTracer
    pipeline: Pipeline | None
    catalogue: Catalogue | None
    registry: CollectorRegistry | None

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Emit and flush what is left. Blocks up to about `timeout_s`."""
        if self.pipeline is not None:
            self.pipeline.shutdown(timeout_s)


def start_tracing(
    pool: str | None,
    worker: str | None,
    *,
    traces_file: str | None = None,
    registry: CollectorRegistry | None = None,
    catalogue: Catalogue | None = None,
    device: str = "cpu",
    service_name: str | None = None,
    step_sample_every: int = 1,
    ring_capacity: int = 65536,
    sink: Sink | None = None,
    sidecar_socket: str | None = None,
    processors: list[SpanProcessor] | None = None,
    interval_s: float = 0.1,
    enabled: bool = True,
) -> TracingSession:
    """Start tracing for one worker (`pool`, `worker`) or the router (both None).

    Metrics go to `catalogue` (built on `registry` when not given). `sink` replaces local export (the
    sidecar client); `processors` replaces the exporters from the environment (tests use an in-memory
    exporter). `sidecar_socket` ships resolved spans to a sidecar over that Unix socket instead of
    exporting here (the sidecar then exports and keeps the span-derived metrics). With `enabled=False` the session holds a NoopTracer and starts no thread.
    """
    if not enabled:
        return TracingSession(NoopTracer(), None, catalogue, registry)
    registry = registry if registry is not None else (catalogue.registry if catalogue else CollectorRegistry())
    catalogue = catalogue or Catalogue(registry)
    clock = default_clock(device)
    ring = RecordRing(ring_capacity)
    if sink is None and sidecar_socket:
        from tracer.sidecar.client import SidecarSink

        sink = SidecarSink(sidecar_socket, on_drop=lambda n: catalogue.tracer_dropped.labels(reason="sidecar_unreachable").inc(n))
    if sink is None:
        resource = make_resource(service_name or (f"splitscope-{pool}" if pool else "splitscope-router"))
        procs = processors if processors is not None else span_processors(traces_file)
        sink = LocalSink(resource, procs, MetricsRecorder(catalogue))
    dropped = catalogue.tracer_dropped
    pipeline = Pipeline(
        ring,
        Summariser(clock, pool, worker, step_sample_every),
        sink,
        interval_s=interval_s,
        on_drop=lambda reason, n: dropped.labels(reason=reason).inc(n),
        pending_gauge=catalogue.tracer_pending,
    ).start()
    return TracingSession(Tracer(clock, ring), pipeline, catalogue, registry)
