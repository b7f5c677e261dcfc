"""Off the hot path: drain the ring, resolve timings, build spans, feed metrics.

One daemon thread per process (`Pipeline`) wakes every `interval_s` (or when the ring passes half full),
drains records, resolves their clock marks (CUDA events by `query()`, never by synchronising; records
whose events are not complete wait in a bounded pending list), turns them into `SpanData`, and hands them
to a sink:
- `LocalSink`: OpenTelemetry span processors (batching, OTLP / file export) and Prometheus metrics here.
- the sidecar sink (tracer/sidecar/): ships SpanData over a Unix socket; the sidecar runs a LocalSink.

A slow or dead exporter never reaches the engine: the span processors have their own bounded queues,
and the ring drops its oldest records when the pipeline falls behind, counting every drop.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor

from tracer import spans as s
from tracer.metrics import Catalogue, WorkerMetrics, exemplar
from tracer.records import (
    KIND_DECODE,
    KIND_REQUEST,
    KIND_STAGE,
    KIND_STAGE_WALL,
    KIND_STEP,
    RECORD_TYPES,
    STAGE_KV_RECV,
    STAGE_KV_SEND,
    STAGE_KV_TRANSFER,
    DecodeRecord,
    RecordRing,
    RequestRecord,
    StageRecord,
    StepRecord,
)
from tracer.timing import SOURCE_HOST, Clock, Interval, perf_counter_ns

log = logging.getLogger(__name__)

STAGE_SPAN_NAMES = {
    "queue": s.SPAN_QUEUE,
    "prefill": s.SPAN_PREFILL,
    STAGE_KV_TRANSFER: s.SPAN_KV_TRANSFER,
    STAGE_KV_SEND: s.SPAN_KV_SEND,
    STAGE_KV_RECV: s.SPAN_KV_RECV,
    "decode": s.SPAN_DECODE,
}
# A gap counts as a decode stall when it exceeds this multiple of the request's median gap.
STALL_FACTOR = 3.0
# Spans handed to the sink between two yields of the interpreter lock (see Pipeline.drain_once).
EMIT_SLICE = 32
# Step spans of one worker share a trace per window, so no trace grows without bound.
STEP_TRACE_WINDOW_NS = 60_000_000_000


class Sink(Protocol):
    def emit(self, batch: Sequence[s.SpanData]) -> None: ...

    def shutdown(self, timeout_s: float) -> None: ...


# ------------------------------------------------------------------------------------- summarise


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default) of an ascending sequence; 0.0 when empty."""
    n = len(sorted_values)
    if n == 0:
        return 0.0
    position = q * (n - 1)
    low = int(position)
    high = min(low + 1, n - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def decode_summary(
    token_perf_ns: Sequence[int], token_prefill_tokens: Sequence[int] | None
) -> tuple[dict[str, Any], list[tuple[str, int, dict[str, Any]]], list[float], list[int]]:
    """ITL attributes, stall events (times as perf ns, placed by the caller), and the gaps (s)."""
    gaps_s = [(b - a) / 1e9 for a, b in zip(token_perf_ns, token_perf_ns[1:])]
    ordered = sorted(gaps_s)
    p50 = quantile(ordered, 0.5)
    stalls: list[tuple[str, int, dict[str, Any]]] = []
    stall_times: list[int] = []
    for i, gap in enumerate(gaps_s):
        if p50 > 0 and gap > STALL_FACTOR * p50:
            prefill = int(token_prefill_tokens[i + 1]) if token_prefill_tokens is not None else 0
            stalls.append((s.EVENT_DECODE_STALL, 0, {"gap_s": gap, "prefill_tokens": prefill}))
            stall_times.append(token_perf_ns[i + 1])
    attrs = {
        s.ATTR_DECODE_ITL_P50_S: p50,
        s.ATTR_DECODE_ITL_P99_S: quantile(ordered, 0.99),
        s.ATTR_DECODE_ITL_MAX_S: ordered[-1] if ordered else 0.0,
        s.ATTR_DECODE_STALLS: len(stalls),
    }
    return attrs, stalls, gaps_s, stall_times


class Summariser:
    """Turns resolved records into SpanData for one worker (pool, worker) or the router (pool None)."""

    def __init__(self, clock: Clock, pool: str | None, worker: str | None, step_sample_every: int = 1) -> None:
        self.clock = clock
        self.pool = pool
        self.worker = worker
        self.step_sample_every = max(1, step_sample_every)
        self._steps_seen = 0
        self._step_trace_id = s.new_trace_id()
        self._step_trace_started_ns = 0

    def _stage_attrs(self, attrs: dict[str, Any] | None, source: str) -> dict[str, Any]:
        out = dict(attrs) if attrs else {}
        out.setdefault(s.ATTR_POOL, self.pool)
        out.setdefault(s.ATTR_WORKER, self.worker)
        out[s.ATTR_TIMING_SOURCE] = source
        return out

    def stage(self, record: StageRecord, interval: Interval) -> s.SpanData:
        return s.SpanData(
            name=STAGE_SPAN_NAMES[record.stage], kind=s.KIND_INTERNAL, trace_id=record.ctx.trace_id,
            span_id=record.span_id or s.new_span_id(), parent_span_id=record.ctx.span_id,
            start_ns=interval.start_wall_ns, end_ns=max(interval.end_wall_ns, interval.start_wall_ns),
            attributes=self._stage_attrs(record.attrs, interval.source), error_type=record.error_type,
        )  # fmt: skip

    def decode(self, record: DecodeRecord, interval: Interval) -> s.SpanData:
        attrs = self._stage_attrs(record.attrs, interval.source)
        decode_attrs, stalls, gaps_s, stall_perf_ns = decode_summary(record.token_perf_ns, record.token_prefill_tokens)
        attrs.update(decode_attrs)
        return s.SpanData(
            name=s.SPAN_DECODE, kind=s.KIND_INTERNAL, trace_id=record.ctx.trace_id, span_id=s.new_span_id(),
            parent_span_id=record.ctx.span_id, start_ns=interval.start_wall_ns,
            end_ns=max(interval.end_wall_ns, interval.start_wall_ns), attributes=attrs,
            events=[(name, self.clock.to_wall_ns(t), a) for (name, _, a), t in zip(stalls, stall_perf_ns)],
            error_type=record.error_type, samples={"itl_gaps_s": gaps_s},
        )  # fmt: skip

    def step(self, record: StepRecord, interval: Interval) -> s.SpanData:
        if interval.start_wall_ns - self._step_trace_started_ns > STEP_TRACE_WINDOW_NS:
            self._step_trace_id = s.new_trace_id()
            self._step_trace_started_ns = interval.start_wall_ns
        self._steps_seen += 1
        return s.SpanData(
            name=s.SPAN_STEP, kind=s.KIND_INTERNAL, trace_id=self._step_trace_id, span_id=s.new_span_id(),
            parent_span_id=0, start_ns=interval.start_wall_ns, end_ns=interval.end_wall_ns,
            attributes={
                s.ATTR_POOL: self.pool, s.ATTR_WORKER: self.worker, s.ATTR_TIMING_SOURCE: interval.source,
                s.ATTR_STEP_DECODE_REQUESTS: record.decode_requests,
                s.ATTR_STEP_PREFILL_TOKENS: record.prefill_tokens,
                s.ATTR_STEP_CONTEXT_TOKENS: record.context_tokens,
            },
            sampled=(self._steps_seen - 1) % self.step_sample_every == 0,
        )  # fmt: skip

    def request(self, record: RequestRecord, interval: Interval) -> s.SpanData:
        gaps = sorted(record.token_gap_s) if record.token_gap_s is not None else []
        attrs: dict[str, Any] = {
            s.ATTR_OPERATION: "text_completion", s.ATTR_MODEL: record.model,
            s.ATTR_INPUT_TOKENS: record.input_tokens, s.ATTR_OUTPUT_TOKENS: record.output_tokens,
            s.ATTR_REQUEST_ID: record.request_id, s.ATTR_MODE: record.mode,
        }  # fmt: skip
        if record.first_token is not None:
            first_ns = self.clock.to_wall_ns(self.clock.host_perf_ns(record.first_token))
            attrs[s.ATTR_TTFT_S] = max(0, first_ns - interval.start_wall_ns) / 1e9
        if gaps:
            attrs[s.ATTR_ITL_P99_S] = quantile(gaps, 0.99)
            attrs[s.ATTR_ITL_MAX_S] = gaps[-1]
            attrs[s.ATTR_ITL_MEAN_S] = statistics.fmean(gaps)
        return s.SpanData(
            name=f"{s.ROOT_SPAN_PREFIX} {record.model}", kind=s.KIND_SERVER, trace_id=record.ctx.trace_id,
            span_id=record.span_id, parent_span_id=record.ctx.span_id, start_ns=interval.start_wall_ns,
            end_ns=interval.end_wall_ns, attributes=attrs, error_type=record.error_type,
        )  # fmt: skip


# ------------------------------------------------------------------------------------- metrics


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
                child = worker.step_with_prefill if attrs.get(s.ATTR_STEP_PREFILL_TOKENS, 0) > 0 else worker.step_without_prefill
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
            elif name == s.SPAN_KV_TRANSFER:
                if data.error_type:
                    self.catalogue.kv_transfer_failures.labels(reason=data.error_type).inc()
                else:
                    self.catalogue.kv_transfer_bytes.labels(
                        src_pool=attrs.get(s.ATTR_POOL, "prefill"), dst_pool="decode"
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
                cat.ttft.labels(**labels), cat.tpot.labels(**labels), cat.request_duration.labels(**labels),
            )  # fmt: skip
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

    def __init__(self, resource: Resource, processors: Iterable[SpanProcessor], metrics: MetricsRecorder | None) -> None:
        self.resource = resource
        self.processors = list(processors)
        self.metrics = metrics

    def emit(self, batch: Sequence[s.SpanData]) -> None:
        if self.metrics is not None:
            self.metrics.record_many(batch)
        for data in batch:
            if data.sampled and self.processors:
                span = s.to_readable_span(data, self.resource)
                for processor in self.processors:
                    processor.on_end(span)

    def shutdown(self, timeout_s: float) -> None:
        for processor in self.processors:
            processor.force_flush(int(timeout_s * 1000))
            processor.shutdown()


# ------------------------------------------------------------------------------------- the thread


class Pipeline:
    """The consumer of a RecordRing: one daemon thread, started by `start()`, stopped by `shutdown()`."""

    def __init__(
        self,
        ring: RecordRing,
        summariser: Summariser,
        sink: Sink,
        interval_s: float = 0.1,
        max_pending: int = 16384,
        on_drop: Callable[[str, int], None] | None = None,
        pending_gauge: Any | None = None,
    ) -> None:
        self.ring = ring
        self.summariser = summariser
        self.sink = sink
        self.interval_s = interval_s
        self.max_pending = max_pending
        self._pending: list[Any] = []
        self._on_drop = on_drop
        self._pending_gauge = pending_gauge
        self._reported_ring_drops = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.emitted = 0
        self._convert = {
            KIND_STAGE: summariser.stage,
            KIND_STAGE_WALL: summariser.stage,
            KIND_DECODE: summariser.decode,
            KIND_STEP: summariser.step,
            KIND_REQUEST: summariser.request,
        }

    def start(self) -> Pipeline:
        self._thread = threading.Thread(target=self._run, name="splitscope-pipeline", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.drain_once()
            except Exception:  # the pipeline must outlive any one bad record
                log.exception("splitscope pipeline: drain failed")

    def drain_once(self, force_host_timing: bool = False) -> int:
        """Resolve and emit what can be; returns the number of spans emitted. Pipeline thread only."""
        now = perf_counter_ns()
        records = self._pending + [RECORD_TYPES[r[0]]._make(r) for r in self.ring.drain(self.ring.capacity)]
        self._pending = []
        out: list[s.SpanData] = []
        bad = 0
        for record in records:
            try:
                interval = self._interval(record, now, force_host_timing)
                if interval is None:
                    self._pending.append(record)
                    continue
                out.append(self._convert[record.kind](record, interval))
            except Exception:  # one malformed record (e.g. an unknown stage name) must not cost the batch
                if not bad:
                    log.exception("splitscope pipeline: dropping a malformed record %r", record[:3])
                bad += 1
        if bad:
            self._drop("bad_record", bad)
        if len(self._pending) > self.max_pending:
            overflow = len(self._pending) - self.max_pending
            self._pending = self._pending[overflow:]
            self._drop("pending_full", overflow)
        ring_drops = self.ring.dropped - self._reported_ring_drops
        if ring_drops > 0:
            self._reported_ring_drops += ring_drops
            self._drop("ring_full", ring_drops)
        if self._pending_gauge is not None:
            self._pending_gauge.set(len(self._pending) + len(self.ring))
        # Emit in small slices and yield the GIL between them: a long uninterrupted pass would make the
        # engine thread wait for the interpreter lock each time one of its device/torch calls returns.
        for first in range(0, len(out), EMIT_SLICE):
            if first:
                time.sleep(0)
            self.sink.emit(out[first : first + EMIT_SLICE])
        self.emitted += len(out)
        return len(out)

    def _interval(self, record: Any, now: int, force_host: bool) -> Interval | None:
        if record.kind == KIND_STAGE_WALL:
            return Interval(record.start, record.end, SOURCE_HOST)
        clock = self.summariser.clock
        interval = clock.resolve(record.start, record.end, now)
        if interval is None and force_host:  # shutting down: incomplete CUDA events fall back to host marks
            start_ns = clock.to_wall_ns(clock.host_perf_ns(record.start))
            interval = Interval(start_ns, clock.to_wall_ns(clock.host_perf_ns(record.end)), SOURCE_HOST)
        return interval

    def _drop(self, reason: str, count: int) -> None:
        if self._on_drop is not None:
            self._on_drop(reason, count)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the thread, emit what is left (pending CUDA records with host timing), flush the sink."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        deadline = time.monotonic() + timeout_s
        while len(self.ring) and time.monotonic() < deadline:
            self.drain_once()
        self.drain_once(force_host_timing=True)
        self.ring.close()
        self.sink.shutdown(max(0.1, deadline - time.monotonic()))
