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
    splitscope_worker_busy_seconds_total{pool, worker}   time with at least one request in prefill or decode
    splitscope_worker_prefill_busy_seconds_total{pool, worker}   time with at least one request in prefill

A request's TPOT spreads each stall over all its tokens (diluted). Splitting each overlapped decode into
its k steps that carried a prefill (time T_p) and its N - k decode-only steps (the rest of its time) undoes
that: summed over requests, (T_p / k) / ((T - T_p) / (N - k)) estimates the step-time ratio the step
signal measures, compared at the same batch and context because both parts are the same request's decode
(alerts/runbook.md#decodeinterference). Under colocated scheduling a whole prefill is one step; prefills
batched into one step start together and count once. Under chunked prefill a prompt's window spans
several steps and would count as one, overstating the time of a prefill step: a sidecar in `--mode
chunked` leaves those two counters out (the TPOT split and the rest stay).

Waiting, bounded: a request's span arrives when it finishes, so a prefill that overlapped decode D may
arrive after D (its request decodes on). D is held until the worker's timeline (the latest stage end seen
there, moving on with the wall clock while nothing arrives) is `hold_s` past D's end; a prefill that then
arrives overlapping an already classified decode is counted in `..._late_prefills_total`, not guessed
into it. At most `max_held` decodes wait per worker; past that the oldest is dropped and counted
(`..._unclassified_requests_total`); the last `max_held` classified decodes are remembered to tell late
prefills. Prefills are kept `retain_s` (10 minutes) behind the hold's horizon, at most `max_prefills` per
worker: a long answer arrives when it ends, long after the prefills that ran early in it. Busy time is
settled up to the same horizon; an interval arriving behind it adds only its part after it.

Stall links (docs/architecture.md section 4): the decode spans this classifier holds can come back with
OpenTelemetry span links to the prefill spans that overlapped them, what the reference server's decode
spans carry from its step records, here estimated from the windows alone (`estimated_stall_links`).
A span's links are fixed when it is made, and a prefill that overlapped D usually arrives after D (its
request still decodes when D's ends), so a decode span that is to carry them cannot leave before its
classification: `add(stage, resource)` keeps the span itself, and `released()` hands it back, linked,
once classified. A decode span without an output-token count (SGLang's `decode_forward` slice, vLLM's
lifecycle `vllm_decode`) is held and linked the same way but counts in no metric: it has no TPOT to
classify; a prefill without a prompt size (their prefill slices) links without `link.prefill_tokens`.
The span is late by at most the hold (`hold_s` of the engine's timeline, or of wall
clock while it is quiet); its metrics are not: the export meters it when it arrives. A decode dropped
from a full hold is released unlinked; `flush()` (shutdown) classifies and releases every held one.

