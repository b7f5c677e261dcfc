"""Request-level interference for engines that expose no step timing (stock vLLM, SGLang, Dynamo).

Every finished request gives, on a known worker, its prefill window (with its uncached prompt tokens) and
its decode window (with its output tokens). A decode that ran while another request's prefill ran on the
same worker shared steps with it (whole prefills in colocated steps, chunks under chunked prefill), and its
time per output token (TPOT) shows it. `OverlapClassifier` keeps, per worker, a bounded window of recent
prefill intervals and classifies each finished decode by the prefill work that overlapped it:

    splitscope_decode_tpot_seconds{pool, prefill_overlap="true|false"}   one value per classified request
    splitscope_decode_overlap_classified_steps_total{pool, prefill_overlap}   its decode steps (tokens - 1)
    splitscope_decode_overlap_classified_seconds_total{pool, prefill_overlap}   its decode time
    splitscope_decode_overlap_prefill_steps_total{pool}   the steps of overlapped decodes that carried a prefill
    splitscope_decode_overlap_prefill_seconds_total{pool}   the time of those steps (union of the prefill windows)
    splitscope_decode_overlap_prefill_tokens_total{pool}   the overlapping prefills' uncached tokens

A request's TPOT spreads each stall over all its tokens (diluted). Splitting each overlapped decode into
its k steps that carried a prefill (time T_p) and its N - k decode-only steps (the rest of its time) undoes
that: summed over requests, (T_p / k) / ((T - T_p) / (N - k)) estimates the step-time ratio the step
signal measures, compared at the same batch and context because both parts are the same request's decode
(alerts/runbook.md#decodeinterference). Under colocated scheduling a whole prefill is one step; prefills
batched into one step start together and count once. Under chunked prefill a prompt's window spans
several steps and would count as one, overstating the time of a prefill step: a sidecar in `--mode
chunked` leaves those two counters out (the TPOT split and the rest stay).
    splitscope_worker_busy_seconds_total{pool, worker}   time with at least one request in prefill or decode
    splitscope_worker_prefill_busy_seconds_total{pool, worker}   time with at least one request in prefill

Waiting, bounded: a request's span arrives when it finishes, so a prefill that overlapped decode D may
arrive after D (its request decodes on). D is held until the worker's timeline (the latest stage end seen
there, moving on with the wall clock while nothing arrives) is `hold_s` past D's end; a prefill that then
arrives overlapping an already classified decode is counted in `..._late_prefills_total`, not guessed
into it. At most `max_held` decodes wait per worker; past that the oldest is dropped and counted
(`..._unclassified_requests_total`); the last `max_held` classified decodes are remembered to tell late
prefills. Busy time is settled up to the same horizon; an interval arriving
behind it adds only its part after it.

Thread: `add` and `advance` run on the sidecar's export thread only (`SpanExport`: stages are noted
while a batch is adapted, classified once per drain), never on the ingest loop. Neither blocks.
"""

from __future__ import annotations

import time
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tracer import spans as s
from tracer.metrics import Catalogue

DEFAULT_HOLD_S = 30.0  # longer than most decodes: the requests whose prefills overlap D finish by then
DEFAULT_MAX_HELD = 65_536  # decodes waiting per worker
DEFAULT_MAX_PREFILLS = 65_536  # prefill intervals kept per worker
# An overlap shorter than this is placement noise, not a shared step: the stages of an engine's request span
# are placed from latencies measured on two clocks (front end, engine core) and rounded to ns, so a prefill
# that ended in the step before a decode began can touch it by a few ns to a fraction of a millisecond. An
# engine step that really shares the GPU lasts milliseconds.
MIN_OVERLAP_NS = 1_000_000
_NS = 1_000_000_000


@dataclass
class _Worker:
    """One worker's window. Intervals in ns on the spans' wall-clock timeline."""

    pool: str
    name: str
    prefills: list[tuple[int, int, int]] = field(default_factory=list)  # (start, end, uncached tokens), sorted
    held: deque[tuple[int, int, int]] = field(default_factory=deque)  # decodes (start, end, output tokens)
    classified: list[tuple[int, int]] = field(default_factory=list)  # recent classified decodes, by start
    busy: list[tuple[int, int]] = field(default_factory=list)  # stage intervals not yet settled
    prefill_busy: list[tuple[int, int]] = field(default_factory=list)  # the prefill ones among them
    timeline_ns: int = 0  # latest stage end seen
    timeline_moved_s: float = 0.0  # monotonic time it last moved
    settled_ns: int = 0  # busy time and classification are final up to here
    longest_prefill_ns: int = 0
    longest_decode_ns: int = 0


