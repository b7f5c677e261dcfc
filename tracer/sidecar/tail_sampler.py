"""The sidecar's local tail sampler (`--keep-violations --sample-rate R`): one node's version of the fleet
collector's `tail_sampling` policy (deploy/otel-collector-fleet.yaml).

Spans are held per trace until the trace's root span (kind SERVER: the router's request span, or an
engine's own request span) has come, or until `decision_timeout_s` after the trace's first span. The
whole trace is kept when it violated (the root says `splitscope.slo.violated`, or any of its spans is
an error) and `keep_violations` is on, or when its trace id falls in the sampled share `sample_rate` (the
lower 64 bits of the id against the rate, as OpenTelemetry's TraceIdRatioBased: every node that sees the
trace decides the same). A keep is decided as soon as the root is there; a drop waits `root_grace_s`
more, because processes flush on their own schedules and a worker's failed span may arrive after the
router's root. Spans of a decided trace that arrive later follow the decision.

Step spans pass straight through: they belong to no request and are already sampled, with their weight,
where they were built (tracer.step_sampling). Metrics are fed before this, from every span.

Bounded: at most `max_buffered_spans` spans wait; past it the oldest trace is decided at once (without its
root, so only errors can mark it a violator). Decisions are remembered for the `max_decided_traces` most
recent traces. Not thread-safe: the sidecar's export thread owns it. Time in seconds of `clock`.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tracer import spans as s

_LOW_64_BITS = (1 << 64) - 1

# Why a trace was decided, the `reason` of `on_decision`.
DECIDED_AT_ROOT = "root"  # the root came (a drop: and the grace after it passed)
DECIDED_AT_TIMEOUT = "timeout"
DECIDED_BUFFER_FULL = "buffer_full"

# A batch's resource: its (key, value) attribute pairs (ingest_queue.resource_key), what the export groups by.
Resource = tuple
Released = list[tuple[Resource, list[s.SpanData]]]  # (resource, spans) to export now


@dataclass
class _Trace:
    first_seen_s: float
    spans: dict[Resource, list[s.SpanData]] = field(default_factory=dict)
    count: int = 0
    violated: bool = False
    root_seen_s: float | None = None


class TailSampler:
    """`offer(resource, spans)` and `expire()` return the (resource, spans) to export now; `flush()` decides
    every waiting trace (shutdown). `on_spans(kept, dropped)` and `on_decision(keep, reason)` count."""

    def __init__(
        self,
        sample_rate: float,
        *,
        keep_violations: bool = True,
        decision_timeout_s: float = 30.0,
        root_grace_s: float = 2.0,
        max_buffered_spans: int = 200_000,
        max_decided_traces: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
        on_spans: Callable[[int, int], None] | None = None,
        on_decision: Callable[[bool, str], None] | None = None,
    ) -> None:
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"sample rate must be within [0, 1], got {sample_rate}")
        if decision_timeout_s <= 0 or root_grace_s < 0 or max_buffered_spans < 1 or max_decided_traces < 1:
            raise ValueError("decision timeout and bounds must be positive")
        self.sample_rate = sample_rate
        self._bound = int(sample_rate * (1 << 64))
        self.keep_violations = keep_violations
        self.decision_timeout_s = decision_timeout_s
        self.root_grace_s = root_grace_s
        self.max_buffered_spans = max_buffered_spans
        self.max_decided_traces = max_decided_traces
        self._clock = clock
        self._on_spans = on_spans
        self._on_decision = on_decision
        self._pending: OrderedDict[int, _Trace] = OrderedDict()  # oldest first
        self._decided: OrderedDict[int, bool] = OrderedDict()
        self._roots: deque[tuple[float, int]] = deque()  # (root seen, trace id), oldest first
        self.buffered_spans = 0
        self.kept_spans = 0
        self.dropped_spans = 0

    def sampled(self, trace_id: int) -> bool:
        """Whether a trace without a violation is kept: its id's lower 64 bits below rate * 2^64."""
        return (trace_id & _LOW_64_BITS) < self._bound

    def offer(self, resource: Resource, spans: list[s.SpanData]) -> Released:
        now = self._clock()
        out: dict[Resource, list[s.SpanData]] = {}
        late_kept = late_dropped = 0
        for span in spans:
            if span.name == s.SPAN_STEP:
                out.setdefault(resource, []).append(span)
                continue
            trace_id = span.trace_id
            decision = self._decided.get(trace_id)
            if decision is not None:
                if decision:
                    out.setdefault(resource, []).append(span)
                    late_kept += 1
                else:
                    late_dropped += 1
                continue
            trace = self._pending.get(trace_id)
            if trace is None:
                trace = self._pending[trace_id] = _Trace(now)
            trace.spans.setdefault(resource, []).append(span)
            trace.count += 1
            self.buffered_spans += 1
            if span.error_type or span.attributes.get(s.ATTR_SLO_VIOLATED) is True:
                trace.violated = True
            if span.kind == s.KIND_SERVER and trace.root_seen_s is None:
                trace.root_seen_s = now
                self._roots.append((now, trace_id))
            if trace.root_seen_s is not None and self._keep(trace_id, trace):
                self._decide(trace_id, DECIDED_AT_ROOT, out)
        while self.buffered_spans > self.max_buffered_spans and self._pending:
            self._decide(next(iter(self._pending)), DECIDED_BUFFER_FULL, out)
        self._count(late_kept, late_dropped)
        return list(out.items())

    def expire(self) -> Released:
        """Decide the traces whose root came `root_grace_s` ago, and those whose root has not come within
        the decision timeout."""
        now = self._clock()
        out: dict[Resource, list[s.SpanData]] = {}
        while self._roots and self._roots[0][0] <= now - self.root_grace_s:
            _, trace_id = self._roots.popleft()
            if trace_id in self._pending:
                self._decide(trace_id, DECIDED_AT_ROOT, out)
        deadline = now - self.decision_timeout_s
        while self._pending:
            trace_id, trace = next(iter(self._pending.items()))
            if trace.first_seen_s > deadline:
                break
            self._decide(trace_id, DECIDED_AT_TIMEOUT, out)
        return list(out.items())

    def flush(self) -> Released:
        out: dict[Resource, list[s.SpanData]] = {}
        while self._pending:
            self._decide(next(iter(self._pending)), DECIDED_AT_TIMEOUT, out)
        self._roots.clear()
        return list(out.items())

    def _keep(self, trace_id: int, trace: _Trace) -> bool:
        return (self.keep_violations and trace.violated) or self.sampled(trace_id)

    def _decide(self, trace_id: int, reason: str, out: dict[Resource, list[s.SpanData]]) -> None:
        trace = self._pending.pop(trace_id)
        keep = self._keep(trace_id, trace)
        self.buffered_spans -= trace.count
        if keep:
            for resource, spans in trace.spans.items():
                out.setdefault(resource, []).extend(spans)
            self._count(trace.count, 0)
        else:
            self._count(0, trace.count)
        self._decided[trace_id] = keep
        if len(self._decided) > self.max_decided_traces:
            self._decided.popitem(last=False)
        if self._on_decision is not None:
            self._on_decision(keep, reason)

    def _count(self, kept: int, dropped: int) -> None:
        if not (kept or dropped):
            return
        self.kept_spans += kept
        self.dropped_spans += dropped
        if self._on_spans is not None:
            self._on_spans(kept, dropped)
