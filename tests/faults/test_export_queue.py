"""The span export queue when the collector is stuck or dead: drops are counted, flush and shutdown keep
their time limits, and the standard OTEL_BSP_* settings are honoured (tracer/session.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from tests.conftest import free_port, wait_for
from tracer import spans as s
from tracer.export.otel import CountingBatchSpanProcessor, span_processors, to_readable_span

RESOURCE = Resource.create({"service.name": "faults"})


def step_span_data() -> s.SpanData:
    return s.SpanData(
        name=s.SPAN_STEP,
        kind=s.KIND_INTERNAL,
        trace_id=s.new_trace_id(),
        span_id=s.new_span_id(),
        parent_span_id=0,
        start_ns=1_000,
        end_ns=2_000,
        attributes={s.ATTR_POOL: "colocated", s.ATTR_WORKER: "w0"},
    )


def step_span() -> ReadableSpan:
    return to_readable_span(step_span_data(), RESOURCE)


class StuckExporter(SpanExporter):
    """A collector that takes a batch and then hangs until released (a stalled connection)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.handed_spans = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.handed_spans += len(spans)
        self.entered.set()
        self.release.wait(30)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.release.set()


def test_a_stuck_exporter_costs_counted_drops_and_the_queue_stays_at_its_bound():
    exporter = StuckExporter()
    drops = []
    processor = CountingBatchSpanProcessor(
        exporter, on_drop=drops.append, max_queue_size=64, max_export_batch_size=16, schedule_delay_millis=10
    )
    try:
        for _ in range(16):
            processor.on_end(step_span())
        assert exporter.entered.wait(10), "the export thread never took the first batch"
        pushed = 1000
        for _ in range(pushed):
            processor.on_end(step_span())
        assert exporter.handed_spans == 16
        assert sum(drops) == pushed - 64, "every span the full queue displaced is counted, none twice"
    finally:
        exporter.release.set()
        processor.shutdown()


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_flush_and_shutdown_keep_their_limits_when_the_collector_is_dead(protocol):
    environ = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_BSP_MAX_QUEUE_SIZE": "4096",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "64",
    }
    drops = []
    (processor,) = span_processors(None, environ, on_drop=drops.append)
    for _ in range(5000):
        processor.on_end(step_span())
    assert sum(drops) >= 5000 - 4096 - 64  # at most one batch left the queue for the dead collector

    started = time.monotonic()
    flushed = processor.force_flush(500)
    flush_s = time.monotonic() - started
    # 64 batches, each retried for seconds, would take minutes (the SDK ignores the flush timeout).
    assert not flushed and flush_s < 3.0, f"force_flush(500 ms) returned {flushed} after {flush_s:.1f} s"
    started = time.monotonic()
    processor.shutdown()
    assert time.monotonic() - started < 3.0


def test_otel_bsp_settings_are_honoured_and_bad_ones_refused(tmp_path):
    traces_file = str(tmp_path / "traces.jsonl")
    (processor,) = span_processors(
        traces_file, {"OTEL_BSP_MAX_QUEUE_SIZE": "100", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "512"}
    )
    try:
        assert processor._batch_processor._max_queue_size == 100
        assert processor._batch_processor._max_export_batch_size == 100  # never above the queue
    finally:
        processor.shutdown()
    (processor,) = span_processors(traces_file, {})
    try:
        assert processor._batch_processor._max_queue_size == 8192
    finally:
        processor.shutdown()
    with pytest.raises(ValueError, match="OTEL_BSP_MAX_QUEUE_SIZE='lots' must be a positive integer"):
        span_processors(traces_file, {"OTEL_BSP_MAX_QUEUE_SIZE": "lots"})


def test_a_sidecar_whose_collector_is_dead_counts_what_its_export_queue_drops(tmp_path):
    from tracer.sidecar.ingest_queue import Batch
    from tracer.sidecar.server import Sidecar, SidecarConfig

    environ = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}",
        "OTEL_BSP_MAX_QUEUE_SIZE": "128",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "32",
    }
    sidecar = Sidecar(SidecarConfig(http_port=None, grpc_port=None, gpu=False, environ=environ)).start()
    try:
        batch = [step_span_data() for _ in range(1000)]
        assert sidecar.queue.offer(Batch((("service.name", "w0"),), batch))

        def dropped() -> float:
            return sidecar.registry.get_sample_value(
                "splitscope_tracer_dropped_records_total", {"reason": "export_queue_full"}
            )

        wait_for(lambda: dropped() >= 1000 - 128 - 32, 30, "the sidecar to count its export queue's drops")
    finally:
        sidecar.stop(2.0)


class RefusingExporter(SpanExporter):
    """A collector that answers every batch with an error: FAILURE, then an exception."""

    def __init__(self) -> None:
        self.calls = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.calls += 1
        if self.calls == 1:
            return SpanExportResult.FAILURE
        raise ConnectionError("collector gone")

    def shutdown(self) -> None:
        pass


def test_batches_an_exporter_gives_up_on_are_counted_not_lost():
    from tracer.export.otel import CountingExporter

    failed = []
    exporter = CountingExporter(RefusingExporter(), failed.append)
    assert exporter.export([step_span()] * 3) is SpanExportResult.FAILURE
    with pytest.raises(ConnectionError):
        exporter.export([step_span()] * 5)
    assert failed == [3, 5]