class OverlapClassifier:
    """Classify finished decodes by the prefills that overlapped them on the same worker (module doc)."""

    def __init__(
        self,
        catalogue: Catalogue,
        *,
        hold_s: float = DEFAULT_HOLD_S,
        max_held: int = DEFAULT_MAX_HELD,
        max_prefills: int = DEFAULT_MAX_PREFILLS,
        prefill_in_one_step: bool = True,
        clock_s: Callable[[], float] = time.monotonic,
    ) -> None:
        """`prefill_in_one_step=False` (a chunked-prefill engine: one prefill window spans several steps):
        decodes are still classified and timed, but their prefill-carrying steps are not estimated."""
        if hold_s <= 0 or max_held < 1 or max_prefills < 1:
            raise ValueError("hold_s must be > 0, max_held and max_prefills >= 1")
        self.catalogue = catalogue
        self.hold_ns = int(hold_s * _NS)
        self.max_held = max_held
        self.max_prefills = max_prefills
        self._clock_s = clock_s
        self.prefill_in_one_step = prefill_in_one_step
        self._workers: dict[tuple[str, str], _Worker] = {}
        self._children: dict[str, tuple[Any, ...]] = {}

    def add(self, stage: s.SpanData) -> None:
        """Note one of our stage spans made from an engine's span (prefill and decode matter; others are
        ignored). Export thread; O(log n) for a prefill, O(1) for a decode."""
        attrs = stage.attributes
        if stage.name not in (s.SPAN_PREFILL, s.SPAN_DECODE):
            return
        pool, name = attrs.get(s.ATTR_POOL), attrs.get(s.ATTR_WORKER)
        if not isinstance(pool, str) or not isinstance(name, str):
            return
        worker = self._workers.get((pool, name))
        if worker is None:
            worker = self._workers[(pool, name)] = _Worker(pool, name, timeline_moved_s=self._clock_s())
        start, end = stage.start_ns, stage.end_ns
        if end > worker.timeline_ns:
            if worker.timeline_ns == 0:
                worker.settled_ns = start
            worker.timeline_ns, worker.timeline_moved_s = end, self._clock_s()
        if end > worker.settled_ns:
            worker.busy.append((max(start, worker.settled_ns), end))
            if stage.name == s.SPAN_PREFILL:
                worker.prefill_busy.append((max(start, worker.settled_ns), end))
        if stage.name == s.SPAN_PREFILL:
            tokens = _int(attrs.get(s.ATTR_PREFILL_TOKENS)) - _int(attrs.get(s.ATTR_PREFILL_CACHED_TOKENS))
            if self._overlaps_classified(worker, start, end):
                self._child(pool).late_prefills.inc()  # it overlapped a decode already classified without it
            insort(worker.prefills, (start, end, max(tokens, 0)))
            worker.longest_prefill_ns = max(worker.longest_prefill_ns, end - start)
            if len(worker.prefills) > self.max_prefills:
                del worker.prefills[0]  # the oldest start: a decode that still needs it is counted late
        else:
            steps = _int(attrs.get(s.ATTR_OUTPUT_TOKENS)) - 1
            if steps < 1 or end <= start:
                return  # no time per output token to judge
            worker.held.append((start, end, steps))
            if len(worker.held) > self.max_held:
                worker.held.popleft()
                self._child(pool).unclassified.inc()

    def advance(self) -> int:
        """Classify the decodes whose hold has passed and settle busy time; returns how many were
        classified. Export thread, once per drain."""
        now_s = self._clock_s()
        done = 0
        for worker in self._workers.values():
            # The worker's timeline moves with the wall clock while nothing arrives, so a quiet engine's
            # last requests are classified too (bounded wait in both clocks).
            idle_ns = int((now_s - worker.timeline_moved_s) * _NS)
            horizon_ns = worker.timeline_ns + idle_ns - self.hold_ns
            if horizon_ns <= worker.settled_ns:
                continue
            done += self._classify(worker, horizon_ns)
            self._settle_busy(worker, horizon_ns)
        return done

    def _classify(self, worker: _Worker, horizon_ns: int) -> int:
        m = self._child(worker.pool)
        ready = [d for d in worker.held if d[1] <= horizon_ns]
        if not ready:
            return 0
        worker.held = deque(d for d in worker.held if d[1] > horizon_ns)
        prefills = worker.prefills
        for d0, d1, steps in ready:
            # Prefills sorted by start: those that start before d1 and end after d0 (none of them ends
            # later than it started plus the longest prefill seen).
            lo = _first_start_at_or_after(prefills, d0 - worker.longest_prefill_ns)
            shared = []
            tokens = 0.0
            for p0, p1, p_tokens in prefills[lo : _first_start_at_or_after(prefills, d1 - MIN_OVERLAP_NS)]:
                a, b = max(p0, d0), min(p1, d1)
                if b - a >= MIN_OVERLAP_NS:
                    shared.append((a, b))
                    # Chunked prefill spreads a prompt over its window: the part inside the decode is the
                    # part of the work that shared its steps.
                    tokens += p_tokens * (b - a) / max(p1 - p0, 1)
            decode_ns = d1 - d0
            tpot_s = decode_ns / _NS / steps
            if shared:
                # The steps of this decode that carried a prefill: prefills batched into one step share
                # its window (starts within MIN_OVERLAP_NS: one step), and their union is the time spent
                # in them. The rest of the decode ran decode-only steps, at the same batch and context.
                prefill_steps = min(_distinct_starts(shared), steps)
                prefill_ns = min(_union_ns(shared, d0, d1), decode_ns)
                m.tpot_true.observe(tpot_s)
                m.steps_true.inc(steps)
                m.seconds_true.inc(decode_ns / _NS)
                m.prefill_tokens.inc(tokens)
                if self.prefill_in_one_step:
                    m.prefill_steps.inc(prefill_steps)
                    m.prefill_seconds.inc(prefill_ns / _NS)
            else:
                m.tpot_false.observe(tpot_s)
                m.steps_false.inc(steps)
                m.seconds_false.inc(decode_ns / _NS)
            insort(worker.classified, (d0, d1))
            worker.longest_decode_ns = max(worker.longest_decode_ns, decode_ns)
        # Forget what no held or future decode can overlap: prefills that ended before the oldest decode
        # still held (or the horizon), classified decodes a hold before the horizon.
        oldest = min((d[0] for d in worker.held), default=horizon_ns)
        keep_from = _first_start_at_or_after(prefills, oldest - worker.longest_prefill_ns)
        if keep_from:
            worker.prefills = [p for p in prefills[:keep_from] if p[1] > oldest] + prefills[keep_from:]
        if len(worker.classified) > self.max_held:  # remembered for late prefills, bounded
            del worker.classified[: len(worker.classified) - self.max_held]
        return len(ready)

    @staticmethod
    def _overlaps_classified(worker: _Worker, start: int, end: int) -> bool:
        classified = worker.classified
        lo = bisect_left(classified, (start - worker.longest_decode_ns,))
        hi = bisect_left(classified, (end - MIN_OVERLAP_NS,))
        return any(min(end, d1) - max(start, d0) >= MIN_OVERLAP_NS for d0, d1 in classified[lo:hi])

    def _settle_busy(self, worker: _Worker, horizon_ns: int) -> None:
        """Add the union of stage intervals (and of prefill ones) between the settled mark and `horizon_ns`
        to busy seconds (and prefill busy seconds)."""
        busy_s, prefill_busy_s = self._busy(worker)
        for intervals, counter in ((worker.busy, busy_s), (worker.prefill_busy, prefill_busy_s)):
            covered_ns = _union_ns(intervals, worker.settled_ns, horizon_ns)
            if covered_ns:
                counter.inc(covered_ns / _NS)
        worker.busy = [(max(a, horizon_ns), b) for a, b in worker.busy if b > horizon_ns]
        worker.prefill_busy = [(max(a, horizon_ns), b) for a, b in worker.prefill_busy if b > horizon_ns]
        worker.settled_ns = max(worker.settled_ns, horizon_ns)

    def _busy(self, worker: _Worker) -> tuple[Any, Any]:
        labels = {"pool": worker.pool, "worker": worker.name}
        return self.catalogue.worker_busy.labels(**labels), self.catalogue.worker_prefill_busy.labels(**labels)

    def _child(self, pool: str) -> _PoolMetrics:
        children = self._children.get(pool)
        if children is None:
            children = self._children[pool] = _PoolMetrics.bind(self.catalogue, pool)
        return children


