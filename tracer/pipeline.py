"""Off the hot path: drain the ring, resolve timings, build spans, feed metrics.

One daemon thread per process (`Pipeline`) wakes every `interval_s`, drains records resolves their clock marks (CUDA events by `query()`, never by synchronising; records
whose events are not complete wait in a bounded pending list), turns them into `SpanData`, and hands them
to a sink:
- `tracer.export.local_sink.LocalSink`: OpenTelemetry span processors (batching, OTLP / file export) and
  Prometheus metrics here.
- the sidecar sink (tracer/sidecar/client.py): ships SpanData over a Unix socket; the sidecar runs a
  LocalSink. This module imports neither the OpenTelemetry SDK nor prometheus_client, so the sidecar path
  costs an engine neither.

A slow or dead exporter never reaches the engine: the span processors have their own bounded queues,
and the ring drops its oldest records when the pipeline falls behind, counting every drop.
"""

from __future__ import annotations

import logging
import threading
import time
from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from tracer import spans as s
from tracer.records import (
    KIND_DECODE,
    KIND_REQUEST,
    KIND_STAGE,
    KIND_STAGE_WALL,
    KIND_STEP,
    RECORD_TYPES,
    DecodeRecord,
    RecordRing,
    RequestRecord,
    StageRecord,
    StepRecord,
)
from tracer.slo_outcome import RequestSlo
from tracer.step_sampling import StepSampler
from tracer.timing import SOURCE_HOST, Clock, Interval, perf_counter_ns
from tracer.vocabulary import DropReason

log = logging.getLogger(__name__)

# A gap counts as a decode stall when it exceeds this multiple of the request's median gap.
STALL_FACTOR = 3.0
# Spans handed to the sink between two yields of the interpreter lock (see Pipeline.drain_once).
EMIT_SLICE = 32
# Step spans of one worker share a trace per window, so no trace grows without bound.
STEP_TRACE_WINDOW_NS = 60_000_000_000
# A decode span links to at most this many prefills that stalled it (the largest stall time first) ...
MAX_STALL_LINKS = 32
# ... looked up among this many of the worker's latest steps that ran a prefill (older stalls: no link).
PREFILL_STEPS_KEPT = 4096


class Sink(Protocol):
    """Where the pipeline hands its spans. `emit` runs on the pipeline thread and must not block: that
    thread's drains are what keep the ring at its capacity in a process without the garbage collector."""

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


def stall_links(
    stall_perf_ns: Sequence[int],
    stall_gaps_s: Sequence[float],
    prefill_steps: dict[int, tuple[tuple[int, int, int], ...]],
    own_trace_id: int,
) -> tuple[list[tuple[int, int, dict[str, Any]]], int]:
    """Span links from a decode span to the prefills that ran in the steps ending its stalls, and how many
    more there were than MAX_STALL_LINKS. `prefill_steps`: a step's emitted-token perf ns -> its
    (trace id, prefill span id, chunk tokens); each prefill's stalled time is its tokens' share of the gap.
    Pipeline thread; costs nothing for a decode without stalls."""
    stalled_ns: dict[tuple[int, int], float] = {}
    tokens: dict[tuple[int, int], int] = {}
    for perf_ns, gap_s in zip(stall_perf_ns, stall_gaps_s):
        prefills = prefill_steps.get(perf_ns)
        total = sum(n for _, _, n in prefills) if prefills else 0
        if not total:
            continue
        for trace_id, span_id, n in prefills:  # type: ignore[union-attr]
            if trace_id == own_trace_id or not span_id:
                continue
            key = (trace_id, span_id)
            stalled_ns[key] = stalled_ns.get(key, 0.0) + gap_s * 1e9 * n / total
            tokens[key] = tokens.get(key, 0) + n
    ranked = sorted(stalled_ns, key=lambda key: -stalled_ns[key])
    links = [
        (
            trace_id,
            span_id,
            {
                s.ATTR_LINK_STALLED_NS: round(stalled_ns[(trace_id, span_id)]),
                s.ATTR_LINK_PREFILL_TOKENS: tokens[(trace_id, span_id)],
            },
        )
        for trace_id, span_id in ranked[:MAX_STALL_LINKS]
    ]
    return links, max(0, len(ranked) - MAX_STALL_LINKS)


