"""Clocks for stage timing: the host clock and CUDA events, behind one interface.

A clock hands the hot path an opaque *mark* (`clock.mark()`), and later, off the hot path, turns a pair
of marks into an `Interval` on the wall-clock timeline (`clock.resolve(start, end, now_ns)`).

- `HostClock`: marks are `perf_counter_ns()` values; one anchor pairs them with `time.time_ns()` so
  spans from several processes and hosts share a timeline. Resolution is immediate.
- `CudaEventClock`: a mark records a `torch.cuda.Event(enable_timing=True)` on the current stream (events
  come from a free list, so steady state allocates nothing). Resolution polls `event.query()` and never
  synchronises; durations come from `elapsed_time`. Wall placement comes from an *anchor* event that the
  engine takes where the host already waits for the device (`anchor()`, e.g. right after sampled tokens
  reach the host): its wall time is known, and every other event is placed by its GPU-time distance from
  it. A pair still incomplete after `timeout_ns` resolves with its host marks and source "host".

Thread contract: `mark()` and `anchor()` run on the engine thread; `resolve()` runs on the one pipeline
thread. Nothing here blocks.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from tracer.vocabulary import SOURCE_CUDA, SOURCE_HOST

perf_counter_ns = time.perf_counter_ns

DEFAULT_CUDA_TIMEOUT_NS = 2_000_000_000  # 2 s: far beyond any step, short enough to keep memory bounded


class Interval(NamedTuple):
    start_wall_ns: int
    end_wall_ns: int
    source: str  # SOURCE_HOST or SOURCE_CUDA


class Clock(Protocol):
    source: str

    def mark(self) -> Any: ...

    def resolve(self, start: Any, end: Any, now_perf_ns: int) -> Interval | None: ...

    def host_perf_ns(self, mark: Any) -> int: ...

    def to_wall_ns(self, perf_ns: int) -> int: ...


class HostClock:
    """`perf_counter_ns` marks anchored once to wall time. Monotonic within a process."""

    source = SOURCE_HOST

    def __init__(self) -> None:
        self.anchor_wall_ns = time.time_ns()
        self.anchor_perf_ns = perf_counter_ns()
        self.mark = perf_counter_ns  # the hot path calls the C function directly

    def to_wall_ns(self, perf_ns: int) -> int:
        return self.anchor_wall_ns + (perf_ns - self.anchor_perf_ns)

    def wall_ns(self) -> int:
        """Now on this clock's wall timeline: what components timing outside the marks (the KV transfer)
        read, so their times and the stage spans' compare exactly within a process."""
        return self.anchor_wall_ns + (perf_counter_ns() - self.anchor_perf_ns)

    def host_perf_ns(self, mark: int) -> int:
        return mark

    def resolve(self, start: int, end: int, now_perf_ns: int) -> Interval:
        return Interval(self.to_wall_ns(start), self.to_wall_ns(end), SOURCE_HOST)


class EventLike(Protocol):
    """What `CudaEventClock` needs of an event: the `torch.cuda.Event` subset (faked in tests)."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: Any) -> float: ...  # milliseconds


class CudaMark(NamedTuple):
    event: EventLike
    host_perf_ns: int


def _torch_cuda_event() -> EventLike:
    import torch

    return torch.cuda.Event(enable_timing=True)


class CudaEventClock:
    """CUDA-event marks, resolved with `query()` and placed on the wall clock through an anchor.

    `event_factory` makes a new timing event (default `torch.cuda.Event(enable_timing=True)`); events are
    recorded on the current stream. Completed events go back to a bounded free list for reuse.
    """

    source = SOURCE_CUDA

    def __init__(
        self,
        event_factory: Callable[[], EventLike] | None = None,
        timeout_ns: int = DEFAULT_CUDA_TIMEOUT_NS,
        free_list_size: int = 4096,
    ) -> None:
        self._host = HostClock()
        self._new_event = event_factory or _torch_cuda_event
        self._free: deque[EventLike] = deque(maxlen=free_list_size)
        self.timeout_ns = timeout_ns
        # (event, wall ns at which the host knew the device had reached it); newest first wins.
        self._anchor: tuple[EventLike, int] | None = None
        self._pending_anchor: CudaMark | None = None

    def _event(self) -> EventLike:
        try:
            return self._free.pop()
        except IndexError:
            return self._new_event()

    def mark(self) -> CudaMark:
        event = self._event()
        event.record()
        return CudaMark(event, perf_counter_ns())

    def anchor(self) -> None:
        """Record an anchor event. Call it right after the host has waited for the device (tokens copied
        to the host): the stream is then idle, so the event completes almost at the host time taken here."""
        self._pending_anchor = self.mark()

    def host_perf_ns(self, mark: CudaMark) -> int:
        return mark.host_perf_ns

    def to_wall_ns(self, perf_ns: int) -> int:
        return self._host.to_wall_ns(perf_ns)

    def wall_ns(self) -> int:
        """Now on the host timeline that host-timed marks and `to_wall_ns` use (see HostClock.wall_ns)."""
        return self._host.wall_ns()

    def _current_anchor(self) -> tuple[EventLike, int] | None:
        pending = self._pending_anchor
        if pending is not None and pending.event.query():
            self._anchor = (pending.event, self._host.to_wall_ns(pending.host_perf_ns))
            self._pending_anchor = None
        return self._anchor

    def resolve(self, start: CudaMark, end: CudaMark, now_perf_ns: int) -> Interval | None:
        """The pair's interval, None while the device has not reached `end` (and timeout not passed)."""
        if end.event.query() and start.event.query():
            duration_ns = round(start.event.elapsed_time(end.event) * 1e6)
            anchor = self._current_anchor()
            if anchor is not None:
                anchor_event, anchor_wall_ns = anchor
                start_wall_ns = anchor_wall_ns + round(anchor_event.elapsed_time(start.event) * 1e6)
            else:  # no anchor yet: the enqueue time is the best lower bound the host has
                start_wall_ns = self._host.to_wall_ns(start.host_perf_ns)
            self._free.append(start.event)
            self._free.append(end.event)
            return Interval(start_wall_ns, start_wall_ns + duration_ns, SOURCE_CUDA)
        if now_perf_ns - end.host_perf_ns > self.timeout_ns:
            # Events never reused: the device may still write them.
            return Interval(
                self._host.to_wall_ns(start.host_perf_ns), self._host.to_wall_ns(end.host_perf_ns), SOURCE_HOST
            )
        return None


def default_clock(device: str = "cpu") -> HostClock | CudaEventClock:
    """CUDA events on a CUDA device, the host clock otherwise."""
    return CudaEventClock() if str(device).startswith("cuda") else HostClock()
