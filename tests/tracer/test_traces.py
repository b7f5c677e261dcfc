"""tracer.otlp readers: OTLP/JSON lines written by the OpenTelemetry encoder read back field for field."""

from __future__ import annotations

import json
import multiprocessing

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode

from tracer.export.otel import OtlpJsonFileExporter, encode_line
from tracer.otlp import SPAN_KIND_SERVER, STATUS_ERROR, ReadStats, TraceFileError, iter_spans


def _finished_spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "router"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("root", kind=SpanKind.SERVER, attributes={"n": 3, "s": "x"}) as root:
        with tracer.start_as_current_span("child", attributes={"f": 0.25, "b": True, "l": [1, 2]}) as child:
            child.add_event("splitscope.decode.stall", {"gap_s": 0.5, "prefill_tokens": 2000})
            child.set_status(Status(StatusCode.ERROR, "boom"))
        root.set_attribute("late", "yes")
    return exporter.get_finished_spans()


def test_spans_written_by_the_sdk_encoder_read_back_identically(tmp_path):
    sdk_spans = _finished_spans()
    path = tmp_path / "t.jsonl"
    path.write_bytes(encode_line(sdk_spans))

    read = {span.name: span for span in iter_spans([path])}
    for sdk_span in sdk_spans:
        span = read[sdk_span.name]
        assert span.trace_id == format(sdk_span.context.trace_id, "032x")
        assert span.span_id == format(sdk_span.context.span_id, "016x")
        expected_parent = format(sdk_span.parent.span_id, "016x") if sdk_span.parent else ""
        assert span.parent_span_id == expected_parent
        assert (span.start_ns, span.end_ns) == (sdk_span.start_time, sdk_span.end_time)
        assert span.attributes == {k: list(v) if isinstance(v, tuple) else v for k, v in sdk_span.attributes.items()}
        assert span.resource["service.name"] == "router"
    assert read["root"].kind == SPAN_KIND_SERVER
    assert read["child"].status_code == STATUS_ERROR and read["child"].status_message == "boom"
    (event,) = read["child"].events
    assert event.name == "splitscope.decode.stall" and event.attributes == {"gap_s": 0.5, "prefill_tokens": 2000}


def test_line_is_collector_format_with_hex_ids(tmp_path):
    (span, *_) = _finished_spans()
    obj = json.loads(encode_line([span]))
    raw = obj["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert raw["traceId"] == format(span.context.trace_id, "032x")
    assert isinstance(raw["startTimeUnixNano"], str)  # int64 as a decimal string, per proto3 JSON


def _append_many(path: str, worker: int) -> None:
    exporter = OtlpJsonFileExporter(path)
    spans = _finished_spans()
    for _ in range(50):
        exporter.export(spans)


def test_concurrent_appends_from_processes_never_interleave(tmp_path):
    path = str(tmp_path / "shared.jsonl")
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_append_many, args=(path, i)) for i in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
        assert w.exitcode == 0
    stats = ReadStats()
    assert sum(1 for _ in iter_spans([path], stats=stats)) == 3 * 50 * 2
    assert stats.lines == 150 and stats.skipped_lines == 0


@pytest.mark.parametrize(
    "bad_line, reason",
    [
        ('{"resourceSpans": [', "not valid JSON"),
        ('{"foo": 1}', "no resourceSpans"),
        ('{"resourceSpans":[{"scopeSpans":[{"spans":[{"traceId":"zz","spanId":"00"}]}]}]}', "traceId"),
        (
            '{"resourceSpans":[{"scopeSpans":[{"spans":[{"traceId":"0af7651916cd43dd8448eb211c80319c",'
            '"spanId":"b7ad6b7169203331","name":5,"startTimeUnixNano":"1","endTimeUnixNano":"2"}]}]}]}',
            "name must be a string",
        ),
        (
            '{"resourceSpans":[{"scopeSpans":[{"spans":[{"traceId":"0af7651916cd43dd8448eb211c80319c",'
            '"spanId":"b7ad6b7169203331","name":"x","endTimeUnixNano":"2"}]}]}]}',
            "startTimeUnixNano",
        ),
    ],
)
def test_bad_line_names_its_line_number_or_is_skipped(tmp_path, bad_line, reason):
    good = encode_line(_finished_spans()).decode()
    path = tmp_path / "t.jsonl"
    path.write_text(good + bad_line + "\n" + good)
    with pytest.raises(TraceFileError) as info:
        list(iter_spans([path]))
    assert info.value.line_number == 2 and reason in str(info.value)
    assert str(path) in str(info.value)

    stats = ReadStats()
    assert len(list(iter_spans([path], skip_bad=True, stats=stats))) == 4
    assert stats.skipped_lines == 1 and stats.first_error.line_number == 2


def test_a_growing_file_leaves_the_line_being_written_for_the_next_read(tmp_path):
    good = encode_line(_finished_spans())
    path = tmp_path / "live.jsonl"
    path.write_bytes(good + good[: len(good) // 2])  # a writer is halfway through its second line
    with pytest.raises(TraceFileError):  # read as a finished file, the torn line is an error
        list(iter_spans([path]))
    assert len(list(iter_spans([path], growing=True))) == 2
    path.write_bytes(good + good)  # the writer finished
    assert len(list(iter_spans([path], growing=True))) == 4


def test_span_links_survive_the_sdk_encoders_and_read_back_from_json_and_protobuf(tmp_path):
    """A decode span's stall links, as the pipeline hands them over, read back from both file formats."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    from tracer import spans as s
    from tracer.export.otel import make_resource, to_readable_span

    linked_trace, linked_span = (7 << 100) + 3, 0xABCDEF
    data = s.SpanData(
        s.SPAN_DECODE,
        s.KIND_INTERNAL,
        5 << 90,
        9,
        4,
        100,
        200,
        {s.ATTR_DECODE_STALLED_NS: 70},
        links=[(linked_trace, linked_span, {s.ATTR_LINK_STALLED_NS: 70, s.ATTR_LINK_PREFILL_TOKENS: 2000})],
    )
    span = to_readable_span(data, make_resource("w"))
    json_path, proto_path = tmp_path / "t.jsonl", tmp_path / "t.pb"
    json_path.write_bytes(encode_line([span]))
    message = encode_spans([span]).SerializeToString()
    proto_path.write_bytes(len(message).to_bytes(4, "big") + message)
    for path in (json_path, proto_path):
        (read,) = iter_spans([path])
        (link,) = read.links
        assert (link.trace_id, link.span_id) == (f"{linked_trace:032x}", f"{linked_span:016x}")
        assert link.attributes == {s.ATTR_LINK_STALLED_NS: 70, s.ATTR_LINK_PREFILL_TOKENS: 2000}
