"""LocalSink: spans exported by this process's OpenTelemetry SDK, and the Prometheus metrics they feed.

`MetricsRecorder` turns SpanData into the metric catalogue's observations; the sidecar uses it too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor

from tracer import spans as s
from tracer.export.otel import to_readable_span
from tracer.metrics import Catalogue, WorkerMetrics, exemplar


class MetricsRecorder:
    """Feeds the catalogue from SpanData. Children are bound once per (pool, worker) at first sight.

    Runs on the pipeline thread (or the sidecar's ingest thread); never blocks.
    """

    def __init__(self, catalogue: Catalogue) -> None:
        self.catalogue = catalogue
        self._workers: dict[tuple[str, str], WorkerMetrics] = {}
        self._request_children: dict[tuple[str, str], tuple[Any, Any, Any]] = {}

    def _worker(self, attrs: dict[str, Any]) -> WorkerMetrics | None:
        pool, worker = attrs.get(s.ATTR_POOL), attrs.get(s.ATTR_WORKER)
        if not pool or not worker:
            return None
        key = (pool, worker)
        bound = self._workers.get(key)
        if bound is None:
            try:
                bound = self._workers[key] = self.catalogue.bind(pool, worker)
            except ValueError:
                return None
        return bound

    def bind_worker(self, pool: str, worker: str) -> None:
        """Create a worker's series now (at 0), as the worker's own catalogue does when it starts, rather
        than at its first span: a counter first seen above 0 hides its first increase."""
        self._worker({s.ATTR_POOL: pool, s.ATTR_WORKER: worker})

    def record(self, data: s.SpanData) -> None:
        """Meter one span (tests, single spans); a batch goes through `record_many`."""
        self.record_many((data,))

    def record_many(self, batch: Iterable[s.SpanData]) -> None:
        """Meter every span of `batch`.

        Step durations and inter-token gaps are collected per label child and binned once per batch (numpy),
        busy time added once per worker: one histogram call per value was the largest metering cost at the
        sidecar's rates. Everything is visible on /metrics when this returns.
        """
        values: dict[Any, list[float]] = {}  # bulk histogram child -> values of this batch
        busy: dict[Any, float] = {}  # busy-seconds counter child -> seconds of this batch
        for data in batch:
            attrs = data.attributes
            if data.kind == s.KIND_SERVER:
                self._record_request(data, (data.end_ns - data.start_ns) / 1e9)
                continue
            worker = self._worker(attrs)
            if worker is None:
                continue
            duration_s = (data.end_ns - data.start_ns) / 1e9
            name = data.name
            if name == s.SPAN_STEP:
                child = (
                    worker.step_with_prefill
                    if attrs.get(s.ATTR_STEP_PREFILL_TOKENS, 0) > 0
                    else worker.step_without_prefill
                )
                bucket = values.get(child)
                if bucket is None:
                    values[child] = [duration_s]
                else:
                    bucket.append(duration_s)
                busy[worker.busy_seconds] = busy.get(worker.busy_seconds, 0.0) + duration_s
                continue
            stage = worker.stage.get(name.removeprefix("splitscope."))
            if stage is not None:
                stage.observe(duration_s, exemplar(data.trace_id))
            if name == s.SPAN_PREFILL and not data.error_type:
                tokens = int(attrs.get(s.ATTR_PREFILL_TOKENS, 0))
                cached = int(attrs.get(s.ATTR_PREFILL_CACHED_TOKENS, 0))
                worker.prefill_tokens.inc(max(0, tokens - cached))
                worker.prefix_queried_tokens.inc(tokens)
                worker.prefix_hit_tokens.inc(cached)
            elif name == s.SPAN_DECODE:
                worker.decode_tokens.inc(int(attrs.get(s.ATTR_OUTPUT_TOKENS, 0)))
                gaps = data.samples.get("itl_gaps_s")
                if gaps:
                    values.setdefault(worker.inter_token_latency, []).extend(gaps)
                    # The request's longest gap leads to its trace: on the high buckets, a stalled request.
                    worker.inter_token_latency.set_exemplar(max(gaps), exemplar(data.trace_id))
            elif name == s.SPAN_KV_TRANSFER:
                if data.error_type:
                    self.catalogue.kv_transfer_failures.labels(reason=data.error_type).inc()
                else:
                    self.catalogue.kv_transfer_bytes.labels(
                        src_pool=attrs.get(s.ATTR_POOL, s.Pool.PREFILL), dst_pool=s.Pool.DECODE
                    ).inc(int(attrs.get(s.ATTR_KV_BYTES, 0)))
        for child, observed in values.items():
            child.observe_many(observed)
        for counter, seconds in busy.items():
            counter.inc(seconds)

    def _record_request(self, data: s.SpanData, duration_s: float) -> None:
        attrs = data.attributes
        key = (str(attrs.get(s.ATTR_MODEL, "")), str(attrs.get(s.ATTR_MODE, "")))
        children = self._request_children.get(key)
        if children is None:
            labels = {"gen_ai_request_model": key[0], "mode": key[1]}
            cat = self.catalogue
            children = self._request_children[key] = (
                cat.ttft.labels(**labels),
                cat.tpot.labels(**labels),
                cat.request_duration.labels(**labels),
            )
        ttft, tpot, request_duration = children
        if data.error_type:
            return  # latency SLOs are about answered requests; errors are counted by the router
        trace = exemplar(data.trace_id)
        request_duration.observe(duration_s, trace)
        ttft_s = attrs.get(s.ATTR_TTFT_S)
        if ttft_s is not None:
            ttft.observe(ttft_s, trace)
            output_tokens = int(attrs.get(s.ATTR_OUTPUT_TOKENS, 0))
            if output_tokens > 1:
                tpot.observe((duration_s - ttft_s) / (output_tokens - 1), trace)


class LocalSink:
    """Span processors (export) and metrics in this process."""

    def __init__(
        self, resource: Resource, processors: Iterable[SpanProcessor], metrics: MetricsRecorder | None
    ) -> None:
        self.resource = resource
        self.processors = list(processors)
        self.metrics = metrics

    def emit(self, batch: Sequence[s.SpanData]) -> None:
        if self.metrics is not None:
            self.metrics.record_many(batch)
        for data in batch:
            if data.sampled and self.processors:
                span = to_readable_span(data, self.resource)
                for processor in self.processors:
                    processor.on_end(span)

    def shutdown(self, timeout_s: float) -> None:
        for processor in self.processors:
            processor.force_flush(int(timeout_s * 1000))
            processor.shutdown()
