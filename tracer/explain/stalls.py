"""A request's decode stalls, as time windows, and what filled each one.

**What is a stall.** A gap between two of the request's tokens longer than `STALL_FACTOR` (2x) its own
median gap and longer than `STALL_FLOOR_S` (10 ms: below that a gap is not worth explaining on any
hardware). The windows come from the best data the trace has, in this order:

1. Token times (measured): the decode span's `splitscope.decode.stall` events. Each is stamped with the
   time of the token that ended the gap and carries `gap_s`, so the window is [time - gap_s, time]. Our
   tracer emits an event only for gaps over 3x the median (`tracer.pipeline.STALL_FACTOR`), so on its
   traces the effective rule is the stricter of the two. A decode span with inter-token figures
   (`splitscope.decode.itl_p50_s`) and no events had no stall.
2. Step spans (estimated): no per-token data, but the worker's `splitscope.step` spans: a step inside the
   request's decode span longer than 2x the (sample-weighted) median step there is a window, assuming the
   request was in every step between its decode start and end (true of continuous batching without
   preemption).
3. Request overlap (estimated): neither (stock vLLM's request spans): each other request's prefill that
   overlapped this request's decode on the same worker is a window, clipped to the decode span.

Windows of 2 and 3 are marked `"estimated": true` with `basis` saying what they rest on.

**Causes.** Step spans do not name the requests in a step, so a window is attributed by time overlap on
the request's own worker (its decode span's `splitscope.worker`); on one worker a prefill span covers the
steps that ran its prompt, so its overlap with the window is the time its prefill (or chunks) took
there. The window is swept in segments; each segment goes to the first kind active in it:

- `prefill`: another request's `splitscope.prefill` span; several at once (prompts batched into one
  step) split the segment by their uncached prompt tokens. `prefill_tokens`: those tokens.
- `kv_transfer`: another request's `splitscope.kv_transfer.recv` on this (decode) worker: its KV landing
  competes with the engine for the host. `prefill_tokens`: that request's prompt tokens.
- `preemption`: the request's own decode interrupted: the time between two of its decode spans (engines'
  adapters that see a preemption emit the decode in pieces; the reference server never preempts).
- `queueing`: no step ran on the worker at all (known only when the worker's step spans are unsampled,
  weight 1): the request was ready and waited for the engine loop (admission, scheduling, the host).
- `unexplained` (trace id null): the rest, including the request's own ordinary step.

`share` is the fraction of the window each cause took; the shares of a window add up to 1 (causes under
1% are left out).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tracer import spans as s
from tracer.explain.read import ExplainData, Trace, WorkerSpan
from tracer.otlp import Span

STALL_FACTOR = 2.0  # a stall is a gap over this multiple of the request's median gap ...
STALL_FLOOR_S = 0.010  # ... and over this many seconds
MIN_SHARE = 0.01  # causes taking less of a window are left out
# Sweep order: a segment goes to the first kind active in it (see the module docstring).
_KINDS = (s.Stage.PREFILL, s.Stage.KV_TRANSFER, "preemption", "queueing")

BASIS_TOKENS = "token times: the decode span's stall events"
BASIS_STEPS = "step spans of worker {worker}; the request is assumed in every step of its decode span"
BASIS_OVERLAP = "request overlap on worker {worker}: other requests' prefill spans during its decode (no token times)"


@dataclass
class Window:
    """A stall window on one worker, Unix ns; `engine_prefill_tokens`: the prefill tokens the engine
    recorded for the step that ended the gap (the stall event's `prefill_tokens`), None where unknown."""

    start_ns: int
    end_ns: int
    worker: str
    estimated: bool
    basis: str
    engine_prefill_tokens: int | None = None


@dataclass
class _Interval:
    start_ns: int
    end_ns: int
    kind: str
    trace_id: str | None
    tokens: int


@dataclass
class _Tally:
    ns: dict[tuple[str, str | None], float] = field(default_factory=dict)
    tokens: dict[tuple[str, str | None], int] = field(default_factory=dict)

    def add(self, key: tuple[str, str | None], ns: float, tokens: int) -> None:
        self.ns[key] = self.ns.get(key, 0.0) + ns
        self.tokens[key] = tokens


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _worker(span: Span) -> str:
    worker = span.attributes.get(s.ATTR_WORKER)
    return worker if isinstance(worker, str) else ""


def stall_windows(data: ExplainData, trace: Trace) -> list[Window]:
    """The stall windows of every decode span of `trace`, by start (see the module docstring)."""
    windows: list[Window] = []
    for decode in trace.stages.get(s.SPAN_DECODE, []):
        worker = _worker(decode)
        if _number(decode.attributes.get(s.ATTR_DECODE_ITL_P50_S)) is not None or decode.events:
            windows += _from_events(decode, worker)
        elif worker and _worker_steps(data, worker, decode.start_ns, decode.end_ns).size:
            windows += _from_steps(data, decode, worker)
        elif worker:
            windows += _from_overlap(data, trace, decode, worker)
    windows.sort(key=lambda w: w.start_ns)
    return windows


def _from_events(decode: Span, worker: str) -> list[Window]:
    p50_s = _number(decode.attributes.get(s.ATTR_DECODE_ITL_P50_S)) or 0.0
    out = []
    for event in decode.events:
        gap_s = _number(event.attributes.get("gap_s"))
        if event.name != s.EVENT_DECODE_STALL or gap_s is None:
            continue
        if gap_s > STALL_FACTOR * p50_s and gap_s > STALL_FLOOR_S:
            tokens = _number(event.attributes.get("prefill_tokens"))
            start_ns = event.time_ns - round(gap_s * 1e9)
            out.append(
                Window(start_ns, event.time_ns, worker, False, BASIS_TOKENS, None if tokens is None else int(tokens))
            )
    return out


def _worker_steps(data: ExplainData, worker: str, start_ns: int, end_ns: int) -> np.ndarray:
    """Indices of `worker`'s step spans that lie inside [start_ns, end_ns]."""
    steps = data.steps
    if not len(steps):
        return np.zeros(0, dtype=np.intp)
    ends = steps.start_ns + np.round(steps.duration_s * 1e9).astype(np.int64)
    mask = (steps.worker == worker) & (steps.start_ns >= start_ns) & (ends <= end_ns)
    return np.flatnonzero(mask)


def _weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cumulative, cumulative[-1] / 2)])


