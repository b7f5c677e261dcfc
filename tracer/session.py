"""Wires one process's tracing: clock, ring, pipeline thread, exporters and metrics.

Exporters follow the OpenTelemetry environment: `OTEL_EXPORTER_OTLP_ENDPOINT` (or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) turns on OTLP export, over gRPC when
`OTEL_EXPORTER_OTLP_PROTOCOL` (or `..._TRACES_PROTOCOL`) is `grpc`, else HTTP/protobuf (the spec's
default). `traces_file` adds an OTLP/JSON file. `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES` shape
the resource. Each exporter sits behind its own BatchSpanProcessor (a bounded queue that drops when full),
so a dead collector costs spans, never serving time; each such drop is counted as
`splitscope_tracer_dropped_records_total{reason="export_queue_full"}`. The queue follows the standard
`OTEL_BSP_MAX_QUEUE_SIZE`, `OTEL_BSP_MAX_EXPORT_BATCH_SIZE` and `OTEL_BSP_SCHEDULE_DELAY` where set.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
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


class CountingBatchSpanProcessor(BatchSpanProcessor):
    """A BatchSpanProcessor whose drops are counted and whose flush and shutdown keep their time limits.

    The SDK's processor drops its oldest span when the queue is full (a dead or slow collector) and says
    so only through its own optional OpenTelemetry metrics, which our Prometheus exposition does not
    carry. `on_drop(1)` is called for each span that push displaces, on the thread that ends the span
    (the pipeline thread); it must not block.

    The SDK's `force_flush` ignores its timeout (opentelemetry-python#4568): with a dead collector it
    retried every queued batch in turn, minutes of a stopping worker. Here it returns False at the
    deadline and the export goes on in the background until `shutdown`, which waits at most
    `shutdown_timeout_millis` (callers flush first, so it only waits for what came after the flush).
    """

    def __init__(self, exporter: SpanExporter, *, on_drop: Callable[[int], None] | None = None,
                 shutdown_timeout_millis: int = 1000, **settings: Any) -> None:  # fmt: skip
        super().__init__(exporter, **settings)
        self._shutdown_timeout_millis = shutdown_timeout_millis
        # The SDK's own queue (1.45: a deque with maxlen), read for its length only. tests/faults checks
        # that drops are counted with the pinned SDK; if a later SDK hides the queue, nothing is counted.
        queue = getattr(self._batch_processor, "_queue", None)
        self._queue = queue if getattr(queue, "maxlen", None) else None
        self._on_drop = on_drop

    def on_end(self, span: ReadableSpan) -> None:
        queue = self._queue
        full = queue is not None and len(queue) >= queue.maxlen
        if full and self._on_drop is not None and span.context is not None and span.context.trace_flags.sampled:
            self._on_drop(1)
        super().on_end(span)

    def force_flush(self, timeout_millis: int | None = None) -> bool:
        """Export what is queued; blocks up to `timeout_millis` (default 30 s). False if not done by then."""
        done = threading.Event()

        def flush() -> None:
            BatchSpanProcessor.force_flush(self)
            done.set()

        threading.Thread(target=flush, name="splitscope-span-flush", daemon=True).start()
        return done.wait((30_000 if timeout_millis is None else timeout_millis) / 1000)

    def shutdown(self) -> None:
        """Stop the export thread: blocks up to `shutdown_timeout_millis`, then abandons what is left."""
        self._batch_processor.shutdown(self._shutdown_timeout_millis)


def _env_count(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name, "").strip()
    if not value:
        return default
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return int(value)


def span_processors(traces_file: str | None, environ: Mapping[str, str] | None = None,
                    on_drop: Callable[[int], None] | None = None) -> list[SpanProcessor]:  # fmt: skip
    """One batching processor per exporter (OTLP from the environment, the traces file). `on_drop(n)`
    counts spans a full export queue displaced. Raises ValueError on a malformed OTEL_BSP_* value."""
    env = os.environ if environ is None else environ
    exporters: list[SpanExporter] = []
    otlp = otlp_exporter_from_env(environ)
    if otlp is not None:
        exporters.append(otlp)
    if traces_file:
        exporters.append(OtlpJsonFileExporter(traces_file))
    # Large batches keep per-span export cost low; the queue bound keeps memory bounded when export stalls.
    max_queue_size = _env_count(env, "OTEL_BSP_MAX_QUEUE_SIZE", 8192)
    settings = {
        "max_queue_size": max_queue_size,
        "max_export_batch_size": min(_env_count(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512), max_queue_size),
        "schedule_delay_millis": _env_count(env, "OTEL_BSP_SCHEDULE_DELAY", 500),
    }
    return [CountingBatchSpanProcessor(e, on_drop=on_drop, **settings) for e in exporters]


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
        export_dropped = catalogue.tracer_dropped.labels(reason="export_queue_full")
        procs = processors if processors is not None else span_processors(traces_file, on_drop=export_dropped.inc)
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
