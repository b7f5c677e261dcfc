"""Wires one process's tracing: clock, ring, pipeline thread, and where the spans go.

Two paths (tracer.export.otel documents the OTEL_* variables the first one follows):
- local: the OpenTelemetry SDK in this process exports the spans (OTLP from the environment, an
  OTLP/JSON `traces_file`) and a Prometheus catalogue keeps the span-derived metrics;
- sidecar (`sidecar_socket`): resolved spans go over a Unix socket to `splitscope sidecar`, which exports
  and meters them. This path imports neither the OpenTelemetry SDK nor prometheus_client nor numpy; pass
  `registry` or `catalogue` to keep the metrics no span carries (the engine's gauges, the tracer's drops and
  pending records): they are served by this process and also shipped to the sidecar as snapshots after
  each pipeline drain that changed them, so the sidecar alone can answer for the whole process.

Every record the tracer loses is counted by reason in `TracingSession.dropped_records` and, with a
catalogue, in `splitscope_tracer_dropped_records_total{reason}`.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tracer.api import NoopTracer, RecordingTracer, Tracer
from tracer.pipeline import Pipeline, Sink, SpanBuilder
from tracer.records import RecordRing
from tracer.resource import default_service_name, resource_attributes
from tracer.slo_outcome import RequestSlo
from tracer.timing import default_clock
from tracer.vocabulary import ATTR_WORKER, DropReason

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor
    from prometheus_client import CollectorRegistry

    from tracer.metrics import Catalogue


class DropCounts:
    """Records lost by the tracer, by reason. `add` may be called from any thread; it never blocks for long.

    `on_add(reason, n)`, when set, is called after each addition (the catalogue's counter)."""

    def __init__(self, on_add: Callable[[str, int], None] | None = None) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._on_add = on_add

    def add(self, reason: str, count: int) -> None:
        with self._lock:
            self._counts[reason] += count
        if self._on_add is not None:
            self._on_add(reason, count)

    def by_reason(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


@dataclass
class TracingSession:
    """Everything one process's tracing owns. `tracer` is what the engine calls."""

    tracer: Tracer
    pipeline: Pipeline | None
    catalogue: Catalogue | None
    registry: CollectorRegistry | None
    dropped_records: DropCounts = field(default_factory=DropCounts)

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
    slo: RequestSlo | None = None,
    ring_capacity: int = 65536,
    sink: Sink | None = None,
    sidecar_socket: str | None = None,
    processors: list[SpanProcessor] | None = None,
    interval_s: float = 0.1,
    enabled: bool = True,
) -> TracingSession:
    """Start tracing for one worker (`pool`, `worker`) or the router (both None). Call once per process.

    The resource's `service.name` is `service_name`, else `splitscope-{pool}` (`splitscope-router`), and
    OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES override it on both paths. `sidecar_socket` ships
    resolved spans to a sidecar over that Unix socket; `sink` replaces export altogether; `processors`
    replaces the exporters from the environment (tests use an in-memory exporter). `step_sample_every`:
    1 in N decode-only step spans exported (tracer.step_sampling). `slo` (the router's) marks each root
    span with the request's outcome against it. Metrics go to
    `catalogue` (built on `registry` when not given; on the local path one is always built). With
    `enabled=False` the session holds a NoopTracer and starts no thread.
    """
    if not enabled:
        return TracingSession(NoopTracer(), None, catalogue, registry)
    local = sink is None and not sidecar_socket
    if catalogue is None and (registry is not None or local):
        from prometheus_client import CollectorRegistry

        from tracer.metrics import Catalogue

        catalogue = Catalogue(registry if registry is not None else CollectorRegistry())
    registry = catalogue.registry if catalogue is not None else registry
    counter = catalogue.tracer_dropped if catalogue is not None else None
    dropped = DropCounts(None if counter is None else lambda reason, n: counter.labels(reason=reason).inc(n))
    # A worker names itself in its resource too: a sidecar keeps each worker's series apart by it.
    resource = resource_attributes(
        service_name or default_service_name(pool), {ATTR_WORKER: worker} if worker else None
    )
    after_drain = None
    if sink is None and sidecar_socket:
        from tracer.sidecar.client import MetricsShipper, SidecarSink

        sink = SidecarSink(
            sidecar_socket, on_drop=lambda n: dropped.add(DropReason.SIDECAR_UNREACHABLE, n), resource=resource
        )
        if catalogue is not None:  # what no span carries (queue depth, KV cache use) goes as snapshots
            after_drain = MetricsShipper(sink, catalogue.process_set()).ship
    if sink is None:
        sink = _local_sink(resource, catalogue, traces_file, processors, dropped)
    clock = default_clock(device)
    ring = RecordRing(ring_capacity)
    pipeline = Pipeline(
        ring,
        SpanBuilder(clock, pool, worker, step_sample_every, slo=slo),
        sink,
        interval_s=interval_s,
        on_drop=dropped.add,
        pending_gauge=catalogue.tracer_pending if catalogue is not None else None,
        after_drain=after_drain,
    ).start()
    return TracingSession(RecordingTracer(clock, ring), pipeline, catalogue, registry, dropped)


def _local_sink(
    resource: dict[str, Any],
    catalogue: Catalogue | None,
    traces_file: str | None,
    processors: list[SpanProcessor] | None,
    dropped: DropCounts,
) -> Sink:
    """The in-process SDK export and metrics (imported here: the sidecar path never loads them)."""
    from opentelemetry.sdk.resources import Resource

    from tracer.export.local_sink import LocalSink, MetricsRecorder
    from tracer.export.otel import span_processors

    if processors is None:
        processors = span_processors(
            traces_file,
            on_drop=lambda n: dropped.add(DropReason.EXPORT_QUEUE_FULL, n),
            on_export_failed=lambda n: dropped.add(DropReason.EXPORT_FAILED, n),
        )
    metrics = MetricsRecorder(catalogue) if catalogue is not None else None
    return LocalSink(Resource.create(resource), processors, metrics)
