"""Consecutive time windows over loaded traces, by request start time, and the traces cut to one of them.

The files are read once (tracer.report.tables.load_traces); a window is a slice of those tables: the
requests that arrived in it and the step spans that started in it. The deployment's own facts stay whole:
the workers seen (the current layout) and the KV transfers (the link; the transfer table has no times).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tracer.report.tables import TraceData


@dataclass(frozen=True)
class Window:
    start_ns: int  # inclusive
    end_ns: int  # exclusive


def split(data: TraceData, width_s: float) -> list[Window]:
    """Windows of `width_s` from the first request's arrival past the last one's; empty windows included
    (a lull is a window with no requests). None when the traces hold no request."""
    if width_s <= 0:
        raise ValueError("the window must be a positive duration")
    if not len(data.requests):
        return []
    start = int(data.requests.arrival_ns.min())
    end = int(data.requests.arrival_ns.max()) + 1
    width = max(int(width_s * 1e9), 1)
    return [Window(s, min(s + width, end)) for s in range(start, end, width)]


def cut(data: TraceData, start_ns: int, end_ns: int) -> TraceData:
    """`data` restricted to requests arriving in [start_ns, end_ns) and steps starting there."""
    requests, steps = data.requests, data.steps
    return replace(
        data,
        requests=requests.select((requests.arrival_ns >= start_ns) & (requests.arrival_ns < end_ns)),
        steps=steps.select((steps.start_ns >= start_ns) & (steps.start_ns < end_ns)),
    )


def count(data: TraceData, start_ns: int, end_ns: int) -> int:
    """Requests arriving in [start_ns, end_ns)."""
    arrival = data.requests.arrival_ns
    return int(((arrival >= start_ns) & (arrival < end_ns)).sum())