@dataclass(frozen=True)
class _PoolMetrics:
    """The classifier's label children for one pool, bound once."""

    tpot_true: Any
    tpot_false: Any
    steps_true: Any
    steps_false: Any
    seconds_true: Any
    seconds_false: Any
    prefill_steps: Any
    prefill_seconds: Any
    prefill_tokens: Any
    late_prefills: Any
    unclassified: Any

    @classmethod
    def bind(cls, c: Catalogue, pool: str) -> _PoolMetrics:
        def both(family: Any) -> tuple[Any, Any]:
            return family.labels(pool=pool, prefill_overlap="true"), family.labels(pool=pool, prefill_overlap="false")

        return cls(
            *both(c.decode_tpot), *both(c.decode_classified_steps), *both(c.decode_classified_seconds),
            c.overlap_prefill_steps.labels(pool=pool), c.overlap_prefill_seconds.labels(pool=pool),
            c.overlap_prefill_tokens.labels(pool=pool), c.overlap_late_prefills.labels(pool=pool),
            c.overlap_unclassified.labels(pool=pool),
        )  # fmt: skip


def _distinct_starts(intervals: list[tuple[int, int]]) -> int:
    """Steps among overlapping prefill windows: windows starting within MIN_OVERLAP_NS of a step's first
    window belong to that step."""
    count, step_start = 0, None
    for start, _ in sorted(intervals):
        if step_start is None or start - step_start >= MIN_OVERLAP_NS:
            count, step_start = count + 1, start
    return count


def _union_ns(intervals: list[tuple[int, int]], from_ns: int, to_ns: int) -> int:
    """Length of the union of `intervals` clipped to [from_ns, to_ns)."""
    covered_ns, cursor = 0, from_ns
    for start, end in sorted(intervals):
        start, end = max(start, cursor), min(end, to_ns)
        if end > start:
            covered_ns += end - start
            cursor = end
    return covered_ns


def _first_start_at_or_after(prefills: list[tuple[int, int, int]], start_ns: int) -> int:
    return bisect_left(prefills, (start_ns,))  # (t,) sorts before every (t, end, tokens)


def _int(value: Any) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0