Thread: `add`, `advance`, `released` and `flush` run on the sidecar's export thread only (`SpanExport`: stages are noted
while a batch is adapted, classified once per drain), never on the ingest loop. Neither blocks.
"""

from __future__ import annotations

import time
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count
from typing import Any

import numpy as np

from tracer import spans as s
from tracer.metrics import Catalogue

DEFAULT_HOLD_S = 30.0  # longer than most decodes: the requests whose prefills overlap D finish by then
DEFAULT_MAX_HELD = 65_536  # decodes waiting per worker
DEFAULT_MAX_PREFILLS = 65_536  # prefill intervals kept per worker
# How far back from the hold's horizon prefills are kept for decodes that have not arrived yet: a decode
# reaches the sidecar when its request ends, and a long answer (thousands of tokens, on a busy engine)
# started long before. Longer than any decode a latency SLO allows; max_prefills bounds the memory too.
DEFAULT_RETAIN_S = 600.0
# An overlap shorter than this is placement noise, not a shared step: the stages of an engine's request span
# are placed from latencies measured on two clocks (front end, engine core) and rounded to ns, so a prefill
# that ended in the step before a decode began can touch it by a few ns to a fraction of a millisecond. An
# engine step that really shares the GPU lasts milliseconds.
MIN_OVERLAP_NS = 1_000_000
_NS = 1_000_000_000
_LONG_AGO_NS = -(2**62)  # before any start, and far enough from int64's end that subtracting it cannot overflow
_GROUP_DECODES = 32  # decodes classified together: bounds the [decodes x prefills] matrix
# A decode span links to at most this many overlapping prefills, the longest overlap first (as the
# reference server's pipeline bounds its stall links: tracer.pipeline.MAX_STALL_LINKS).
MAX_STALL_LINKS = 32
_NEVER_NS = 2**62  # a horizon past every end: flush() classifies whatever is held
_UNKNOWN_TOKENS = -1  # a prefill span that gave no prompt size (counted as 0 tokens in the metrics)


@dataclass
class _Worker:
    """One worker's window. Intervals in ns on the spans' wall-clock timeline."""

    pool: str
    name: str
    # (start, end, uncached tokens, serial), sorted; serial -> (trace id, span id) in `prefill_ids`
    prefills: list[tuple[int, int, int, int]] = field(default_factory=list)
    prefill_ids: dict[int, tuple[int, int]] = field(default_factory=dict)
    # decodes (start, end, steps: output tokens - 1, serial); serial -> (resource, span) in `held_spans`
    # for those whose span waits for its links
    held: deque[tuple[int, int, int, int]] = field(default_factory=deque)
    held_spans: dict[int, tuple[Any, s.SpanData]] = field(default_factory=dict)
    classified: list[tuple[int, int]] = field(default_factory=list)  # recent classified decodes, by start
    busy: list[tuple[int, int]] = field(default_factory=list)  # stage intervals not yet settled
    prefill_busy: list[tuple[int, int]] = field(default_factory=list)  # the prefill ones among them
    timeline_ns: int = 0  # latest stage end seen
    timeline_moved_s: float = 0.0  # monotonic time `advance` first saw it where it is
    timeline_seen_ns: int = -1
    settled_ns: int = 0  # busy time and classification are final up to here
    longest_prefill_ns: int = 0
    longest_decode_ns: int = 0
    classified_end_ns: int = 0  # the latest end among classified decodes


class OverlapClassifier:
    """Classify finished decodes by the prefills that overlapped them on the same worker (module doc)."""

    def __init__(
        self,
        catalogue: Catalogue,
        *,
        hold_s: float = DEFAULT_HOLD_S,
        max_held: int = DEFAULT_MAX_HELD,
        max_prefills: int = DEFAULT_MAX_PREFILLS,
        retain_s: float = DEFAULT_RETAIN_S,
        prefill_in_one_step: bool = True,
        clock_s: Callable[[], float] = time.monotonic,
    ) -> None:
        """`prefill_in_one_step=False` (a chunked-prefill engine: one prefill window spans several steps):
        decodes are still classified and timed, but their prefill-carrying steps are not estimated.
        `retain_s`: prefills are kept this long behind the hold's horizon for decodes still running (at
        most `max_prefills` of them); a decode that started earlier misses the prefills before that."""
        if hold_s <= 0 or max_held < 1 or max_prefills < 1 or retain_s < 0:
            raise ValueError("hold_s must be > 0, max_held and max_prefills >= 1, retain_s >= 0")
        self.catalogue = catalogue
        self.hold_ns = int(hold_s * _NS)
        self.retain_ns = int(retain_s * _NS)
        self.max_held = max_held
        self.max_prefills = max_prefills
        self._clock_s = clock_s
        self.prefill_in_one_step = prefill_in_one_step
        self._workers: dict[tuple[str, str], _Worker] = {}
        self._children: dict[str, _PoolMetrics] = {}
        self._serials = count()
        self._released: list[tuple[Any, s.SpanData]] = []

    def add(self, stage: s.SpanData, resource: Any = None) -> bool:
        """Note one of our stage spans made from an engine's span (prefill and decode matter; others are
        ignored). With `resource` (the export's grouping key), a decode this classifier holds is kept whole
        and comes back from `released()` with its stall links once classified: True then, and the caller
        must not export it itself. Export thread; O(log n) for a prefill, O(1) for a decode."""
        is_prefill = stage.name == s.SPAN_PREFILL
        if not is_prefill and stage.name != s.SPAN_DECODE:
            return False
        attrs = stage.attributes
        # Attribute values: strings on our stage spans; checked before a new worker is stored under them.
        key: tuple[Any, Any] = (attrs.get(s.ATTR_POOL), attrs.get(s.ATTR_WORKER))
        worker = self._workers.get(key)
        if worker is None:
            if not isinstance(key[0], str) or not isinstance(key[1], str):
                return False
            worker = self._workers[key] = _Worker(key[0], key[1])
        start, end = stage.start_ns, stage.end_ns
        if end > worker.timeline_ns:
            if worker.timeline_ns == 0:
                worker.settled_ns = start
            worker.timeline_ns = end
        if end > worker.settled_ns:
            interval = (start if start > worker.settled_ns else worker.settled_ns, end)
            worker.busy.append(interval)
            if is_prefill:
                worker.prefill_busy.append(interval)
        if is_prefill:
            self._add_prefill(worker, stage)
            return False
        return self._hold_decode(worker, stage, resource)

    def _add_prefill(self, worker: _Worker, stage: s.SpanData) -> None:
        start, end, attrs = stage.start_ns, stage.end_ns, stage.attributes
        if s.ATTR_PREFILL_TOKENS in attrs:
            tokens = max(_int(attrs.get(s.ATTR_PREFILL_TOKENS)) - _int(attrs.get(s.ATTR_PREFILL_CACHED_TOKENS)), 0)
        else:
            tokens = _UNKNOWN_TOKENS  # SGLang's slices, vLLM's lifecycle spans: links then carry no token count
        # Usually a prefill starts after every classified decode ended (they wait out the hold first).
        if start < worker.classified_end_ns and self._overlaps_classified(worker, start, end):
            self._child(worker.pool).late_prefills.inc()  # it overlapped a decode classified without it
        serial = next(self._serials)
        insort(worker.prefills, (start, end, tokens, serial))
        worker.prefill_ids[serial] = (stage.trace_id, stage.span_id)
        if end - start > worker.longest_prefill_ns:
            worker.longest_prefill_ns = end - start
        if len(worker.prefills) > self.max_prefills:
            # the oldest start: a decode that still needs it is counted late
            del worker.prefill_ids[worker.prefills.pop(0)[3]]

    def _hold_decode(self, worker: _Worker, stage: s.SpanData, resource: Any) -> bool:
        start, end = stage.start_ns, stage.end_ns
        steps = _int(stage.attributes.get(s.ATTR_OUTPUT_TOKENS)) - 1
        if end <= start:
            return False
        if steps < 1:
            # No time per output token to judge (one token, or an engine whose decode span does not say:
            # SGLang's slices, vLLM's lifecycle spans). Still linked when its span is held; metered never.
            if resource is None:
                return False
            steps = 0
        serial = next(self._serials)
        worker.held.append((start, end, steps, serial))
        if resource is not None:
            worker.held_spans[serial] = (resource, stage)
        if len(worker.held) > self.max_held:
            dropped = worker.held.popleft()[3]
            self._child(worker.pool).unclassified.inc()
            unlinked = worker.held_spans.pop(dropped, None)
            if unlinked is not None:
                self._released.append(unlinked)  # exported as it came: never lost for want of links
        return resource is not None

    def released(self) -> list[tuple[Any, s.SpanData]]:
        """The held decode spans classified since the last call, with their stall links, as (resource,
        span); the caller exports them. Export thread."""
        out, self._released = self._released, []
        return out

    def flush(self) -> int:
        """Classify every held decode now, whatever its hold (shutdown: nothing more will arrive), so that
        `released()` hands back every held span. Returns how many were classified. Export thread."""
        done = 0
        for worker in self._workers.values():
            done += self._classify(worker, _NEVER_NS)
        return done

    def advance(self) -> int:
        """Classify the decodes whose hold has passed and settle busy time; returns how many were
        classified. Export thread, once per drain."""
        now_s = self._clock_s()
        done = 0
        for worker in self._workers.values():
            # The worker's timeline moves with the wall clock while nothing arrives, so a quiet engine's
            # last requests are classified too (bounded wait in both clocks).
            if worker.timeline_ns != worker.timeline_seen_ns:
                worker.timeline_seen_ns, worker.timeline_moved_s = worker.timeline_ns, now_s
            idle_ns = int((now_s - worker.timeline_moved_s) * _NS)
            horizon_ns = worker.timeline_ns + idle_ns - self.hold_ns
            if horizon_ns <= worker.settled_ns:
                continue
            done += self._classify(worker, horizon_ns)
            self._settle_busy(worker, horizon_ns)
        return done

    def _classify(self, worker: _Worker, horizon_ns: int) -> int:
        ready = sorted(d for d in worker.held if d[1] <= horizon_ns)
        if not ready:
            return 0
        worker.held = deque(d for d in worker.held if d[1] > horizon_ns)
        for i in range(0, len(ready), _GROUP_DECODES):
            self._classify_group(worker, np.asarray(ready[i : i + _GROUP_DECODES], dtype=np.int64))
        for d0, d1, _, _ in ready:
            insort(worker.classified, (d0, d1))
            worker.longest_decode_ns = max(worker.longest_decode_ns, d1 - d0)
            worker.classified_end_ns = max(worker.classified_end_ns, d1)
        # Forget what no held or future decode can overlap: prefills that ended before the oldest decode
        # still held and before the retention window behind the horizon (a decode still running, to arrive
        # when its request ends, may have started long ago), classified decodes a hold before the horizon.
        oldest = min(min((d[0] for d in worker.held), default=horizon_ns), horizon_ns - self.retain_ns)
        prefills = worker.prefills
        keep_from = _first_start_at_or_after(prefills, oldest - worker.longest_prefill_ns)
        if keep_from:
            for p in prefills[:keep_from]:
                if p[1] <= oldest:
                    del worker.prefill_ids[p[3]]
            worker.prefills = [p for p in prefills[:keep_from] if p[1] > oldest] + prefills[keep_from:]
        if len(worker.classified) > self.max_held:  # remembered for late prefills, bounded
            del worker.classified[: len(worker.classified) - self.max_held]
        return len(ready)

    def _classify_group(self, worker: _Worker, decodes: np.ndarray) -> None:
        """Classify decodes (rows of start, end, steps, serial; sorted by start) against the prefills that
        could overlap them, all at once: a [decodes x candidate prefills] matrix of shared windows."""
        d0, d1, steps = decodes[:, :1], decodes[:, 1:2], decodes[:, 2]
        prefills = worker.prefills
        # Prefills sorted by start: those that start before some decode ends and end after some decode
        # starts (none ends later than it started plus the longest prefill seen).
        lo = _first_start_at_or_after(prefills, int(d0[0, 0]) - worker.longest_prefill_ns)
        hi = _first_start_at_or_after(prefills, int(d1.max()) - MIN_OVERLAP_NS)
        candidates = np.asarray(prefills[lo:hi], dtype=np.int64).reshape(-1, 4)
        p0, p1, p_tokens = candidates[:, 0], candidates[:, 1], np.maximum(candidates[:, 2], 0)
        a = np.maximum(p0, d0)  # [decodes, candidates]: the part of each prefill inside each decode
        b = np.minimum(p1, d1)
        hit = (b - a) >= MIN_OVERLAP_NS
        a = np.where(hit, a, d0)  # misses become empty windows at the decode's start (sorted order kept)
        b = np.where(hit, b, d0)
        # Chunked prefill spreads a prompt over its window: the part inside the decode is the part of the
        # work that shared its steps.
        tokens = (p_tokens * (b - a) / np.maximum(p1 - p0, 1)).sum(axis=1)
        # The steps of a decode that carried a prefill: prefills batched into one step share its window
        # (a start within MIN_OVERLAP_NS of the previous one: the same step), and their union (windows in
        # start order, each counted past the furthest end before it) is the time spent in them. The rest
        # of the decode ran decode-only steps, at the same batch and context.
        if hit.shape[1]:
            last_start = np.maximum.accumulate(np.where(hit, a, _LONG_AGO_NS), axis=1)
            previous_start = np.concatenate([np.full_like(d0, _LONG_AGO_NS), last_start[:, :-1]], axis=1)
            prefill_steps = (hit & (a - previous_start >= MIN_OVERLAP_NS)).sum(axis=1)
            furthest_end = np.maximum.accumulate(b, axis=1)
            previous_end = np.concatenate([d0, furthest_end[:, :-1]], axis=1)
            prefill_ns = np.clip(b - np.maximum(a, previous_end), 0, None).sum(axis=1)
        else:
            prefill_steps = prefill_ns = np.zeros(len(decodes), dtype=np.int64)
        decode_ns = (d1 - d0)[:, 0]
        tpot_s = decode_ns / _NS / np.maximum(steps, 1)
        metered = steps > 0  # decodes held only for their links (no output-token count) count nowhere
        overlapped = metered & (prefill_steps > 0)
        clean = metered & (prefill_steps == 0)
        m = self._child(worker.pool)
        m.tpot_true.observe_many(tpot_s[overlapped])
        m.tpot_false.observe_many(tpot_s[clean])
        m.steps_true.inc(int(steps[overlapped].sum()))
        m.steps_false.inc(int(steps[clean].sum()))
        m.seconds_true.inc(float(decode_ns[overlapped].sum()) / _NS)
        m.seconds_false.inc(float(decode_ns[clean].sum()) / _NS)
        m.prefill_tokens.inc(float(tokens[metered].sum()))
        if self.prefill_in_one_step:
            m.prefill_steps.inc(int(np.minimum(prefill_steps, steps)[metered].sum()))
            m.prefill_seconds.inc(float(prefill_ns[metered].sum()) / _NS)
        if worker.held_spans:
            self._link_held(worker, decodes[:, 3], candidates, hit, b - a, prefill_ns)

    def _link_held(
        self,
        worker: _Worker,
        serials: np.ndarray,
        candidates: np.ndarray,
        hit: np.ndarray,
        overlap_ns: np.ndarray,
        prefill_ns: np.ndarray,
    ) -> None:
        """Give each held decode span of a classified group its estimated stall links and release it.
        `hit` / `overlap_ns`: [decodes, candidates], which prefill overlapped which decode, by how much."""
        for row, serial in enumerate(serials.tolist()):
            entry = worker.held_spans.pop(serial, None)
            if entry is None:
                continue
            resource, span = entry
            cols = np.flatnonzero(hit[row])
            # Only the longest overlaps become links: rank them here, build at most one link too many (the
            # request's own prefill, which ends before its decode starts, is left out below if there).
            top = cols[np.argsort(-overlap_ns[row, cols], kind="stable")[: MAX_STALL_LINKS + 1]]
            overlaps = []
            for c in top.tolist():
                ns = int(overlap_ns[row, c])
                ids = worker.prefill_ids[int(candidates[c, 3])]
                overlaps.append((ns, ids, self._link_tokens(int(candidates[c, 2]), ns, candidates[c])))
            links, dropped = estimated_stall_links(span.trace_id, overlaps)
            dropped += len(cols) - len(top)
            span.links = links
            span.attributes[s.ATTR_DECODE_STALLED_NS] = int(prefill_ns[row])
            span.attributes[s.ATTR_DECODE_STALLED_ESTIMATED] = True
            if dropped:
                span.attributes[s.ATTR_DECODE_STALL_LINKS_DROPPED] = dropped
            self._released.append((resource, span))

    def _link_tokens(self, tokens: int, overlap_ns: int, prefill: np.ndarray) -> int:
        """A linked prefill's tokens in the decode's steps: its whole uncached prompt where a prompt runs in
        one step; under chunked prefill the part of its window inside the decode (its chunks spread evenly).
        _UNKNOWN_TOKENS when its span gave no prompt size."""
        if self.prefill_in_one_step or tokens == _UNKNOWN_TOKENS:
            return tokens
        return round(tokens * overlap_ns / max(int(prefill[1] - prefill[0]), 1))

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
            *both(c.decode_tpot),
            *both(c.decode_classified_steps),
            *both(c.decode_classified_seconds),
            c.overlap_prefill_steps.labels(pool=pool),
            c.overlap_prefill_seconds.labels(pool=pool),
            c.overlap_prefill_tokens.labels(pool=pool),
            c.overlap_late_prefills.labels(pool=pool),
            c.overlap_unclassified.labels(pool=pool),
        )


def estimated_stall_links(
    own_trace_id: int, overlaps: list[tuple[int, tuple[int, int], int]]
) -> tuple[list[tuple[int, int, dict[str, Any]]], int]:
    """A decode span's links from the prefills that overlapped it, `overlaps` of (overlap ns, (trace id,
    span id), tokens): the longest overlap first, at most MAX_STALL_LINKS, and how many more there were.
    Each link: `splitscope.link.stalled_ns` the overlap (prompts batched into one step each get that step's
    whole time, so links can add up to more than the decode's `splitscope.decode.stalled_ns`, their
    union), `splitscope.link.prefill_tokens` (left out when the prefill's span gave no prompt size),
    `splitscope.link.estimated` true. The request's own
    prefill never links (it ends before its decode starts, up to the placement of two clocks)."""
    ranked = sorted((o for o in overlaps if o[1][0] != own_trace_id), key=lambda o: -o[0])
    links = [
        (trace_id, span_id, _link_attributes(ns, tokens))
        for ns, (trace_id, span_id), tokens in ranked[:MAX_STALL_LINKS]
    ]
    return links, max(0, len(ranked) - MAX_STALL_LINKS)


def _link_attributes(stalled_ns: int, tokens: int) -> dict[str, Any]:
    attrs: dict[str, Any] = {s.ATTR_LINK_STALLED_NS: stalled_ns, s.ATTR_LINK_ESTIMATED: True}
    if tokens != _UNKNOWN_TOKENS:
        attrs[s.ATTR_LINK_PREFILL_TOKENS] = tokens
    return attrs


def _union_ns(intervals: list[tuple[int, int]], from_ns: int, to_ns: int) -> int:
    """Length of the union of `intervals` clipped to [from_ns, to_ns)."""
    if not intervals:
        return 0
    spans = np.asarray(intervals, dtype=np.int64)
    spans = spans[np.argsort(spans[:, 0], kind="stable")]
    starts, ends = np.maximum(spans[:, 0], from_ns), np.minimum(spans[:, 1], to_ns)
    # Each interval in start order counts past the furthest end before it.
    before = np.concatenate(([from_ns], np.maximum.accumulate(ends)[:-1]))
    return int(np.clip(ends - np.maximum(starts, before), 0, None).sum())


def _first_start_at_or_after(prefills: list[tuple[int, int, int, int]], start_ns: int) -> int:
    return bisect_left(prefills, (start_ns,))  # (t,) sorts before every (t, end, tokens, serial)


def _int(value: Any) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0
