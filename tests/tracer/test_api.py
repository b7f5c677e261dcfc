"""The engine-facing API: Tracer's recorders and NoopTracer accept the same calls."""

from __future__ import annotations

import inspect

from tracer import TraceContext
from tracer.api import NoopTracer, RecordingTracer
from tracer.records import KIND_STAGE, KIND_STAGE_WALL, KIND_STEP, RECORD_TYPES, RecordRing
from tracer.timing import HostClock


def _tracer() -> RecordingTracer:
    return RecordingTracer(HostClock(), RecordRing(64))


def test_stage_signatures_match_so_tracing_off_is_a_drop_in():
    tracer, noop = _tracer(), NoopTracer()
    for name in ("stage", "stage_wall"):
        assert list(inspect.signature(getattr(tracer, name)).parameters) == list(
            inspect.signature(getattr(noop, name)).parameters
        )


def test_span_id_comes_back_whether_passed_by_position_or_keyword():
    ctx = TraceContext.new_root()
    for tracer in (_tracer(), NoopTracer()):
        assert tracer.stage("prefill", ctx, 1, 2, None, 77) == 77
        assert tracer.stage("prefill", ctx, 1, 2, span_id=78) == 78
        assert tracer.stage_wall("kv_transfer", ctx, 1, 2, {}, 79, "checksum") == 79
        assert tracer.stage("queue", ctx, 1, 2) == 0


def test_each_recorder_pushes_one_record_of_its_kind_with_its_fields():
    tracer = _tracer()
    ctx = TraceContext.new_root()
    tracer.stage("queue", ctx, 1, 2)
    tracer.step(3, 4, 8, 0, 100)
    tracer.stage_wall("kv_transfer", ctx, 5, 6, error_type="timeout")
    records = [RECORD_TYPES[r[0]]._make(r) for r in tracer.ring.drain(10)]
    assert [(r.kind, r.start, r.end) for r in records] == [
        (KIND_STAGE, 1, 2),
        (KIND_STEP, 3, 4),
        (KIND_STAGE_WALL, 5, 6),
    ]
    assert records[1].decode_requests == 8 and records[1].context_tokens == 100
    assert records[1].prefill_attention_tokens2 == -1  # not given: the step span then lacks the attribute
    assert records[2].stage == "kv_transfer" and records[2].error_type == "timeout" and records[2].ctx is ctx