def _from_steps(data: ExplainData, decode: Span, worker: str) -> list[Window]:
    index = _worker_steps(data, worker, decode.start_ns, decode.end_ns)
    durations = data.steps.duration_s[index]
    median_s = _weighted_median(durations, data.steps.weight[index])
    basis = BASIS_STEPS.format(worker=worker)
    out = []
    for i, duration_s in zip(index, durations):
        if duration_s > STALL_FACTOR * median_s and duration_s > STALL_FLOOR_S:
            start_ns = int(data.steps.start_ns[i])
            out.append(Window(start_ns, start_ns + round(duration_s * 1e9), worker, True, basis))
    return out


def _from_overlap(data: ExplainData, trace: Trace, decode: Span, worker: str) -> list[Window]:
    basis = BASIS_OVERLAP.format(worker=worker)
    out = []
    for other in data.on_worker(worker, s.SPAN_PREFILL):
        start_ns, end_ns = max(other.start_ns, decode.start_ns), min(other.end_ns, decode.end_ns)
        if other.trace_id != trace.trace_id and (end_ns - start_ns) / 1e9 > STALL_FLOOR_S:
            out.append(Window(start_ns, end_ns, worker, True, basis))
    return out


def _intervals(data: ExplainData, trace: Trace, window: Window) -> list[_Interval]:
    """Everything that could have filled `window` on its worker, clipped to it."""
    a, b = window.start_ns, window.end_ns
    found: list[_Interval] = []

    def add(kind: str, spans: list[WorkerSpan]) -> None:
        for other in spans:
            if other.trace_id != trace.trace_id and other.start_ns < b and other.end_ns > a:
                found.append(
                    _Interval(max(a, other.start_ns), min(b, other.end_ns), kind, other.trace_id, other.tokens)
                )

    add(s.Stage.PREFILL, data.on_worker(window.worker, s.SPAN_PREFILL))
    add(s.Stage.KV_TRANSFER, data.on_worker(window.worker, s.SPAN_KV_RECV))
    decodes = trace.stages.get(s.SPAN_DECODE, [])
    for before, after in zip(decodes, decodes[1:]):
        if before.end_ns < b and after.start_ns > a and after.start_ns > before.end_ns:
            found.append(_Interval(max(a, before.end_ns), min(b, after.start_ns), "preemption", trace.trace_id, 0))
    found += _idle(data, window)
    return found


