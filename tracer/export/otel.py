"""The OpenTelemetry SDK side of the tracer: SpanData -> ReadableSpan, exporters, the resource.

Exporters follow the OpenTelemetry environment: `OTEL_EXPORTER_OTLP_ENDPOINT` (or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) turns on OTLP export, over gRPC when
`OTEL_EXPORTER_OTLP_PROTOCOL` (or `..._TRACES_PROTOCOL`) is `grpc`, else HTTP/protobuf (the spec's
default). A traces file adds an OTLP/JSON file. Each exporter sits behind its own BatchSpanProcessor (a
bounded queue that drops when full), so a dead collector costs spans, never serving time; each such drop
is counted through `on_drop`. The queue follows the standard `OTEL_BSP_MAX_QUEUE_SIZE`,
`OTEL_BSP_MAX_EXPORT_BATCH_SIZE` and `OTEL_BSP_SCHEDULE_DELAY` where set.

Imported only where spans are exported by this process (LocalSink, the sidecar), never on an engine's
sidecar path, which runs no SDK at all.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from tracer.otlp.encode import encode_sdk_line
from tracer.otlp.files import append_line
from tracer.resource import resource_attributes
from tracer.spans import SpanData
from tracer.vocabulary import (
    ATTR_ERROR_TYPE,
    KIND_CLIENT,
    KIND_CONSUMER,
    KIND_INTERNAL,
    KIND_PRODUCER,
    KIND_SERVER,
)

_SPAN_KINDS = {
    KIND_INTERNAL: SpanKind.INTERNAL,
    KIND_SERVER: SpanKind.SERVER,
    KIND_CLIENT: SpanKind.CLIENT,
    KIND_PRODUCER: SpanKind.PRODUCER,
    KIND_CONSUMER: SpanKind.CONSUMER,
}

_SCOPE = InstrumentationScope("splitscope.tracer", "0.1.0")
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


def to_readable_span(data: SpanData, resource: Resource) -> ReadableSpan:
    """The SDK span for `data`, ready for a SpanProcessor's `on_end`."""
    context = SpanContext(data.trace_id, data.span_id, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    parent = (
        SpanContext(data.trace_id, data.parent_span_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
        if data.parent_span_id
        else None
    )
    attributes = dict(data.attributes)
    if data.error_type:
        attributes[ATTR_ERROR_TYPE] = data.error_type
        status = Status(StatusCode.ERROR, data.error_type)
    else:
        status = Status(StatusCode.UNSET)
    return ReadableSpan(
        name=data.name,
        context=context,
        parent=parent,
        resource=resource,
        attributes=attributes,
        events=[Event(name, attrs, timestamp=t) for name, t, attrs in data.events],
        links=[
            Link(SpanContext(trace_id, span_id, is_remote=False, trace_flags=_SAMPLED), attrs)
            for trace_id, span_id, attrs in data.links
        ],
        kind=_SPAN_KINDS.get(data.kind, SpanKind.INTERNAL),
        status=status,
        start_time=data.start_ns,
        end_time=data.end_ns,
        instrumentation_scope=_SCOPE,
    )


def otlp_exporter_from_env(environ: Mapping[str, str] | None = None) -> SpanExporter | None:
    """The OTLP span exporter the OTEL_* variables ask for, or None when no endpoint is set."""
    env = os.environ if environ is None else environ
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint:
        return None
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"
    )
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()  # reads endpoint, headers, timeout, insecure from the environment
    if protocol in ("http/protobuf", "http/json"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter()  # appends /v1/traces to a generic endpoint itself
    raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not one of grpc, http/protobuf")


class _Dequeued(SpanExporter):
    """The exporter a CountingBatchSpanProcessor hands to the SDK: tells the processor how many spans left
    its queue (`on_dequeued(n)`, on the SDK's export thread, as it submits a batch), then exports them."""

    def __init__(self, exporter: SpanExporter, on_dequeued: Callable[[int], None]) -> None:
        self.exporter = exporter
        self._on_dequeued = on_dequeued

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self._on_dequeued(len(spans))
        return self.exporter.export(spans)

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self.exporter.force_flush(timeout_millis)


class CountingBatchSpanProcessor(BatchSpanProcessor):
    """A BatchSpanProcessor whose drops are counted and whose flush and shutdown keep their time limits.

    The SDK's processor drops its oldest span when the queue is full (a dead or slow collector) and says
    so only through its own optional OpenTelemetry metrics, which our Prometheus exposition does not
    carry. `on_drop(1)` is called for each span that push displaces, on the thread that ends the span
    (the pipeline thread); it must not block. The queue's length is counted here, not read from the SDK:
    sampled spans in through `on_end`, out as the SDK submits each batch to the exporter (it pops a batch
    and exports it in one step, so the count runs ahead of the SDK's deque only while a batch is popped).

    The SDK's `force_flush` ignores its timeout (opentelemetry-python#4568): with a dead collector it
    retried every queued batch in turn, minutes of a stopping worker. Here it returns False at the
    deadline and the export goes on in the background until `shutdown`, which waits at most
    `shutdown_timeout_millis` (callers flush first, so it only waits for what came after the flush).
    """

    def __init__(
        self,
        exporter: SpanExporter,
        *,
        on_drop: Callable[[int], None] | None = None,
        shutdown_timeout_millis: int = 1000,
        max_queue_size: int = 2048,
        **settings: Any,
    ) -> None:
        self._max_queue_size = max_queue_size
        self._queued = 0  # sampled spans in the SDK's queue, by our count
        self._queued_lock = threading.Lock()
        super().__init__(_Dequeued(exporter, self._dequeued), max_queue_size=max_queue_size, **settings)
        self._shutdown_timeout_millis = shutdown_timeout_millis
        self._on_drop = on_drop
        # The SDK empties its queue in a forked child; weakly held, so the hook keeps no processor alive.
        forget = weakref.WeakMethod(self._forget_queue)
        os.register_at_fork(after_in_child=lambda: (method := forget()) is not None and method())

    def _forget_queue(self) -> None:
        self._queued_lock = threading.Lock()
        self._queued = 0

    def _dequeued(self, count: int) -> None:
        with self._queued_lock:
            self._queued = max(0, self._queued - count)

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is not None and span.context.trace_flags.sampled:  # the SDK queues only these
            with self._queued_lock:
                full = self._queued >= self._max_queue_size
                if not full:
                    self._queued += 1  # full: one in, the oldest out
            if full and self._on_drop is not None:
                self._on_drop(1)
        super().on_end(span)

    def force_flush(self, timeout_millis: int | None = None) -> bool:
        """Export what is queued; blocks up to `timeout_millis` (default 30 s). False if not done by then."""
        return _within(
            BatchSpanProcessor.force_flush, self, "flush", 30_000 if timeout_millis is None else timeout_millis
        )

    def shutdown(self) -> None:
        """Stop the export thread: blocks up to `shutdown_timeout_millis`, then abandons what is left (the
        SDK's own shutdown goes on in a daemon thread, which does not hold the process at exit)."""
        _within(BatchSpanProcessor.shutdown, self, "shutdown", self._shutdown_timeout_millis)


def _within(
    call: Callable[[BatchSpanProcessor], object], processor: BatchSpanProcessor, what: str, millis: int
) -> bool:
    """Run the SDK's `call(processor)` on a daemon thread and wait for it at most `millis`: its public
    flush and shutdown take no deadline they keep. True if it returned in time."""
    done = threading.Event()

    def run() -> None:
        call(processor)
        done.set()

    threading.Thread(target=run, name=f"splitscope-span-{what}", daemon=True).start()
    return done.wait(millis / 1000)


def _env_count(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name, "").strip()
    if not value:
        return default
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")
    return int(value)


class CountingExporter(SpanExporter):
    """Counts the spans of every batch `exporter` gives up on (a FAILURE result, or an exception) through
    `on_failed(n)`: the batch processor drops such a batch silently, after the exporter's own retries.
    Runs on the batch processor's export thread; adds nothing to a successful export."""

    def __init__(self, exporter: SpanExporter, on_failed: Callable[[int], None]) -> None:
        self.exporter = exporter
        self._on_failed = on_failed

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.exporter.export(spans)
        except Exception:  # the SDK would log and drop it: count it first
            self._on_failed(len(spans))
            raise
        if result is not SpanExportResult.SUCCESS:
            self._on_failed(len(spans))
        return result

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self.exporter.force_flush(timeout_millis)


def span_processors(
    traces_file: str | None,
    environ: Mapping[str, str] | None = None,
    on_drop: Callable[[int], None] | None = None,
    on_export_failed: Callable[[int], None] | None = None,
) -> list[SpanProcessor]:
    """One batching processor per exporter (OTLP from the environment, the traces file). `on_drop(n)`
    counts spans a full export queue displaced, `on_export_failed(n)` spans of batches an exporter gave up
    on; every other span is exported or still queued. Raises ValueError on a malformed OTEL_BSP_* value."""
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
    if on_export_failed is not None:
        exporters = [CountingExporter(e, on_export_failed) for e in exporters]
    return [CountingBatchSpanProcessor(e, on_drop=on_drop, **settings) for e in exporters]


def make_resource(service_name: str | None = None, attributes: dict[str, Any] | None = None) -> Resource:
    """The SDK resource for `tracer.resource.resource_attributes` (plus the SDK's telemetry.sdk.*)."""
    return Resource.create(resource_attributes(service_name, attributes))


def encode_line(spans: Sequence[ReadableSpan]) -> bytes:
    """One OTLP/JSON line (with its newline) for a batch of finished SDK spans (the codec's
    `tracer.otlp.encode.encode_sdk_line`)."""
    return encode_sdk_line(spans)


class OtlpJsonFileExporter(SpanExporter):
    """SpanExporter that appends each batch as one OTLP/JSON line to `path`.

    Called on the BatchSpanProcessor's worker thread; blocks on file I/O only.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = Path(path)
        self._path.parent.mkdir(parents=True, exist_ok=True)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        try:
            append_line(self._path, encode_line(spans))
        except OSError:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True
