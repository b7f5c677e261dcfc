"""tracer.timing: host clock placement, and the CUDA-event path through a fake event type."""

from __future__ import annotations

import time

import torch

from tracer.timing import SOURCE_CUDA, SOURCE_HOST, CudaEventClock, HostClock


class FakeDevice:
    """A device timeline the test advances by hand; events complete when the device reaches them."""

    def __init__(self) -> None:
        self.enqueued_ms = 0.0  # device time of the last enqueued work
        self.reached_ms = 0.0  # how far the device has executed

    def run(self, work_ms: float) -> None:
        self.enqueued_ms += work_ms


class FakeEvent:
    def __init__(self, device: FakeDevice) -> None:
        self.device = device
        self.at_ms: float | None = None
        self.synchronize_calls = 0

    def record(self) -> None:
        self.at_ms = self.device.enqueued_ms

    def query(self) -> bool:
        return self.at_ms is not None and self.device.reached_ms >= self.at_ms

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "elapsed_time on an incomplete event would synchronise"
        return end.at_ms - self.at_ms

    def synchronize(self) -> None:  # pragma: no cover - must never be called
        raise AssertionError("the clock synchronised")


def test_host_clock_places_marks_on_the_wall_clock():
    clock = HostClock()
    before = time.time_ns()
    start = clock.mark()
    end = clock.mark()
    interval = clock.resolve(start, end, clock.mark())
    after = time.time_ns()
    assert interval.source == SOURCE_HOST
    assert before - 5_000_000 <= interval.start_wall_ns <= interval.end_wall_ns <= after + 5_000_000


def test_host_clock_times_real_torch_work_on_cpu():
    clock = HostClock()
    x = torch.randn(256, 256)
    start = clock.mark()
    for _ in range(20):
        x = torch.tanh(x @ x)
    end = clock.mark()
    interval = clock.resolve(start, end, clock.mark())
    assert interval.end_wall_ns - interval.start_wall_ns == end - start > 0


def test_cuda_record_stays_pending_until_the_device_reaches_it_then_has_device_duration():
    device = FakeDevice()
    clock = CudaEventClock(event_factory=lambda: FakeEvent(device))
    start = clock.mark()
    device.run(7.5)
    end = clock.mark()

    assert clock.resolve(start, end, time.perf_counter_ns()) is None  # nothing emitted before completion
    device.reached_ms = 7.5
    interval = clock.resolve(start, end, time.perf_counter_ns())
    assert interval.source == SOURCE_CUDA
    assert interval.end_wall_ns - interval.start_wall_ns == 7_500_000


def test_cuda_anchor_places_device_time_on_the_wall_clock():
    device = FakeDevice()
    clock = CudaEventClock(event_factory=lambda: FakeEvent(device))
    clock.anchor()  # the host waited for the device here: device time 0 == this wall time
    anchor_wall_ns = clock.to_wall_ns(clock._pending_anchor.host_perf_ns)
    device.run(3.0)
    start = clock.mark()
    device.run(2.0)
    end = clock.mark()
    device.reached_ms = 5.0
    interval = clock.resolve(start, end, time.perf_counter_ns())
    assert interval.start_wall_ns == anchor_wall_ns + 3_000_000
    assert interval.end_wall_ns == anchor_wall_ns + 5_000_000


def test_cuda_record_past_timeout_falls_back_to_host_timing_and_never_reuses_its_events():
    device = FakeDevice()
    made = []

    def factory():
        made.append(FakeEvent(device))
        return made[-1]

    clock = CudaEventClock(event_factory=factory, timeout_ns=1_000)
    start = clock.mark()
    device.run(1.0)
    end = clock.mark()
    interval = clock.resolve(start, end, end.host_perf_ns + 2_000)
    assert interval.source == SOURCE_HOST
    assert interval.end_wall_ns - interval.start_wall_ns == end.host_perf_ns - start.host_perf_ns
    clock.mark()
    assert len(made) == 3  # the timed-out events were not recycled


def test_completed_events_are_recycled_so_steady_state_allocates_none():
    device = FakeDevice()
    made = []
    clock = CudaEventClock(event_factory=lambda: made.append(FakeEvent(device)) or made[-1])
    for _ in range(10):
        start = clock.mark()
        device.run(1.0)
        end = clock.mark()
        device.reached_ms = device.enqueued_ms
        assert clock.resolve(start, end, time.perf_counter_ns()) is not None
    assert len(made) == 2