class SpanBuilder:
    """Turns resolved records into SpanData for one worker (pool, worker) or the router (pool None)."""

    def __init__(
        self,
        clock: Clock,
        pool: str | None,
        worker: str | None,
        step_sample_every: int = 1,
        step_sampler: StepSampler | None = None,
        slo: RequestSlo | None = None,
    ) -> None:
        """Step spans are kept by `step_sampler`, else a StepSampler keeping 1 in `step_sample_every`
        decode-only steps and every prefill step up to its budget (1: every step). With `slo` (the
        router's), root spans say whether the request met it (`splitscope.slo.violated` / `.missed`)."""
        self.clock = clock
        self.pool = pool
        self.worker = worker
        self.step_sampler = step_sampler or StepSampler(decode_sample_every=max(1, step_sample_every))
        self.slo = slo if slo is not None and slo.configured else None
        self._step_trace_id = s.new_trace_id()
        self._step_trace_started_ns = 0
        # emitted-token perf ns -> the prefills of that step, for the latest PREFILL_STEPS_KEPT such steps
        self._prefill_steps: dict[int, tuple[tuple[int, int, int], ...]] = {}

    def note_step(self, record: StepRecord) -> None:
        """Remember which prefills `record`'s step ran, for the decode spans it stalled. Called on every
        drained step record before its timing resolves: the decode records after it may resolve first."""
        if not record.prefills or not record.emitted_perf_ns:
            return
        steps = self._prefill_steps
        steps[record.emitted_perf_ns] = record.prefills
        if len(steps) > PREFILL_STEPS_KEPT:
            del steps[next(iter(steps))]  # dicts keep insertion order: the oldest step

    def _stage_attrs(self, attrs: dict[str, Any] | None, source: str) -> dict[str, Any]:
        out = dict(attrs) if attrs else {}
        out.setdefault(s.ATTR_POOL, self.pool)
        out.setdefault(s.ATTR_WORKER, self.worker)
        out[s.ATTR_TIMING_SOURCE] = source
        return out

    def stage(self, record: StageRecord, interval: Interval) -> s.SpanData:
        return s.SpanData(
            name=s.STAGE_SPAN_NAMES[record.stage],
            kind=s.KIND_INTERNAL,
            trace_id=record.ctx.trace_id,
            span_id=record.span_id or s.new_span_id(),
            parent_span_id=record.ctx.span_id,
            start_ns=interval.start_wall_ns,
            end_ns=max(interval.end_wall_ns, interval.start_wall_ns),
            attributes=self._stage_attrs(record.attrs, interval.source),
            error_type=record.error_type,
        )

    def decode(self, record: DecodeRecord, interval: Interval) -> s.SpanData:
        attrs = self._stage_attrs(record.attrs, interval.source)
        decode_attrs, stalls, gaps_s, stall_perf_ns = decode_summary(record.token_perf_ns, record.token_prefill_tokens)
        attrs.update(decode_attrs)
        stall_gaps_s = [a["gap_s"] for _, _, a in stalls]
        attrs[s.ATTR_DECODE_STALLED_NS] = round(sum(stall_gaps_s) * 1e9)
        links, dropped = stall_links(stall_perf_ns, stall_gaps_s, self._prefill_steps, record.ctx.trace_id)
        if dropped:
            attrs[s.ATTR_DECODE_STALL_LINKS_DROPPED] = dropped
        return s.SpanData(
            name=s.SPAN_DECODE,
            kind=s.KIND_INTERNAL,
            trace_id=record.ctx.trace_id,
            span_id=s.new_span_id(),
            parent_span_id=record.ctx.span_id,
            start_ns=interval.start_wall_ns,
            end_ns=max(interval.end_wall_ns, interval.start_wall_ns),
            attributes=attrs,
            events=[(name, self.clock.to_wall_ns(t), a) for (name, _, a), t in zip(stalls, stall_perf_ns)],
            error_type=record.error_type,
            samples={"itl_gaps_s": gaps_s},
            links=links,
        )

    def step(self, record: StepRecord, interval: Interval) -> s.SpanData:
        if interval.start_wall_ns - self._step_trace_started_ns > STEP_TRACE_WINDOW_NS:
            self._step_trace_id = s.new_trace_id()
            self._step_trace_started_ns = interval.start_wall_ns
        weight = self.step_sampler.keep(interval.start_wall_ns, record.prefill_tokens)
        span = s.SpanData(
            name=s.SPAN_STEP,
            kind=s.KIND_INTERNAL,
            trace_id=self._step_trace_id,
            span_id=s.new_span_id(),
            parent_span_id=0,
            start_ns=interval.start_wall_ns,
            end_ns=interval.end_wall_ns,
            attributes={
                s.ATTR_POOL: self.pool,
                s.ATTR_WORKER: self.worker,
                s.ATTR_TIMING_SOURCE: interval.source,
                s.ATTR_STEP_DECODE_REQUESTS: record.decode_requests,
                s.ATTR_STEP_PREFILL_TOKENS: record.prefill_tokens,
                s.ATTR_STEP_CONTEXT_TOKENS: record.context_tokens,
                s.ATTR_SAMPLE_WEIGHT: weight,
            },
            sampled=weight > 0,  # not kept: metrics only
        )
        if record.prefill_attention_tokens2 >= 0:
            span.attributes[s.ATTR_STEP_PREFILL_ATTENTION_TOKENS2] = record.prefill_attention_tokens2
        return span

    def request(self, record: RequestRecord, interval: Interval) -> s.SpanData:
        gaps = sorted(record.token_gap_s) if record.token_gap_s is not None else []
        attrs: dict[str, Any] = {
            s.ATTR_OPERATION: record.operation,
            s.ATTR_MODEL: record.model,
            s.ATTR_INPUT_TOKENS: record.input_tokens,
            s.ATTR_OUTPUT_TOKENS: record.output_tokens,
            s.ATTR_REQUEST_ID: record.request_id,
            s.ATTR_MODE: record.mode,
        }
        if record.first_token is not None:
            first_ns = self.clock.to_wall_ns(self.clock.host_perf_ns(record.first_token))
            attrs[s.ATTR_TTFT_S] = max(0, first_ns - interval.start_wall_ns) / 1e9
        if gaps:
            attrs[s.ATTR_ITL_P99_S] = quantile(gaps, 0.99)
            attrs[s.ATTR_ITL_MAX_S] = gaps[-1]
            attrs[s.ATTR_ITL_MEAN_S] = sum(gaps) / len(gaps)
            attrs[s.ATTR_ITL_JOINED_TOKENS] = bisect_right(gaps, 0.0)  # sorted: the zeros lead
        if self.slo is not None:
            missed = self.slo.missed(
                attrs.get(s.ATTR_TTFT_S),
                max(0, interval.end_wall_ns - interval.start_wall_ns) / 1e9,
                attrs.get(s.ATTR_ITL_P99_S),
            )
            attrs[s.ATTR_SLO_VIOLATED] = bool(missed)
            if missed:
                attrs[s.ATTR_SLO_MISSED] = ",".join(missed)
        return s.SpanData(
            name=f"{record.operation} {record.model}",
            kind=s.KIND_SERVER,
            trace_id=record.ctx.trace_id,
            span_id=record.span_id,
            parent_span_id=record.ctx.span_id,
            start_ns=interval.start_wall_ns,
            end_ns=interval.end_wall_ns,
            attributes=attrs,
            error_type=record.error_type,
        )