def _idle(data: ExplainData, window: Window) -> list[_Interval]:
    """The parts of `window` in which no step ran on its worker, when its step spans are all kept (an
    unsampled worker: weight 1 each); none otherwise, since a dropped step leaves no span."""
    steps = data.steps
    on_worker = steps.worker == window.worker if len(steps) else np.zeros(0, dtype=bool)
    if not on_worker.any() or np.any(steps.weight[on_worker] != 1):
        return []
    starts = steps.start_ns[on_worker]
    ends = starts + np.round(steps.duration_s[on_worker] * 1e9).astype(np.int64)
    inside = (starts < window.end_ns) & (ends > window.start_ns)
    if not inside.any():
        return []
    idle, cursor = [], window.start_ns
    for start_ns, end_ns in sorted(zip(starts[inside].tolist(), ends[inside].tolist())):
        if start_ns > cursor:
            idle.append(_Interval(cursor, start_ns, "queueing", None, 0))
        cursor = max(cursor, end_ns)
    if cursor < window.end_ns:
        idle.append(_Interval(cursor, window.end_ns, "queueing", None, 0))
    return idle


def _sweep(window: Window, intervals: list[_Interval]) -> _Tally:
    """Each segment between interval boundaries goes to the first active kind (prefills split by tokens)."""
    tally = _Tally()
    bounds = sorted({window.start_ns, window.end_ns, *(i.start_ns for i in intervals), *(i.end_ns for i in intervals)})
    for x, y in zip(bounds, bounds[1:]):
        active = [i for i in intervals if i.start_ns <= x and i.end_ns >= y]
        kind = next((k for k in _KINDS if any(i.kind == k for i in active)), None)
        if kind is None:
            tally.add(("unexplained", None), y - x, 0)
            continue
        chosen = [i for i in active if i.kind == kind]
        tokens = sum(i.tokens for i in chosen) if kind == s.Stage.PREFILL else 0
        for i in chosen:
            weight = i.tokens / tokens if tokens > 0 else 1 / len(chosen)
            tally.add((kind, i.trace_id), (y - x) * weight, i.tokens)
    return tally


def causes(data: ExplainData, trace: Trace, window: Window) -> list[dict[str, Any]]:
    """The causes of `window`, largest share first: {kind, trace_id, prefill_tokens, share, estimated}."""
    duration_ns = window.end_ns - window.start_ns
    if duration_ns <= 0:
        return []
    tally = _sweep(window, _intervals(data, trace, window))
    out: list[dict[str, Any]] = []
    for (kind, trace_id), ns in tally.ns.items():
        share = ns / duration_ns
        if share < MIN_SHARE:
            continue
        tokens = tally.tokens[(kind, trace_id)] if kind in (s.Stage.PREFILL, s.Stage.KV_TRANSFER) else None
        out.append(
            {
                "kind": kind,
                "trace_id": trace_id,
                "prefill_tokens": tokens,
                "share": round(share, 4),
                "estimated": window.estimated,
            }
        )
    out.sort(key=lambda cause: -float(cause["share"]))
    return out


def step_prefill_tokens(data: ExplainData, window: Window) -> int | None:
    """Prefill tokens of the worker's step spans overlapping `window` (each weighted by the steps it stands
    for), as corroboration of the prefill causes; None when the worker has no step spans."""
    steps = data.steps
    if not len(steps):
        return None
    on_worker = steps.worker == window.worker
    if not on_worker.any():
        return None
    ends = steps.start_ns + np.round(steps.duration_s * 1e9).astype(np.int64)
    inside = on_worker & (steps.start_ns < window.end_ns) & (ends > window.start_ns)
    return int(round(float(np.sum(steps.prefill_tokens[inside] * steps.weight[inside]))))


def explain_stalls(data: ExplainData, trace: Trace) -> list[dict[str, Any]]:
    """Every stall of `trace` as the JSON contract shapes it (architecture.md section 8)."""
    out = []
    for window in stall_windows(data, trace):
        out.append(
            {
                "start_unix_ns": window.start_ns,
                "end_unix_ns": window.end_ns,
                "duration_s": (window.end_ns - window.start_ns) / 1e9,
                "worker": window.worker,
                "estimated": window.estimated,
                "basis": window.basis,
                "engine_prefill_tokens": window.engine_prefill_tokens,
                "step_prefill_tokens": step_prefill_tokens(data, window),
                "causes": causes(data, trace, window),
            }
        )
    return out
