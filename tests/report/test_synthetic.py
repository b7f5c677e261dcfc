"""Synthetic trace files: the same JSON shape the SDK encoder writes, and the architecture.md §4 contract."""

from __future__ import annotations

from collections import Counter, defaultdict

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from tests.synthetic import request_line, span_dict
from tracer.export.otel import encode_line
from tracer.otlp import SPAN_KIND_INTERNAL, iter_spans
from tracer.report.tables import load_traces

TRACE_ID, SPAN_ID, PARENT_ID = 0x0AF7651916CD43DD8448EB211C80319C, 0x00F067AA0BA902B7, 0x1111111111111111
ATTRIBUTES = {
    "splitscope.pool": "decode",
    "splitscope.decode.itl_p99_s": 0.031,
    "gen_ai.usage.output_tokens": 17,
    "ok": True,
}
RESOURCE = {"service.name": "splitscope-decode", "service.instance.id": "decode-0"}


def test_direct_json_reads_back_exactly_like_the_sdk_encoder_output(tmp_path):
    sdk_span = ReadableSpan(
        name="splitscope.decode",
        context=SpanContext(TRACE_ID, SPAN_ID, False, TraceFlags(1)),
        parent=SpanContext(TRACE_ID, PARENT_ID, False),
        resource=Resource(RESOURCE),
        attributes=ATTRIBUTES,
        events=(Event("splitscope.decode.stall", {"gap_s": 0.2, "prefill_tokens": 512}, timestamp=1_500),),
        kind=SpanKind.INTERNAL,
        status=Status(StatusCode.UNSET),
        start_time=1_000,
        end_time=2_000,
        instrumentation_scope=InstrumentationScope("splitscope"),
    )
    ours = span_dict(
        trace_id=format(TRACE_ID, "032x"),
        span_id=format(SPAN_ID, "016x"),
        parent_span_id=format(PARENT_ID, "016x"),
        name="splitscope.decode",
        kind=SPAN_KIND_INTERNAL,
        start_ns=1_000,
        end_ns=2_000,
        attributes=ATTRIBUTES,
        events=[("splitscope.decode.stall", 1_500, {"gap_s": 0.2, "prefill_tokens": 512})],
    )
    (tmp_path / "sdk.jsonl").write_bytes(encode_line([sdk_span]))
    (tmp_path / "ours.jsonl").write_text(request_line([(RESOURCE, [ours])]))
    (from_sdk,) = iter_spans([tmp_path / "sdk.jsonl"])
    (from_ours,) = iter_spans([tmp_path / "ours.jsonl"])
    assert from_ours == from_sdk


def test_every_request_carries_the_stage_spans_and_every_step_is_written(scenario_traces):
    sc, path, truth = scenario_traces("wrong-split")
    by_trace: dict[str, list[str]] = defaultdict(list)
    for span in iter_spans([path]):
        by_trace[span.trace_id].append(span.name)
    requests = [names for names in by_trace.values() if any(n.startswith("text_completion") for n in names)]
    assert len(requests) == len(sc.workload)
    for names in requests:
        assert {
            "splitscope.queue",
            "splitscope.prefill",
            "splitscope.kv_transfer",
            "splitscope.kv_transfer.send",
            "splitscope.kv_transfer.recv",
            "splitscope.decode",
        } <= set(names)
    steps = Counter(name for names in by_trace.values() for name in names)["splitscope.step"]
    assert steps == sum(len(log.duration_s) for log in truth.steps.values())
    data = load_traces([path])
    assert data.workers == {"prefill": ["prefill-0", "prefill-1", "prefill-2"], "decode": ["decode-0"]}
    assert abs(float(data.requests.ttft_s.mean()) - float(truth.ttft_s.mean())) < 1e-6