# ------------------------------------------------------------------------------------- the thread


class Pipeline:
    """The consumer of a RecordRing: one daemon thread, started by `start()`, stopped by `shutdown()`."""

    def __init__(
        self,
        ring: RecordRing,
        span_builder: SpanBuilder,
        sink: Sink,
        interval_s: float = 0.1,
        max_pending: int = 16384,
        on_drop: Callable[[str, int], None] | None = None,
        pending_gauge: Any | None = None,
        after_drain: Callable[[], None] | None = None,
    ) -> None:
        """`after_drain`, when given, runs on the pipeline thread after every timed drain (the sidecar
        path ships the process's gauges there: tracer.sidecar.client.MetricsShipper)."""
        self.ring = ring
        self.span_builder = span_builder
        self.sink = sink
        self.interval_s = interval_s
        self.max_pending = max_pending
        self._pending: list[Any] = []
        self._on_drop = on_drop
        self._pending_gauge = pending_gauge
        self._after_drain = after_drain
        self._reported_ring_drops = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.emitted = 0
        self._convert: dict[int, Callable[[Any, Interval], s.SpanData]] = {
            KIND_STAGE: span_builder.stage,
            KIND_STAGE_WALL: span_builder.stage,
            KIND_DECODE: span_builder.decode,
            KIND_STEP: span_builder.step,
            KIND_REQUEST: span_builder.request,
        }

    def start(self) -> Pipeline:
        self._thread = threading.Thread(target=self._run, name="splitscope-pipeline", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.drain_once()
                if self._after_drain is not None:
                    self._after_drain()
            except Exception:  # the pipeline must outlive any one bad record
                log.exception("splitscope pipeline: drain failed")

    def drain_once(self, force_host_timing: bool = False) -> int:
        """Resolve and emit what can be; returns the number of spans the sink took. Pipeline thread only.

        Every record drained either becomes a span the sink took, waits in the pending list, or is counted
        through `on_drop` (bad_record, pending_full, ring_full, sink_error)."""
        now = perf_counter_ns()
        records = self._pending + self.ring.drain(self.ring.capacity)
        self._pending = []
        out: list[s.SpanData] = []
        bad = 0
        for raw in records:
            try:
                record = RECORD_TYPES[raw[0]]._make(raw)  # inside the try: a malformed tuple is one bad record
                if record.kind == KIND_STEP:
                    self.span_builder.note_step(record)
                interval = self._interval(record, now, force_host_timing)
                if interval is None:
                    self._pending.append(record)
                    continue
                out.append(self._convert[record.kind](record, interval))
            except Exception:  # one malformed record (e.g. an unknown stage name) must not cost the batch
                if not bad:
                    log.exception("splitscope pipeline: dropping a malformed record %.120r", raw)
                bad += 1
        if bad:
            self._drop(DropReason.BAD_RECORD, bad)
        if len(self._pending) > self.max_pending:
            overflow = len(self._pending) - self.max_pending
            self._pending = self._pending[overflow:]
            self._drop(DropReason.PENDING_FULL, overflow)
        ring_drops = self.ring.dropped - self._reported_ring_drops
        if ring_drops > 0:
            self._reported_ring_drops += ring_drops
            self._drop(DropReason.RING_FULL, ring_drops)
        if self._pending_gauge is not None:
            self._pending_gauge.set(len(self._pending) + len(self.ring))
        # Emit in small slices and yield the GIL between them: a long uninterrupted pass would make the
        # engine thread wait for the interpreter lock each time one of its device/torch calls returns.
        emitted = 0
        for first in range(0, len(out), EMIT_SLICE):
            if first:
                time.sleep(0)
            batch = out[first : first + EMIT_SLICE]
            try:
                self.sink.emit(batch)
            except Exception:  # a failing sink costs its slice, counted, never the rest of the drain
                log.exception("splitscope pipeline: the sink failed; dropping %d spans", len(batch))
                self._drop(DropReason.SINK_ERROR, len(batch))
                continue
            emitted += len(batch)
        self.emitted += emitted
        return emitted

    def _interval(self, record: Any, now: int, force_host: bool) -> Interval | None:
        if record.kind == KIND_STAGE_WALL:
            return Interval(record.start, record.end, SOURCE_HOST)
        clock = self.span_builder.clock
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
