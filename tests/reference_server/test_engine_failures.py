"""The engine loop outlives one bad iteration and gives up, loudly, on a deterministic failure."""

from __future__ import annotations

import threading

import torch

from reference_server.engine import EVENT_DONE, EVENT_ERROR, MAX_CONSECUTIVE_LOOP_FAILURES, Engine
from reference_server.kv_cache import KVCachePool
from reference_server.model import ModelArgs, build_model
from reference_server.scheduler import Request
from tests.conftest import wait_for
from tracer import NoopTracer, TraceContext


def _engine(on_fatal) -> Engine:
    args = ModelArgs.from_name("tiny")
    events = []
    engine = Engine(
        role="colocated",
        model=build_model(args),
        kv_pool=KVCachePool(args, 64, 16, device="cpu", dtype=torch.float32),
        token_budget=args.max_seq_len,
        max_batch_seqs=4,
        tracer=NoopTracer(),
        metrics=None,
        deliver=events.extend,
        on_fatal=on_fatal,
    )
    engine.delivered = events
    return engine


def test_a_deterministic_failure_stops_the_loop_fails_its_requests_and_reports_it():
    gave_up = threading.Event()
    reasons = []
    engine = _engine(lambda reason: (reasons.append(reason), gave_up.set()))
    calls = []

    def broken_schedule():  # a bug in the loop itself (a failing model step is handled inside the step)
        calls.append(1)
        raise RuntimeError("shape mismatch")

    engine.scheduler.schedule = broken_schedule
    engine.submit(Request("r1", (1, 2, 3), 4), TraceContext.new_root(), sink=lambda event: None)
    engine.start()
    assert gave_up.wait(30), "the engine kept looping on a deterministic failure"
    engine._thread.join(5)
    assert not engine._thread.is_alive()
    assert len(calls) == MAX_CONSECUTIVE_LOOP_FAILURES
    assert "shape mismatch" in engine.fatal_error and reasons == [engine.fatal_error]
    ((_, event),) = engine.delivered
    assert event[0] == EVENT_ERROR and event[1] == 503  # the request failed cleanly, retryable elsewhere


def test_failures_that_are_not_in_a_row_do_not_stop_the_loop():
    engine = _engine(lambda reason: None)
    real_schedule = engine.scheduler.schedule
    calls = []

    def every_other_schedule_fails():
        calls.append(1)
        if len(calls) % 2:
            raise RuntimeError("transient")
        return real_schedule()

    engine.scheduler.schedule = every_other_schedule_fails
    engine.submit(
        Request("r1", (1, 2, 3), 2 * MAX_CONSECUTIVE_LOOP_FAILURES), TraceContext.new_root(), sink=lambda event: None
    )
    engine.start()
    try:
        wait_for(lambda: any(event[0] == EVENT_DONE for _, event in engine.delivered), 60, "the request to finish")
        assert engine.fatal_error == "" and engine._thread.is_alive()
        assert len(calls) > MAX_CONSECUTIVE_LOOP_FAILURES  # more failures in all than the limit, never in a row
    finally:
        engine.stop()


def test_a_failing_model_step_fails_its_requests_with_500_and_the_loop_goes_on():
    engine = _engine(lambda reason: None)
    real_model = engine.model
    calls = []

    def model_fails_once(slices, pool):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("device fault")
        return real_model(slices, pool)

    engine.model = model_fails_once
    engine.submit(Request("r1", (1, 2, 3), 4), TraceContext.new_root(), sink=lambda event: None)
    engine.start()
    try:
        wait_for(lambda: engine.delivered, 30, "the failed step's answer")
        ((_, event),) = engine.delivered
        assert event[:3] == (EVENT_ERROR, 500, "engine_error") and "RuntimeError: device fault" in event[3]
        engine.submit(Request("r2", (1, 2, 3), 2), TraceContext.new_root(), sink=lambda event: None)
        wait_for(lambda: any(event[0] == EVENT_DONE for _, event in engine.delivered), 60, "the next request to finish")
        assert engine.fatal_error == "" and len(calls) > 1
    finally:
        engine.stop()
